"""Train an MTP draft head for a base checkpoint that has none; the base stays frozen.

    python scripts/train_mtp.py --base DIR --out DIR [--minutes 30 | --steps N] [--unroll 3] [--init-head DIR]
                                [--corpus PATH] [--save-at 10]

The head is the DeepSeek-V3 style one of docs/DESIGN.md §2. Its input is what the
engine feeds it at inference: the base's final-normed hidden h_p (HybridLM.hidden)
and the embedding of x_{p+1}:

    o_p = MTP(h_p, x_{p+1}) = layer(eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)]))
    loss = CE(mtp_logits(o_p), softmax(base logits at p+1))     --target base (default)
         = CE(mtp_logits(o_p), x_{p+2})                          --target corpus

--unroll D (default 3) trains the head the way it drafts: from every anchor p, step 1 is the
above; step d > 1 feeds the head its own output o_{d-1} (pre-norm, exactly what MTPDrafter feeds
mtp_forward) and the embedding of the TRUE token x_{p+d} (teacher-forced tokens, own hiddens), and
predicts x_{p+d+1} (target as above, at that position). Gradients flow through the chain.
Each depth's attention sees what it sees at inference: the catch-up (depth-1) rows of positions
<= p and its own chain's earlier depths, never the stale catch-up row at its own position; the
rows of depth d sit at MTP position p+d-1 (see mtp_unroll). The loss is

    loss = sum_d w_d * loss_d,   w_d = decay^(d-1) / sum_k decay^(k-1)    (--depth-decay, default 0.8)

Depth 1 weighs most because a draft only counts when every draft before it was accepted; with
0.8 the weights at D = 3 are 0.41, 0.33, 0.26. Every depth is scored over the same T - D anchors
of a window. --init-head DIR starts from the mtp.* tensors of an existing checkpoint.

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
Each is swapped in whole (nano_spec.model.weights.replace_dir): an interrupted save leaves the old output or the new one.
A NaN or infinite loss or head weight stops the run with exit 1 and one line; nothing more is written.
"""
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/train.py: the corpus and schedule helpers
import train as base_train  # noqa: E402  (it puts the repository root on sys.path too)
from arg_types import Parser, device, existing_path, integer, learning_rate, number, threads  # noqa: E402

from nano_spec_kernels.common import apply_rope_ref  # noqa: E402
from nano_spec.model import ssd  # noqa: E402
from nano_spec.model.config import ModelConfig  # noqa: E402
from nano_spec.model.model import MTPHead  # noqa: E402
from nano_spec.model.weights import HEAD_FILE, replace_dir, stored_dtype
from nano_spec.model.model import load_model  # noqa: E402

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
        stream = base_train.token_stream(tok, corpus_texts(Path(args.corpus)), eos)
        if stream.numel() < T + 1:  # not one window
            raise ValueError(f"--corpus: fewer than {T + 1} tokens; lower --seq-len or give more text")
        all_w = base_train.windows(stream, T)
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


def mtp_unroll(model, next_ids, h, depth: int) -> list:
    """The head drafting `depth` steps from every anchor at once, as the engine drafts (teacher-forced tokens).

    h (B, A, D): the base's final-normed hidden at anchors p = 0..A-1; next_ids (B, A+depth-1): x_1 .. x_{A+depth-1}.
    Returns [o_1 .. o_depth], each (B, A, D) pre-norm: o_d[:, p] predicts x_{p+d+1}.

    Row (d, p) is the MTP row at position p+d-1 (RoPE positions too). Depth 1 is the catch-up row of
    position p (input h_p, x_{p+1}); depth d > 1 is draft step d-1 of the chain seeded at p (input
    o_{d-1}[:, p], x_{p+d}). Attention runs over the concatenation of all depths' rows [depth 1 | .. | depth d]
    with a mask: row (d, p) sees the catch-up rows (1, q) for q <= p and its own chain's rows (k, p) for
    2 <= k <= d; never the catch-up row at its own position p+d-1 (d > 1), which drafting overwrites.
    """
    cfg, A = model.cfg, h.shape[1]
    ar = torch.arange(A, device=h.device)
    keys, vals, outs, o = [], [], [], h

    def mix(d, y):  # y (B, A, D): the normed input of the rows of depth d
        attn = model.mtp.layer.self_attn
        q, k, v = attn.qkv(y)  # (B, A, H, Dh)
        pos = ar + (d - 1)
        q, k = apply_rope_ref(q, pos, cfg.rope), apply_rope_ref(k, pos, cfg.rope)
        keys.append(k)
        vals.append(v)
        causal = ar[None, :] <= ar[:, None]  # (A, A): catch-up rows q <= p
        own = ar[None, :] == ar[:, None]  # the chain's own earlier rows at the same anchor
        mask = torch.cat([causal] + [own] * (d - 1), dim=1)  # (A, d*A) over [depth 1 | .. | depth d]
        kk, vv = torch.cat(keys, dim=1), torch.cat(vals, dim=1)  # (B, d*A, Hkv, Dh)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                             attn_mask=mask, scale=cfg.attention_multiplier,
                                             enable_gqa=q.shape[2] != kk.shape[2])  # (B, Hq, A, Dh)
        return attn.o_proj(out.transpose(1, 2).flatten(2))

    for d in range(1, depth + 1):
        o = model._mtp(next_ids[:, d - 1:d - 1 + A], o, lambda attn, y: mix(d, y))
        outs.append(o)
    return outs


