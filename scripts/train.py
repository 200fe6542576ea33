"""Train a small hybrid Mamba2/attention model with its MTP draft head on the Python standard library.

    python scripts/train.py --out weights/stdlib-hybrid-8m            # the default run, < 60 min on 2 CPU cores
    python scripts/train.py --out /tmp/ckpt --smoke                     # a few seconds: tiny config, 5 steps

Steps:
 1. corpus: the *.py files of this interpreter's stdlib (sorted; no test packages, no site-packages, no
    generated codec tables); the modules of HELD_OUT are never trained on and give the held-out loss
    and the benchmark prompts.
 2. a byte-level BPE tokenizer (tokenizers) on the training files; documents are joined by EOS.
 3. the model of docs/DESIGN.md §2 trained jointly with its MTP head:
        loss = CE(logits_p, x_{p+1}) + mtp_weight * CE(mtp_logits(o_p), x_{p+2}),
        o_p = MTP(h_p, x_{p+1}),  h_p the base model's final-normed hidden.
    AdamW, linear warmup + cosine decay, gradient clipping; Mamba layers use the chunked SSD scan
    (nano_spec/model/ssd.py) because the reference scan is a Python loop over T.
 4. a checkpoint: config.json, model.safetensors (nano_spec.model.weights.write_model), tokenizer.json, train_log.json,
    eval_prompts.jsonl (held-out source chunks cut at line boundaries, for the benchmarks), swapped in whole
    (replace_dir) at every evaluation and at the end: an interrupted save leaves the old output or the new one.
    A NaN or infinite loss or weight stops the run with exit 1 and one line; nothing more is written. An --out
    that is a symbolic link, or an existing path train.py did not write, is refused before anything runs.

With --steps 0 (the default) training runs until --max-minutes (less a reserve for the final eval and
save) and the cosine decay follows the wall time, so the run ends on schedule however loaded the machine is.
"""
import argparse
import copy
import functools
import json
import math
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # nano_spec, nano_spec_kernels: runnable without installing
sys.path.insert(0, str(ROOT / "scripts"))  # arg_types, also when this file is imported

from arg_types import Parser, device, integer, learning_rate, number, threads  # noqa: E402

from nano_spec.model import ssd  # noqa: E402
from nano_spec.engine import threads as engine_threads  # noqa: E402  (the name threads is arg_types')
from nano_spec.model.config import ModelConfig  # noqa: E402
from nano_spec.model.model import HybridLM  # noqa: E402
from nano_spec.model.ops import Ops  # noqa: E402
from nano_spec.model.weights import init_weights, replace_dir, write_model  # noqa: E402

EOS = "<|endoftext|>"
LOG_FILE = "train_log.json"
HELD_OUT = ("json", "csv", "textwrap", "heapq", "bisect", "fractions", "statistics", "string", "shlex", "difflib")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
GENERATED_MARK = "### Decoding Table"  # gencodec.py output: 256-entry tables, not code worth tokens


