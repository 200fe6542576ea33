"""Train an MTP draft head for a base checkpoint that has none; the base stays frozen.

    python scripts/train_mtp.py --base DIR --out DIR [--minutes 30] [--corpus PATH] [--save-at 10]

The head is the DeepSeek-V3 style one of docs/DESIGN.md §2. Its input is what the
engine feeds it at inference: the base's final-normed hidden h_p (HybridLM.hidden)
and the embedding of x_{p+1}:

    o_p = MTP(h_p, x_{p+1}) = layer(eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)]))
    loss = CE(mtp_logits(o_p), softmax(base logits at p+1))     --target base (default)
         = CE(mtp_logits(o_p), x_{p+2})                          --target corpus

With --target base the head learns what the base will pick for x_{p+2}, which is
what greedy verification accepts; the corpus token is what the base got right
only part of the time. Only the head's parameters train; the embedding and
lm_head it shares with the base are frozen with the rest of the base.

Initialisation: the head's decoder layer is a copy of the base's last attention
layer (it is laid out the same), the head's final norm a copy of the base's; the
script prints which layer. eh_proj is random (std 0.02), enorm/hnorm ones.

Default corpus: the Python standard library's training split of scripts/train.py
(its held-out modules give the evaluation windows and never train). --corpus
takes a text file or a directory of text files; its last windows are held out.

--out gets the base's files as hard links (copies across file systems), untouched,
plus mtp.safetensors (the head only, in the base's stored dtype), config.json with
num_nextn_predict_layers: 1 and mtp_train_log.json; load_model reads the base and
head files together. --save-at M writes the same at M minutes of training to
OUT-Mmin. --minutes counts training-step time only (evaluations and saves excluded).
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/train.py: the corpus and schedule helpers
import train as base_train  # noqa: E402  (it puts the repository root on sys.path too)

from nano_spec import ssd  # noqa: E402
from nano_spec.config import ModelConfig  # noqa: E402
from nano_spec.model import MTPHead  # noqa: E402
from nano_spec.weights import HEAD_FILE, load_model, stored_dtype  # noqa: E402

LOG_FILE = "mtp_train_log.json"


# ---- data ----------------------------------------------------------------------------------------
def corpus_texts(path: Path) -> list:
    """A UTF-8 text file, or every UTF-8 file under a directory (sorted; hidden entries and binaries skipped)."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        raise ValueError(f"--corpus: {path} is not a file or directory")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--corpus: no UTF-8 text in {path}")
    return texts


def make_windows(args, tok: Tokenizer, eos: int, vocab_size: int):
    """-> (train windows (n, T+1), held-out windows (m, T+1)), token ids checked against the model's vocabulary."""
    T = args.seq_len
    if args.corpus is None:
        train_docs, held_docs = base_train.stdlib_files(args.max_files)
        train = base_train.windows(base_train.token_stream(tok, [t for _, t in train_docs], eos), T)
        held = base_train.windows(base_train.token_stream(tok, [t for _, t in held_docs], eos), T)
        source = f"Python stdlib ({len(train_docs)} training files; held out: {', '.join(base_train.HELD_OUT)})"
    else:
        all_w = base_train.windows(base_train.token_stream(tok, corpus_texts(Path(args.corpus)), eos), T)
        n_held = min(args.eval_windows, len(all_w) // 10)  # at most a tenth of the corpus is held out
        train, held = all_w[: len(all_w) - n_held], all_w[len(all_w) - n_held:]
        source = f"{args.corpus}"
    if len(train) == 0:
        raise ValueError(f"--corpus: fewer than {T + 1} tokens; lower --seq-len or give more text")
    if int(train.max()) >= vocab_size:
        raise ValueError(f"tokenizer.json: token id {int(train.max())} >= the model's vocab_size {vocab_size}")
    if len(held):
        held = held[torch.linspace(0, len(held) - 1, min(args.eval_windows, len(held))).long()]
    return train, held, source


# ---- model ---------------------------------------------------------------------------------------
def attach_head(model, seed: int) -> str:
    """Give the frozen base a fresh MTP head (trainable, fp32); returns where its decoder layer came from."""
    cfg = dataclasses.replace(model.cfg, num_nextn_predict_layers=1)
    device = model.model.embed_tokens.weight.device
    torch.manual_seed(seed)
    head = MTPHead(cfg).to(device)
    with torch.no_grad():
        head.eh_proj.weight.normal_(0.0, 0.02)
        head.norm.weight.copy_(model.model.norm.weight)  # its output goes through norm and lm_head, as the base's
        if cfg.attention_layers:
            src = cfg.attention_layers[-1]  # the deepest: its input is closest to the final hidden the head reads
            head.layer.load_state_dict(model.model.layers[src].state_dict())
            origin = f"model.layers.{src} (the base's last attention layer)"
        else:
            for name, p in head.layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
            origin = "random (normal, std 0.02): the base has no attention layer"
    model.cfg, model.mtp = cfg, head
    return origin


def losses(model, batch, target: str):
    """batch (B, T+1) -> (training loss, CE vs the corpus token, argmax agreement with the base) over T-1 positions."""
    T = batch.shape[1] - 1
    with torch.no_grad():
        h = model.hidden(batch[:, :T])  # (B, T, D) final-normed, as the engine's hidden rows
        base_pick = model.logits(h[:, 1:T]).float()  # (B, T-1, V): the base's prediction of x_{p+2}
    o = model.mtp_hidden(batch[:, 1:T], h[:, :T - 1])  # (B, T-1, D)
    logits = model.mtp_logits(o).float()  # (B, T-1, V)
    ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 2:].flatten())
    loss = ce if target == "corpus" else F.cross_entropy(logits.flatten(0, 1), base_pick.softmax(-1).flatten(0, 1))
    agree = (logits.argmax(-1) == base_pick.argmax(-1)).float().mean()  # greedy draft-1 acceptance proxy
    return loss, ce, agree