def depth_weights(args) -> list:
    """Loss weight of each depth: decay^(d-1), normalised to sum 1."""
    w = [args.depth_decay ** d for d in range(args.unroll)]
    return [x / sum(w) for x in w]


def losses(model, batch, args):
    """batch (B, T+1) -> (training loss, CE vs the corpus token, argmax agreement with the base), the last two
    per depth (tensors of length --unroll), over the A = T - unroll anchors every depth has a target for."""
    T, Dp = batch.shape[1] - 1, args.unroll
    A = T - Dp
    with torch.no_grad():
        h = model.hidden(batch[:, :T])  # (B, T, D) final-normed, as the engine's hidden rows
        base_logits = model.logits(h[:, 1:]).float() if args.target == "base" else None  # predicts x_{p+2} ..
    outs = mtp_unroll(model, batch[:, 1:A + Dp], h[:, :A], Dp)
    loss, ces, agrees = 0.0, [], []
    for d, (o, w) in enumerate(zip(outs, depth_weights(args)), start=1):
        logits = model.mtp_logits(o).float()  # (B, A, V): predicts x_{p+d+1}
        tgt = batch[:, d + 1:d + 1 + A]
        ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        if args.target == "corpus":
            lo = ce
            agree = (logits.argmax(-1) == tgt).float().mean()
        else:
            base_pick = base_logits[:, d - 1:d - 1 + A]  # the base's prediction at position p+d, of x_{p+d+1}
            lo = F.cross_entropy(logits.flatten(0, 1), base_pick.softmax(-1).flatten(0, 1))
            agree = (logits.argmax(-1) == base_pick.argmax(-1)).float().mean()  # greedy acceptance proxy
        loss = loss + w * lo
        ces.append(ce.detach())
        agrees.append(agree.detach())
    return loss, torch.stack(ces), torch.stack(agrees)


@torch.no_grad()
def evaluate(model, held, args, amp) -> dict:
    if len(held) == 0:
        return {}
    tot = torch.zeros(1 + 2 * args.unroll)
    for i in range(0, len(held), args.batch):
        b = held[i:i + args.batch].to(args.device)
        with amp():
            loss, ce, agree = losses(model, b, args)
        tot += torch.cat([loss.float().cpu().view(1), ce.float().cpu(), agree.float().cpu()]) * len(b)
    t = (tot / len(held)).tolist()
    r = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
    return {"loss": round(t[0], 4), "ce": r(t[1:1 + args.unroll]), "agree": r(t[1 + args.unroll:])}


# ---- output --------------------------------------------------------------------------------------
def link_or_copy(src: Path, dst: Path):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed here
        shutil.copy2(src, dst)