# ---- 1. corpus ---------------------------------------------------------------------------------
def stdlib_files(max_files: int | None = None):
    """-> (train [(rel path, text)], held_out [(rel path, text)]), both in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = rel.parts[0].removesuffix(".py")
        if module in HELD_OUT:
            held.append((str(rel), text))
        elif GENERATED_MARK not in text and (max_files is None or len(train) < max_files):
            train.append((str(rel), text))
    return train, held


# ---- 2. tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok: Tokenizer, texts, eos: int) -> torch.Tensor:
    """Every document preceded by EOS, concatenated -> (n,) int64."""
    ids = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ---- 3. model ----------------------------------------------------------------------------------
def make_config(args, vocab_size: int, eos: int) -> ModelConfig:
    layer_types = ["mamba" if c == "m" else "attention" for c in args.layers]
    n_heads = 2 * args.d_model // args.head_dim  # mamba_expand = 2: d_in = 2 D = H P
    return ModelConfig.from_dict(dict(
        vocab_size=vocab_size, hidden_size=args.d_model, layer_types=layer_types,
        num_attention_heads=args.attn_heads, num_key_value_heads=args.kv_heads,
        shared_intermediate_size=args.mlp, mamba_n_heads=n_heads, mamba_d_head=args.head_dim,
        mamba_n_groups=1, mamba_d_state=args.d_state, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=args.chunk, attention_multiplier=1.0 / math.sqrt(args.d_model // args.attn_heads),
        embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, position_embedding_type="nope", max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos, num_nextn_predict_layers=1))


def build_model(cfg: ModelConfig, seed: int) -> HybridLM:
    ops = Ops("torch")  # differentiable references, with the SSD scan in place of the per-token loop
    ops.mamba_scan = functools.partial(ssd.mamba_scan_chunked, chunk_size=cfg.mamba_chunk_size)
    model = init_weights(HybridLM(cfg, ops), std=0.02, seed=seed)
    with torch.no_grad():  # GPT-2 style: residual-branch outputs scaled so the stream's variance stays O(1)
        scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + 1))
        for name, p in model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "output_linear.weight")):
                p.mul_(scale)
    return model


def losses(model: HybridLM, batch):
    """batch (B, T+1) -> (next-token CE, MTP CE, MTP/base argmax agreement) over T and T-1 positions."""
    T = batch.shape[1] - 1
    h = model.hidden(batch[:, :T])  # (B, T, D) final-normed
    logits = model.logits(h)  # (B, T, V)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    o = model.mtp_hidden(batch[:, 1:T], h[:, :T - 1])  # (B, T-1, D): position p predicts x_{p+2}
    mtp_logits = model.mtp_logits(o)  # (B, T-1, V)
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), batch[:, 2:].flatten())
    # Greedy draft-1 acceptance proxy: the draft matches what the base model picks one row later.
    agree = (mtp_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return ce, mtp, agree


def windows(stream: torch.Tensor, T: int) -> torch.Tensor:
    """Non-overlapping (T+1)-token windows (adjacent ones share one token) -> (n, T+1)."""
    n = (stream.numel() - 1) // T
    return stream[: n * T + 1].unfold(0, T + 1, T)


@torch.no_grad()
def evaluate(model, eval_windows, batch_size: int, amp) -> dict:
    model.eval()
    tot = torch.zeros(3)
    for i in range(0, len(eval_windows), batch_size):
        b = eval_windows[i:i + batch_size]
        with amp():
            tot += torch.stack(losses(model, b)).float() * len(b)
    model.train()
    ce, mtp, agree = (tot / len(eval_windows)).tolist()
    return {"loss": ce, "mtp_loss": mtp, "mtp_agree": agree}


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over args.warmup steps, then cosine from lr to min_lr_frac * lr as progress goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, max(0.0, progress))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def thread_tuner(choice) -> engine_threads.ThreadTuner:
    """The engine's tuner (nano_spec/engine/threads.py) for --threads: auto measures 1 and 2 threads step by step, N always
    runs N. A run calls apply() before each step and observe(shape, seconds) after each timed one."""
    return engine_threads.ThreadTuner(2 if choice == "auto" else choice, tune=choice == "auto")


# ---- 4. benchmark prompts ----------------------------------------------------------------------
def eval_prompts(tok: Tokenizer, held, n: int, seed: int, lo: int = 100, hi: int = 300):
    """n chunks of held-out source, each lo..hi tokens, starting at a def/class/decorator line and ending
    at a line end; spread evenly over the held-out modules and, within a module, over its definitions.
    A module too small for its share leaves the rest to the others (second pass)."""
    rng = random.Random(seed)
    by_module = {m: [(p, t) for p, t in held if p.split("/")[0].removesuffix(".py") == m] for m in HELD_OUT}
    mods = [m for m in HELD_OUT if by_module[m]]

    def chunks(files, want):
        """Prompts of one module: `want` spread evenly over its definitions first, then the rest in order."""
        starts = [(p, lines, i) for p, t in files for lines in [t.splitlines(keepends=True)]
                  for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class ", "@"))
                  and (i == 0 or not lines[i - 1].lstrip().startswith("@"))]
        spread = [int((j + 0.5) * len(starts) / want) for j in range(want)]
        taken = []
        for j in spread + [j for j in range(len(starts)) if j not in spread]:
            p, lines, i = starts[j]
            if any(q == p and abs(i - s) < 40 for q, s in taken):  # no two prompts from one stretch of code
                continue
            target, text, count = rng.randint(lo + 50, hi - 50), "", 0
            for ln in lines[i:]:
                c = len(tok.encode(text + ln, add_special_tokens=False).ids)
                if c > hi:
                    break
                text, count = text + ln, c
                if count >= target:
                    break
            if count >= lo:
                taken.append((p, i))
                yield {"prompt": text, "source": f"{p}:{i + 1}", "n_tokens": count}

    gens = [chunks(by_module[m], n // len(mods) + (k < n % len(mods))) for k, m in enumerate(mods)]
    out = []
    for k, g in enumerate(gens):  # first pass: each module its share
        out += [c for _, c in zip(range(n // len(mods) + (k < n % len(mods))), g)]
    while len(out) < n and gens:  # second pass: one more from each module that has any left
        for g in list(gens):
            c = next(g, None)
            if c is None:
                gens.remove(g)
            elif len(out) < n:
                out.append(c)
    return out


# ---- outputs (train_mtp.py and train_dflash.py write theirs through these) -----------------------
class Diverged(RuntimeError):
    """Training produced a NaN or an infinity: the run stops and writes nothing (the scripts exit 1 with one line)."""


def require_finite(step: int, tensors: dict):
    """Raise Diverged naming the first of tensors ({name: tensor}) holding a NaN or an infinity, so a diverged run
    never saves its weights over a good output."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise Diverged(f"training diverged: non-finite {name} at step {step}; try a lower --lr "
                           "(the output directory is left as it was)")