@torch.no_grad()
def evaluate(model, held, args, amp) -> dict:
    if len(held) == 0:
        return {}
    tot = torch.zeros(3)
    for i in range(0, len(held), args.batch):
        b = held[i:i + args.batch].to(args.device)
        with amp():
            tot += torch.stack([x.float().cpu() for x in losses(model, b, args.target)]) * len(b)
    loss, ce, agree = (tot / len(held)).tolist()
    return {"loss": round(loss, 4), "ce": round(ce, 4), "agree": round(agree, 4)}


# ---- output --------------------------------------------------------------------------------------
def link_or_copy(src: Path, dst: Path):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed here
        shutil.copy2(src, dst)


def write_checkpoint(model, base: Path, out: Path, log: dict, save_dtype: torch.dtype):
    """out <- the base's files untouched + mtp.safetensors + config.json (num_nextn_predict_layers: 1); atomic."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in sorted(base.iterdir()):
            if f.is_file() and f.name not in ("config.json", HEAD_FILE, LOG_FILE):
                link_or_copy(f, tmp / f.name)
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))  # every other field as the base has it
        config["num_nextn_predict_layers"] = 1
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        head = {f"mtp.{n}": t.detach().to("cpu", save_dtype).contiguous() for n, t in model.mtp.state_dict().items()}
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        (tmp / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_dirs(base: Path, out: Path):
    if not (base / "config.json").is_file():
        raise ValueError(f"--base: {base} is not a checkpoint directory (no config.json)")
    if not (base / "tokenizer.json").is_file():
        raise ValueError(f"--base: {base} has no tokenizer.json (the corpus is tokenized with it)")
    if out.resolve() == base.resolve() or base.resolve() in out.resolve().parents:
        raise ValueError(f"--out: {out} must not be the base directory or inside it")
    if out.exists() and any(out.iterdir()) and not (out / LOG_FILE).is_file():
        raise ValueError(f"--out: {out} exists and is not an output of train_mtp.py; choose a new directory")


class Progress:
    """One status line: a bar over the time (or step) budget, loss, agreement and tokens/s."""

    def __init__(self, log_every: int):
        self.tty, self.log_every, self.n = sys.stderr.isatty(), log_every, 0

    def show(self, frac: float, text: str):
        self.n += 1
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        if self.tty:
            print(f"\r[{bar}] {text}", end="", file=sys.stderr, flush=True)
        elif self.n % self.log_every == 0:
            print(f"[{bar}] {text}", file=sys.stderr, flush=True)

    def done(self):
        if self.tty:
            print(file=sys.stderr, flush=True)


# ---- the run -------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="checkpoint directory without an MTP head")
    ap.add_argument("--out", required=True, help="output directory: base files + mtp.safetensors")
    ap.add_argument("--minutes", type=float, default=30.0, help="training-step time budget")
    ap.add_argument("--steps", type=int, default=0, help="stop after N steps instead (0: --minutes decides)")
    ap.add_argument("--save-at", type=float, nargs="*", default=[], help="also save OUT-<M>min at these minutes")
    ap.add_argument("--corpus", help="a text file or directory (default: the Python standard library)")
    ap.add_argument("--max-files", type=int, default=None, help="stdlib corpus: only the first N training files")
    ap.add_argument("--target", choices=("base", "corpus"), default="base",
                    help="learn the base's distribution of x_{p+2} (default) or the corpus token")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", default="auto", help="intra-op threads, or auto: 2 or 1, whichever is faster")
    ap.add_argument("--amp", choices=("none", "bf16"), default="bf16", help="autocast dtype for the matmuls")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-windows", type=int, default=48)
    ap.add_argument("--log-every", type=int, default=10, help="steps between progress lines when not on a tty")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.seq_len < 3 or args.batch < 1 or args.minutes <= 0 or args.steps < 0:
        raise ValueError("--seq-len >= 3, --batch >= 1, --minutes > 0 and --steps >= 0")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        base, out = Path(args.base), Path(args.out)
        check_dirs(base, out)
        cfg = ModelConfig.from_file(base / "config.json")
        if cfg.has_mtp:
            raise ValueError(f"num_nextn_predict_layers: {base} already has an MTP head; train_mtp.py adds one to "
                             "a base without (remove the mtp.* tensors and set the field to 0 to retrain)")
        if not cfg.eos_ids:
            raise ValueError("eos_token_id: documents are joined by EOS, and the base config names none")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(args, base, out, cfg)
    return 0


def run(args, base: Path, out: Path, cfg: ModelConfig):
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    threads = base_train.ThreadTuner((2, 1) if args.threads == "auto" else (int(args.threads),))
    threads.start_segment()
    device = torch.device(args.device)
    amp = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    train_w, held_w, source = make_windows(args, tok, cfg.eos_ids[0], cfg.vocab_size)
    log(f"corpus: {source}: {len(train_w)} training windows of {args.seq_len + 1} tokens, {len(held_w)} held out")

    model = load_model(base, device=device, dtype=torch.float32)  # frozen; fp32 so the head trains on fp32 inputs
    model.requires_grad_(False)
    model.ops.mamba_scan = functools.partial(ssd.mamba_scan_chunked, chunk_size=cfg.mamba_chunk_size)  # chunked SSD
    origin = attach_head(model, args.seed)
    params = list(model.mtp.parameters())
    n_head, n_base = sum(p.numel() for p in params), sum(p.numel() for p in model.model.parameters())
    log(f"base {base}: {n_base / 1e6:.2f}M params, frozen; MTP head {n_head / 1e6:.2f}M params")
    log(f"mtp.layer initialised from {origin}")

    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(args.seed)
    perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, 0
    save_dtype = stored_dtype(base)
    pending_saves = sorted(args.save_at)
    budget = 60.0 * args.minutes
    evals = [{"step": 0, "minutes": 0.0, **evaluate(model, held_w, args, amp)}]
    log(f"held-out before training: {evals[-1]}")
    history, step, tokens, train_s, ema = [], 0, 0, 0.0, None
    bar = Progress(args.log_every)

    def record(path: Path, final: bool):
        evals.append({"step": step, "minutes": round(train_s / 60, 2), **evaluate(model, held_w, args, amp)})
        d = {"finished": final, "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
             "base": str(base.resolve()), "mtp_layer_init": origin, "corpus": source, "head_params": n_head,
             "steps": step, "epochs": epoch, "tokens_seen": tokens, "train_seconds": round(train_s, 1),
             "tokens_per_second": round(tokens / max(train_s, 1e-9), 1), "saved_dtype": str(save_dtype),
             "held_out": evals[-1], "evals": evals, "history": history}
        write_checkpoint(model, base, path, d, save_dtype)
        bar.done()
        log(f"saved {path} at {train_s / 60:.1f} min, step {step}: held-out {evals[-1]}")

    model.mtp.train()
    while True:
        done = step >= args.steps if args.steps else train_s >= budget
        while pending_saves and (train_s >= 60 * pending_saves[0] or done):
            m = pending_saves.pop(0)
            if train_s >= 60 * m:  # a save point past the end of the run is not written
                record(out.parent / f"{out.name}-{m:g}min", final=False)
        if done:
            break
        progress = step / args.steps if args.steps else train_s / budget
        lr = base_train.lr_at(step, max(0.0, progress), args)
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + args.batch > len(perm):
            perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, epoch + 1
        t_step = time.time()
        batch = train_w[perm[cursor:cursor + args.batch]].to(device)  # (B, T+1)
        cursor += args.batch
        with amp():
            loss, ce, agree = losses(model, batch, args.target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip).item()
        opt.step()
        dt = time.time() - t_step
        train_s += dt
        step += 1
        tokens += batch.shape[0] * (batch.shape[1] - 1)  # tokens through the base, as train.py counts
        if step > 1:
            threads.record(dt)
        vals = (loss.item(), ce.item(), agree.item())
        ema = vals if ema is None else tuple(0.95 * e + 0.05 * v for e, v in zip(ema, vals))
        rate = tokens / train_s
        bar.show(min(1.0, progress), f"{train_s / 60:5.1f}/{args.minutes:g} min  step {step}  loss {ema[0]:.3f}  "
                 f"ce {ema[1]:.3f}  agree {ema[2]:.3f}  {rate:,.0f} tok/s  lr {lr:.1e}")
        if step % args.log_every == 0:
            history.append({"step": step, "minutes": round(train_s / 60, 2), "loss_ema": round(ema[0], 4),
                            "ce_ema": round(ema[1], 4), "agree_ema": round(ema[2], 4), "lr": lr,
                            "grad_norm": round(gnorm, 3), "tokens": tokens, "tokens_per_second": round(rate, 1),
                            "threads": threads.current})
    record(out, final=True)
    log(f"done: {step} steps, {tokens:,} tokens in {train_s / 60:.1f} min of training "
        f"({tokens / max(train_s, 1e-9):,.0f} tok/s); wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