def write_checkpoint(model, base: Path, out: Path, log: dict, save_dtype: torch.dtype):
    """out <- the base's files untouched + mtp.safetensors + config.json (num_nextn_predict_layers: 1), swapped in
    atomically (nano_spec.model.weights.replace_dir); a head with a NaN or an infinity is refused (train.Diverged), out left as it is."""
    head = {f"mtp.{n}": t.detach().to("cpu", save_dtype).contiguous() for n, t in model.mtp.state_dict().items()}
    base_train.require_finite(log["steps"], head)  # as stored: fp16 turns a huge finite weight into inf

    def fill(tmp: Path):
        for f in sorted(base.iterdir()):
            if f.is_file() and f.name not in ("config.json", HEAD_FILE, LOG_FILE):
                link_or_copy(f, tmp / f.name)
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))  # every other field as the base has it
        config["num_nextn_predict_layers"] = 1
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        (tmp / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    replace_dir(out, fill)


def snapshot_path(out: Path, minutes: float) -> Path:
    """Where --save-at writes the checkpoint of `minutes` minutes: OUT-<M>min beside OUT."""
    return out.parent / f"{out.name}-{minutes:g}min"


def check_dirs(base: Path, out: Path, save_at=(), log_file: str = LOG_FILE, script: str = "train_mtp.py",
               inside_base: bool = False):
    """Refuse a base that is not a checkpoint, and outputs (--out, every --save-at snapshot) that would replace
    the base, or that train.check_out refuses (a symbolic link, or a path `script` did not write, one without its
    log_file): writing one deletes what was there.
    inside_base: an output may be a subdirectory of the base (a drafter's <checkpoint>/dflash/); never the base
    itself, nor a directory that holds it."""
    if not (base / "config.json").is_file():
        raise ValueError(f"--base: {base} is not a checkpoint directory (no config.json)")
    if not (base / "tokenizer.json").is_file():
        raise ValueError(f"--base: {base} has no tokenizer.json (the corpus is tokenized with it)")
    b = base.resolve()
    for flag, path in [("--out", out)] + [("--save-at", snapshot_path(out, m)) for m in save_at]:
        p = path.resolve()
        if p == b or (b in p.parents and not inside_base):
            raise ValueError(f"{flag}: {path} must not be the base directory"
                             + ("" if inside_base else " or inside it"))
        if p in b.parents:
            raise ValueError(f"{flag}: {path} must not hold the base directory")
        base_train.check_out(flag, path, log_file, script)


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
    ap = Parser(description=__doc__.split("\n")[0])
    count, size, positive = integer(0), integer(1), number(0, above=True)
    ap.add_argument("--base", required=True, help="checkpoint directory without an MTP head")
    ap.add_argument("--out", required=True, help="output directory: base files + mtp.safetensors")
    ap.add_argument("--minutes", type=positive, default=30.0, help="training-step time budget")
    ap.add_argument("--steps", type=count, default=0, help="stop after N steps instead (0: --minutes decides)")
    ap.add_argument("--save-at", type=positive, nargs="*", default=[], help="also save OUT-<M>min at these minutes")
    ap.add_argument("--corpus", type=existing_path,
                    help="a text file or directory (default: the Python standard library)")
    ap.add_argument("--max-files", type=size, default=None, help="stdlib corpus: only the first N training files")
    ap.add_argument("--target", choices=("base", "corpus"), default="base",
                    help="learn the base's distribution of x_{p+2} (default) or the corpus token")
    ap.add_argument("--unroll", type=size, default=3, help="draft depths trained per anchor (1: depth 1 only)")
    ap.add_argument("--depth-decay", type=positive, default=0.8,
                    help="depth d's loss weight is decay^(d-1), normalised")
    ap.add_argument("--init-head", help="start from the mtp.* tensors of this checkpoint instead of a fresh head")
    ap.add_argument("--device", type=device, default="auto", help="cpu, cuda, cuda:N or auto (cuda when there is one)")
    ap.add_argument("--threads", type=threads, default="auto",
                    help="intra-op threads, or auto: 2 or 1, whichever is faster")
    ap.add_argument("--amp", choices=("none", "bf16"), default="bf16", help="autocast dtype for the matmuls")
    ap.add_argument("--seq-len", type=integer(3), default=512)
    ap.add_argument("--batch", type=size, default=8)
    ap.add_argument("--lr", type=learning_rate, default=1e-3)
    ap.add_argument("--min-lr-frac", type=number(0, 1), default=0.1)
    ap.add_argument("--warmup", type=count, default=20)
    ap.add_argument("--weight-decay", type=number(0), default=0.01)
    ap.add_argument("--clip", type=positive, default=1.0)
    ap.add_argument("--eval-windows", type=count, default=48)
    ap.add_argument("--log-every", type=size, default=10, help="steps between progress lines when not on a tty")
    ap.add_argument("--seed", type=count, default=0)
    args = ap.parse_args(argv)
    if args.unroll > args.seq_len - 2:
        ap.error(f"argument --unroll: must be at most --seq-len - 2 = {args.seq_len - 2}, got {args.unroll}")
    return args


def read_init_head(path: Path, cfg: ModelConfig) -> dict:
    """--init-head: the mtp.* tensors (fp32, CPU) of a checkpoint whose head fits the base; ValueError naming the flag."""
    try:
        init = load_model(path, dtype=torch.float32)
    except (ValueError, OSError) as e:  # CheckpointError and ConfigError are ValueErrors
        raise ValueError(f"--init-head: {e}") from None
    if init.mtp is None:
        raise ValueError(f"--init-head: {path} has no MTP head (num_nextn_predict_layers: 0)")
    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in MTPHead(dataclasses.replace(cfg, num_nextn_predict_layers=1))
                .state_dict().items()}
    state = init.mtp.state_dict()
    have = {n: tuple(t.shape) for n, t in state.items()}
    if have != want:
        bad = sorted(n for n in set(want) | set(have) if have.get(n) != want.get(n))
        raise ValueError(f"--init-head: {path}'s MTP head does not fit the base ({', '.join(f'mtp.{n}' for n in bad)})")
    return state


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        base, out = Path(args.base), Path(args.out)
        check_dirs(base, out, args.save_at)
        cfg = ModelConfig.from_file(base / "config.json")
        if cfg.has_mtp:
            raise ValueError(f"num_nextn_predict_layers: {base} already has an MTP head; train_mtp.py adds one to "
                             "a base without (remove the mtp.* tensors and set the field to 0 to retrain)")
        if not cfg.eos_ids:
            raise ValueError("eos_token_id: documents are joined by EOS, and the base config names none")
        init_head = read_init_head(Path(args.init_head), cfg) if args.init_head else None
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
        data = make_windows(args, tok, cfg.eos_ids[0], cfg.vocab_size)  # a corpus it cannot use is refused here
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(args, base, out, cfg, data, init_head)
    except base_train.Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run(args, base: Path, out: Path, cfg: ModelConfig, data: tuple, init_head: dict | None = None):
    """Train the head on data = make_windows(...) and write --out (and the --save-at snapshots)."""
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    tuner = base_train.thread_tuner(args.threads)
    tuner.apply()
    device = torch.device(args.device)
    amp = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")

    train_w, held_w, source = data
    log(f"corpus: {source}: {len(train_w)} training windows of {args.seq_len + 1} tokens, {len(held_w)} held out")

    model = load_model(base, device=device, dtype=torch.float32)  # frozen; fp32 so the head trains on fp32 inputs
    model.requires_grad_(False)
    model.ops.mamba_scan = functools.partial(ssd.mamba_scan_chunked, chunk_size=cfg.mamba_chunk_size)  # chunked SSD
    origin = attach_head(model, args.seed)
    if init_head is not None:  # read and checked by main (read_init_head)
        model.mtp.load_state_dict(init_head)
        origin = f"--init-head {args.init_head} (its mtp.* tensors)"
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
                record(snapshot_path(out, m), final=False)
        if done:
            break
        progress = step / args.steps if args.steps else train_s / budget
        lr = base_train.lr_at(step, max(0.0, progress), args)
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + args.batch > len(perm):
            perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, epoch + 1
        tuner.apply()
        ran_on, t_step = tuner.threads(), time.time()
        batch = train_w[perm[cursor:cursor + args.batch]].to(device)  # (B, T+1)
        cursor += args.batch
        with amp():
            loss, ce, agree = losses(model, batch, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip).item()
        base_train.require_finite(step + 1, {"loss": loss.detach()})  # no extra wait: .item() above synchronised
        opt.step()
        dt = time.time() - t_step
        train_s += dt
        step += 1
        tokens += batch.shape[0] * (batch.shape[1] - 1)  # tokens through the base, as train.py counts
        if step > 1:  # the first step pays one-off allocation costs
            tuner.observe(tuple(batch.shape), dt)
        vals = torch.cat([loss.detach().float().view(1), ce.float(), agree.float()])  # loss, ce per depth, agree
        ema = vals if ema is None else 0.95 * ema + 0.05 * vals
        rate, U = tokens / train_s, args.unroll
        fmt = lambda xs: "/".join(f"{x:.3f}" for x in xs.tolist())  # noqa: E731
        where = f"step {step}/{args.steps}  {train_s / 60:5.1f} min" if args.steps else \
            f"{train_s / 60:5.1f}/{args.minutes:g} min  step {step}"
        bar.show(min(1.0, progress), f"{where}  loss {ema[0]:.3f}  ce {fmt(ema[1:1 + U])}  agree {fmt(ema[1 + U:])}  "
                 f"{rate:,.0f} tok/s  lr {lr:.1e}")
        if step % args.log_every == 0:
            r = lambda xs: [round(x, 4) for x in xs.tolist()]  # noqa: E731
            history.append({"step": step, "minutes": round(train_s / 60, 2), "loss_ema": round(ema[0].item(), 4),
                            "ce_ema": r(ema[1:1 + U]), "agree_ema": r(ema[1 + U:]), "lr": lr,
                            "grad_norm": round(gnorm, 3), "tokens": tokens, "tokens_per_second": round(rate, 1),
                            "threads": ran_on})
    record(out, final=True)
    log(f"done: {step} steps, {tokens:,} tokens in {train_s / 60:.1f} min of training "
        f"({tokens / max(train_s, 1e-9):,.0f} tok/s); wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