def check_out(flag: str, path: Path, log_file: str, script: str):
    """Refuse an output the save cannot replace safely: a symbolic link (replace_dir renames directories: it would
    replace the link, not its target), or an existing path that `script` did not write (a file, or a directory
    holding something but no log_file): the save deletes what was there."""
    if path.is_symlink():
        raise ValueError(f"{flag}: {path} is a symbolic link; name the directory itself ({path.resolve()})")
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / log_file).is_file())):
        raise ValueError(f"{flag}: {path} exists and is not an output of {script}; choose a new directory")


def write_checkpoint(model, out: Path, log: dict, tok: Tokenizer, prompts=None):
    """out <- config.json + model.safetensors + tokenizer.json + LOG_FILE (+ eval_prompts.jsonl), swapped in
    atomically (replace_dir); a model with a NaN or an infinity is refused (Diverged), out left as it is."""
    # Under ~9M params fp32 keeps the directory below 40 MB; bigger models are stored as bf16.
    if sum(p.numel() for p in model.parameters()) >= 9e6:
        model = copy.deepcopy(model).to(torch.bfloat16)
    require_finite(log["steps"], model.state_dict())  # as stored

    def fill(tmp: Path):
        write_model(model, tmp)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
        if prompts is not None:
            (tmp / "eval_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    replace_dir(out, fill)


# ---- the run -----------------------------------------------------------------------------------
def layer_letters(text: str) -> str:
    if not text or set(text) - set("ma"):
        raise argparse.ArgumentTypeError(f"must be letters m (Mamba2) and a (attention), got {text!r}")
    return text


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n")[0])
    count, size, positive = integer(0), integer(1), number(0, above=True)
    ap.add_argument("--out", required=True, help="checkpoint directory, e.g. weights/stdlib-hybrid-8m")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus/config/steps: a test of the pipeline")
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--threads", type=threads, default="auto",
                    help="intra-op threads, or auto: 2 or 1, whichever is faster")
    ap.add_argument("--seed", type=count, default=0)
    ap.add_argument("--max-minutes", type=positive, default=56.0, help="wall budget of the whole run")
    ap.add_argument("--steps", type=count, default=0, help="0: as many as --max-minutes allows")
    ap.add_argument("--amp", choices=("none", "bf16"), default="bf16", help="autocast dtype for the matmuls")
    ap.add_argument("--max-files", type=size, default=None, help="use only the first N training files")
    ap.add_argument("--vocab", type=size, default=4096)
    ap.add_argument("--d-model", type=size, default=256)
    ap.add_argument("--layers", type=layer_letters, default="mmamma",
                    help="one letter per layer: m = Mamba2, a = attention")
    ap.add_argument("--head-dim", type=size, default=64, help="Mamba head dim P (heads H = 2 D / P)")
    ap.add_argument("--d-state", type=size, default=64, help="Mamba state size N")
    ap.add_argument("--attn-heads", type=size, default=4)
    ap.add_argument("--kv-heads", type=size, default=2)
    ap.add_argument("--mlp", type=size, default=768, help="shared_intermediate_size")
    ap.add_argument("--chunk", type=size, default=64, help="SSD chunk length")
    ap.add_argument("--seq-len", type=integer(2), default=512)
    ap.add_argument("--batch", type=size, default=8)
    ap.add_argument("--lr", type=learning_rate, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=number(0, 1), default=0.1)
    ap.add_argument("--warmup", type=count, default=40)
    ap.add_argument("--weight-decay", type=number(0), default=0.1)
    ap.add_argument("--clip", type=positive, default=1.0)
    ap.add_argument("--mtp-weight", type=number(0), default=0.4)
    ap.add_argument("--eval-every", type=size, default=200)
    ap.add_argument("--eval-windows", type=size, default=48)
    ap.add_argument("--log-every", type=size, default=10)
    ap.add_argument("--prompts", type=count, default=32)
    args = ap.parse_args(argv)
    if args.smoke:
        args.__dict__.update(max_files=12, vocab=300, d_model=32, layers="ma", head_dim=16, d_state=8, attn_heads=2,
                             kv_heads=1, mlp=48, chunk=16, seq_len=32, batch=2, warmup=2, steps=args.steps or 5,
                             eval_every=3, eval_windows=4, log_every=1, prompts=4)
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_out("--out", Path(args.out), LOG_FILE, "train.py")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(args)
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run(args):
    """Train the model of args and write --out (at every evaluation, and at the end)."""
    t0 = time.time()
    deadline = t0 + 60 * args.max_minutes
    tuner = thread_tuner(args.threads)  # every step has one shape (Bsz, T)
    tuner.apply()
    step_seconds = Counter()  # thread count -> seconds of the timed steps run on it
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp_on = args.amp == "bf16"
    amp = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=amp_on)
    log = lambda msg: print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)  # noqa: E731

    train_docs, held_docs = stdlib_files(args.max_files)
    log(f"corpus: {len(train_docs)} training files ({sum(len(t) for _, t in train_docs) / 1e6:.2f} MB), "
        f"{len(held_docs)} held-out files of {len(HELD_OUT)} modules")
    tok = train_tokenizer([t for _, t in train_docs], args.vocab)
    eos = tok.token_to_id(EOS)
    train_stream = token_stream(tok, [t for _, t in train_docs], eos)
    held_stream = token_stream(tok, [t for _, t in held_docs], eos)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train {train_stream.numel():,} tokens, "
        f"held-out {held_stream.numel():,} tokens")

    T, Bsz = args.seq_len, args.batch
    train_w = windows(train_stream, T)  # (n, T+1)
    held_all = windows(held_stream, T)
    held_w = held_all[torch.linspace(0, len(held_all) - 1, min(args.eval_windows, len(held_all))).long()]
    cfg = make_config(args, tok.get_vocab_size(), eos)
    model = build_model(cfg, args.seed).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M params, layers {args.layers}, D {cfg.hidden_size}, "
        f"Mamba H {cfg.mamba_n_heads} P {cfg.mamba_d_head} N {cfg.mamba_d_state}, "
        f"attention {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads; batch {Bsz} x {T}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms, biases, A_log, D, dt_bias
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=False)
    order = torch.Generator().manual_seed(args.seed)
    perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, 0

    # With --steps the cosine runs over steps (deterministic); otherwise over the wall time left after the
    # warmup, so the schedule still ends decayed when other work on the machine slows the steps down.
    reserve = 30.0 + 0.02 * (deadline - time.time())  # final eval, prompts and save
    stop_at = deadline - reserve
    history, evals, step, tokens, stopped_early = [], [], 0, 0, False
    ema, t_decay = None, None
    t_train = time.time()

    def checkpoint(final: bool):
        log_d = {
            "finished": final, "command": " ".join([Path(sys.executable).name] + sys.argv),
            "args": vars(args), "config": cfg.to_dict(), "params": n_params,
            "corpus": {"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
                       "train_files": len(train_docs), "train_tokens": train_stream.numel(),
                       "held_out_modules": list(HELD_OUT), "held_out_files": len(held_docs),
                       "held_out_tokens": held_stream.numel(), "eval_windows": len(held_w)},
            "steps": step, "schedule": "steps" if args.steps else "time", "stopped_early": stopped_early,
            "epochs": epoch,
            "tokens_seen": tokens, "wall_seconds": round(time.time() - t0, 1),
            "train_seconds": round(time.time() - t_train, 1),
            "tokens_per_second": round(tokens / max(1e-9, time.time() - t_train), 1),
            "seconds_per_step_by_threads": {n: s / tuner.steps[n] for n, s in step_seconds.items()},
            "steps_by_threads": dict(tuner.steps),
            "train_loss": history[-1]["loss_ema"] if history else None,
            "train_mtp_loss": history[-1]["mtp_ema"] if history else None,
            "held_out": evals[-1] if evals else None, "evals": evals, "history": history,
        }
        prompts = eval_prompts(tok, held_docs, args.prompts, args.seed) if final else None
        write_checkpoint(model, Path(args.out), log_d, tok, prompts)
        return log_d

    while True:
        if step >= args.warmup and t_decay is None:
            t_decay = time.time()
        if args.steps:
            progress = (step - args.warmup) / max(1, args.steps - args.warmup)
            done = step >= args.steps
        else:
            progress = (time.time() - t_decay) / max(1e-9, stop_at - t_decay) if t_decay else 0.0
            done = time.time() >= stop_at
        if done:
            break
        if cursor + Bsz > len(perm):
            perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, epoch + 1
        tuner.apply()
        ran_on, t_step = tuner.threads(), time.time()
        batch = train_w[perm[cursor:cursor + Bsz]].to(device)  # (B, T+1)
        cursor += Bsz
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        with amp():
            ce, mtp, _ = losses(model, batch)
        loss = ce + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        require_finite(step + 1, {"loss": loss.detach()})  # no extra wait: .item() above synchronised
        opt.step()
        step += 1
        tokens += Bsz * T
        ce_v, mtp_v = ce.item(), mtp.item()
        if step > 1:  # the first step pays one-off allocation costs
            dt = time.time() - t_step
            tuner.observe((Bsz, T), dt)
            step_seconds[ran_on] += dt
        ema = (ce_v, mtp_v) if ema is None else (0.95 * ema[0] + 0.05 * ce_v, 0.95 * ema[1] + 0.05 * mtp_v)
        if step % args.log_every == 0 or step == args.steps:
            el = time.time() - t_train
            history.append({"step": step, "loss": round(ce_v, 4), "mtp_loss": round(mtp_v, 4),
                            "loss_ema": round(ema[0], 4), "mtp_ema": round(ema[1], 4), "lr": lr,
                            "grad_norm": round(gnorm, 3), "tokens": tokens, "elapsed": round(el, 1)})
            log(f"step {step}{'/' + str(args.steps) if args.steps else ''} ({progress:.0%})  loss {ce_v:.3f} "
                f"(ema {ema[0]:.3f})  mtp {mtp_v:.3f} (ema {ema[1]:.3f})  lr {lr:.2e}  gnorm {gnorm:.2f}  "
                f"{tokens / el:.0f} tok/s  epoch {epoch}  threads {ran_on}")
        if args.steps and time.time() >= stop_at:
            stopped_early = True
            log(f"time budget reached at step {step} of {args.steps}")
            break
        if step % args.eval_every == 0 and step != args.steps:
            evals.append({"step": step, **evaluate(model, held_w, Bsz, amp)})
            log(f"held-out: {evals[-1]}")
            checkpoint(final=False)

    evals.append({"step": step, **evaluate(model, held_w, Bsz, amp)})
    log(f"held-out (final): {evals[-1]}")
    d = checkpoint(final=True)
    log(f"saved {args.out}: {d['params'] / 1e6:.2f}M params, train loss {d['train_loss']}, held-out "
        f"{d['held_out']['loss']:.4f} (mtp {d['held_out']['mtp_loss']:.4f}), {d['tokens_per_second']:.0f} tok/s, "
        f"wall {d['wall_seconds']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
