"""Train a DFlash block drafter for a frozen target checkpoint.

    python scripts/train_dflash.py --base DIR --out DIR [--minutes 30 | --steps N] [--block 8] [--layers 2]
                                   [--taps i,j,..] [--anchors 16] [--decay 4.0] [--corpus PATH | --data FILE..]
                                   [--labels target|tokens] [--prefix-weights] [--compile]

The drafter is the one of nano_spec/model/dflash.py (docs/DESIGN.md §13): a few Qwen3-style layers that read
the target's residual stream after the tapped layers (--taps; default dflash.default_taps) as context
and draft a whole block [x_a, MASK x (Bk-1)] in one non-causal forward, through the target's embedding
and head (both frozen). Only the drafter trains; it starts from init_weights(seed=--seed), in fp32.

One step, on a batch of windows ids (B, T) of the corpus:
    1. no grad: the target's forward gives the taps (B, T, nT*D) and its next-token distribution
       p_t = softmax(logits_t) at every position t (what greedy verification accepts after x_..t).
    2. --anchors n distinct random positions a in [1, T - Bk] per sequence (in [P - 1, T - Bk] with --data, P the
       prompt length: every draft then predicts a token the target wrote). The block of anchor a is
       [x_a, MASK x (Bk-1)] at positions a .. a+Bk-1. All n blocks of a sequence are stacked as the
       Q = n*Bk query rows of ONE drafter forward over the T context rows, with the reference's
       training mask: a block row sees the context positions < a and every row of its own block
       (non-causal), nothing of the other blocks. This equals n separate draft forwards, one per
       anchor with the context cut at a (tests/test_train_dflash.py checks it).
    3. draft row j = 1 .. Bk-1 of anchor a predicts x_{a+j}; its target is p_{a+j-1}:
           loss = sum_j w_j * CE(p_{a+j-1}, drafter logits_j) / sum_j w_j,   w_j = exp(-(j-1) / --decay)
       Early drafts weigh most: a rejection ends the block, so a draft after it is never used.
       --labels tokens replaces p_{a+j-1} by the window's own token x_{a+j} (one-hot).
       --prefix-weights weights each block's CE at row j also by prod_{i<j} q_i, q_i the drafter's probability
       of the target's pick at row i (no grad): a draft counts as much as the drafts before it are likely to
       be accepted, block by block, where w_j says so on average.
Logged: per-position agreement argmax(drafter_j) == argmax(p_{a+j-1}) (what greedy acceptance of draft
j needs), and the expected accepted length E[sum_j prod_{i<=j} agree_i] (a cheap proxy for tau - 1).

AdamW, linear warmup + cosine decay by training time (scripts/train.py's lr_at), gradient clipping,
bf16 autocast (--amp). --minutes counts training-step time only (evaluations and the save excluded).
--compile runs the drafter's part of each step (its forward, the logits and the loss: block_loss) through
torch.compile: about 1.3x the steps in the same minutes on one CPU core, after a compile of under a minute.
--cache-target keeps what step 1 computes (taps and final hidden, not the anchors' p) per window from its first
visit: the target is frozen, so later epochs cost only the drafter.
The corpus and the held-out windows are train_mtp.py's: the Python standard library's training split
by default (its held-out modules never train), or --corpus FILE|DIR with its last windows held out.
--data FILE.. trains on scripts/distill_data.py's files instead: the target's own continuations of corpus prompts,
greedy and sampled, with their held-out windows (greedy continuations of held-out prompts, as the benchmarks decode).
The held-out windows are evaluated (loss, agreement by position) before and after training, with the
same anchors both times; with none (--eval-windows 0) nothing is evaluated and the log's held_out is null.

--out gets the drafter as nano_spec.model.dflash.load_drafter reads it (config.json with dflash_config,
model.safetensors in the base's stored dtype) and dflash_train_log.json, swapped in together (nano_spec.model.weights.replace_dir):
an interrupted save leaves the old output or the new one. A NaN or infinite loss or weight stops the run with
exit 1 and one line, and writes nothing.
The engine looks for a checkpoint's drafter in <checkpoint>/dflash/, so `--out BASE/dflash` is the
natural place; an existing --out that is not this script's output is refused.
"""
import copy
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: train_mtp.py, train.py, arg_types.py
import train_mtp  # noqa: E402  (it imports train.py, which puts the repository root on sys.path)
import distill_data  # noqa: E402  (--data: its files, read by its reader)
from train_mtp import base_train  # noqa: E402
from arg_types import Parser, device, existing_path, indices, integer, learning_rate, number, threads  # noqa: E402

from nano_spec.model import ssd  # noqa: E402
from nano_spec.model.config import ModelConfig  # noqa: E402
from nano_spec.model.dflash import DFlashConfig, DFlashModel  # noqa: E402
from nano_spec.model.weights import init_weights, replace_dir, stored_dtype, write_model
from nano_spec.model.model import load_model  # noqa: E402

LOG_FILE = "dflash_train_log.json"


# ---- the stacked-anchor forward -------------------------------------------------------------------
def sample_anchors(B: int, T: int, Bk: int, n: int, gen: torch.Generator, lo: int = 1) -> torch.Tensor:
    """n distinct anchors per sequence in [lo, T - Bk], sorted -> (B, n) int64 (on the CPU)."""
    return torch.rand(B, T - Bk - lo + 1, generator=gen).argsort(dim=1)[:, :n].sort(dim=1).values + lo


def block_mask(anchors: torch.Tensor, T: int, Bk: int) -> torch.Tensor:
    """anchors (B, n) -> mask (B, n*Bk, T + n*Bk), True = visible: a row of block k sees the context positions
    < anchors[:, k] and every row of block k; nothing of the other blocks."""
    B, n = anchors.shape
    ctx = torch.arange(T, device=anchors.device) < anchors[:, :, None]          # (B, n, T)
    blk = torch.arange(n * Bk, device=anchors.device) // Bk                      # the block of each query row
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)                      # (B, Q, Q)
    return torch.cat([ctx.repeat_interleave(Bk, dim=1), own], dim=2)


def stacked_draft(drafter: DFlashModel, embed_tokens, ids, taps, anchors) -> torch.Tensor:
    """The blocks of every anchor in one drafter forward. ids (B, T), taps (B, T, nT*D), anchors (B, n)
    -> the drafter's final-normed hidden (B, n, Bk, D); [:, k, j] drafts x_{anchors[:, k] + j}."""
    cfg, (B, T), n = drafter.cfg, ids.shape, anchors.shape[1]
    Bk = cfg.block_size
    pos = anchors[:, :, None] + torch.arange(Bk, device=ids.device)             # (B, n, Bk)
    block = torch.full((B, n, Bk), cfg.mask_token_id, dtype=ids.dtype, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)                                      # [x_a, MASK x (Bk-1)]
    x = embed_tokens(block.flatten(1)) * cfg.input_embedding_scale               # (B, Q, D)
    positions = torch.cat([torch.arange(T, device=ids.device).expand(B, T), pos.flatten(1)], dim=1)
    return drafter(x, taps, positions, block_mask(anchors, T, Bk)).view(B, n, Bk, -1)


def position_weights(Bk: int, decay: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j-1)/decay) for draft rows j = 1 .. Bk-1, normalised to sum 1."""
    w = torch.exp(-torch.arange(Bk - 1, dtype=torch.float32, device=device) / decay)
    return w / w.sum()


class TargetCache:
    """The frozen target's taps and final-normed hidden of every training window, kept from the first time the
    window is seen: the target does not train, so later epochs skip its forward (most of a step's FLOPs). Stored
    in the dtype the drafter's first matmul reads them in (bf16 under --amp bf16), so nothing changes but the time."""

    def __init__(self, n: int, T: int, D: int, n_taps: int, dtype: torch.dtype, device):
        self.taps = torch.empty(n, T, n_taps * D, dtype=dtype, device=device)  # (n, T, nT*D)
        self.y = torch.empty(n, T, D, dtype=dtype, device=device)              # (n, T, D)
        self.have = torch.zeros(n, dtype=torch.bool)

    def nbytes(self) -> int:
        return self.taps.nbytes + self.y.nbytes

    def get(self, idx: torch.Tensor, compute):
        """(taps, y) of windows idx (B,); compute(rows) -> (taps, y) of the rows idx[rows] not yet kept."""
        new = (~self.have[idx]).nonzero()[:, 0]
        if len(new):
            taps, y = compute(new)
            self.taps[idx[new]], self.y[idx[new]] = taps.to(self.taps.dtype), y.to(self.y.dtype)
            self.have[idx[new]] = True
        return self.taps[idx], self.y[idx]


def target_rows(model, ids, layer_ids):
    """ids (B, T) -> the target's taps (B, T, nT*D) and final-normed hidden (B, T, D), no grad."""
    with torch.no_grad():
        taps = torch.zeros(*ids.shape, len(layer_ids) * model.cfg.hidden_size, device=ids.device)
        return taps, model.hidden(ids, layer_ids, taps)


def prefix_accepted(logp: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """logp (B, n, Bk-1, V) the drafter's log-probabilities, picks (B, n, Bk-1) the target's tokens -> (B, n, Bk-1):
    row j holds prod_{i<j} q_i, q_i = exp(logp_i[picks_i]), the drafter's chance that drafts 1 .. j-1 are all
    accepted (row 1: 1), no grad."""
    q = logp.detach().gather(-1, picks[..., None])[..., 0].exp()                 # (B, n, Bk-1)
    return torch.cat([torch.ones_like(q[..., :1]), q[..., :-1].cumprod(-1)], dim=-1)


def block_loss(model, drafter, ids, taps, anchors, labels, weights, prefix: bool = False):
    """The drafter's part of a step (what --compile compiles): its blocks at anchors (B, n) -> (loss, CE per draft
    position (Bk-1,), its top-1 per draft row (B, n, Bk-1)); labels (B, n, Bk-1, V) are what draft row j learns.
    prefix (--prefix-weights): each block's CE at row j is also weighted by prefix_accepted, so a draft whose
    earlier drafts would be rejected weighs little (it would never be used)."""
    h = stacked_draft(drafter, model.model.embed_tokens, ids, taps, anchors)[:, :, 1:]
    logits = (model.logits(h) * (drafter.cfg.output_multiplier * model.cfg.logits_scaling)).float()  # (B, n, Bk-1, V)
    logp = logits.log_softmax(-1)
    ce = -(labels * logp).sum(-1)                                                # (B, n, Bk-1)
    weighted = (prefix_accepted(logp, labels.argmax(-1)) * ce if prefix else ce).mean((0, 1))
    return (weights * weighted).sum(), ce.detach().mean((0, 1)), logits.argmax(-1)


def losses(model, drafter, batch, args, gen: torch.Generator, cache: TargetCache | None = None, idx=None,
           block_loss=block_loss):
    """batch (B, T+1) -> (loss, CE per draft position (Bk-1,), agreement per position (Bk-1,), expected accepted
    length), over --anchors random blocks per window (anchors drawn from gen). With a cache, idx (B,) are the
    windows' indices in it; block_loss: the function above, or its compiled twin."""
    cfg, T = drafter.cfg, args.seq_len
    ids, Bk = batch[:, :T], cfg.block_size
    B, n = ids.shape[0], args.anchors
    anchors = sample_anchors(B, T, Bk, n, gen, args.first_anchor).to(ids.device)
    if cache is None:
        taps, y = target_rows(model, ids, cfg.target_layer_ids)                 # (B, T, nT*D), (B, T, D)
    else:
        taps, y = cache.get(idx, lambda rows: target_rows(model, ids[rows], cfg.target_layer_ids))
    with torch.no_grad():
        where = (anchors[:, :, None] + torch.arange(Bk - 1, device=ids.device)).flatten(1)  # a + j - 1
        p = model.logits(y[torch.arange(B, device=ids.device)[:, None], where]).float().softmax(-1)
        p = p.view(B, n, Bk - 1, -1)                                             # the target's pick of x_{a+j}
    labels = p
    if args.labels == "tokens":  # the window's own next tokens, one-hot (the target's samples, in sampled data)
        labels = torch.zeros_like(p).scatter_(-1, batch[:, 1:].gather(1, where).view(B, n, Bk - 1, 1), 1.0)
    loss, ce, top = block_loss(model, drafter, ids, taps, anchors, labels, position_weights(Bk, args.decay, ids.device),
                               args.prefix_weights)
    agree = (top == p.argmax(-1)).float()                                        # (B, n, Bk-1)
    return loss, ce, agree.mean((0, 1)), agree.cumprod(-1).sum(-1).mean()


EVAL_SEED = 1234  # the held-out anchors: the same draw before and after training


@torch.no_grad()
def evaluate(model, drafter, held, args, amp) -> dict:
    if len(held) == 0:
        return {}
    gen = torch.Generator().manual_seed(EVAL_SEED + args.seed)
    tot = torch.zeros(2 + 2 * (args.block - 1))
    for i in range(0, len(held), args.batch):
        b = held[i:i + args.batch].to(args.device)
        with amp():
            loss, ce, agree, acc = losses(model, drafter, b, args, gen)
        tot += torch.cat([loss.float().cpu().view(1), acc.float().cpu().view(1), ce.float().cpu(),
                          agree.float().cpu()]) * len(b)
    t, K = (tot / len(held)).tolist(), args.block - 1
    r = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
    return {"loss": round(t[0], 4), "accept_len": round(t[1], 4), "ce": r(t[2:2 + K]), "agree": r(t[2 + K:])}


def describe(ev: dict | None) -> str:
    """A held-out evaluation as two lines: loss and expected accepted length, then agreement by position."""
    if not ev:
        return "no held-out windows"
    return (f"loss {ev['loss']:.4f}  expected accepted length {ev['accept_len']:.3f}\n"
            f"    agreement by position: " + "  ".join(f"{j}: {a:.3f}" for j, a in enumerate(ev["agree"], 1)))


# ---- the run -------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n")[0])
    count, size, positive = integer(0), integer(1), number(0, above=True)
    ap.add_argument("--base", required=True, help="the target checkpoint directory (frozen)")
    ap.add_argument("--out", required=True, help="output directory for the drafter, e.g. BASE/dflash")
    ap.add_argument("--minutes", type=positive, default=30.0, help="training-step time budget")
    ap.add_argument("--steps", type=count, default=0, help="stop after N steps instead (0: --minutes decides)")
    ap.add_argument("--block", type=integer(2, 64), default=8, help="block size Bk: one forward drafts Bk - 1 tokens")
    ap.add_argument("--layers", type=integer(1, 64), default=2, help="drafter decoder layers")
    ap.add_argument("--taps", type=indices, default=None,
                    help="target layers whose residual the drafter reads, e.g. 1,3 (default: spread evenly)")
    ap.add_argument("--anchors", type=size, default=16, help="blocks per window and step (random anchors)")
    ap.add_argument("--decay", type=positive, default=4.0, help="draft j's loss weight is exp(-(j-1)/decay)")
    ap.add_argument("--prefix-weights", action="store_true",
                    help="weight each block's draft j also by the drafter's chance that drafts 1..j-1 are accepted")
    ap.add_argument("--corpus", type=existing_path,
                    help="a text file or directory (default: the Python standard library)")
    ap.add_argument("--max-files", type=size, default=None, help="stdlib corpus: only the first N training files")
    ap.add_argument("--data", type=existing_path, nargs="+",
                    help="instead of the corpus: files of scripts/distill_data.py (the target's own continuations); "
                         "anchors then lie in the continuations and --seq-len is the windows'")
    ap.add_argument("--cache-target", action="store_true",
                    help="keep the target's taps and hidden of every training window after its first visit (memory: "
                         "windows x seq_len x (taps + 1) x hidden x 2 bytes under bf16): later epochs skip its forward")
    ap.add_argument("--labels", choices=("target", "tokens"), default="target",
                    help="train on the target's distribution at each position (target), or on the window's tokens")
    ap.add_argument("--device", type=device, default="auto", help="cpu, cuda, cuda:N or auto (cuda when there is one)")
    ap.add_argument("--threads", type=threads, default="auto",
                    help="intra-op threads, or auto: 2 or 1, whichever is faster")
    ap.add_argument("--amp", choices=("none", "bf16"), default="bf16", help="autocast dtype for the matmuls")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the drafter's forward and loss (block_loss) for the training steps: the same "
                         "loss, fused; its compile time counts as training time")
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
    args.first_anchor = 1
    if args.data:
        if args.corpus:
            ap.error("argument --data: give --data or --corpus, not both")
        args.seq_len, args.first_anchor = distill_shape(ap, args.data)
    if args.seq_len <= args.block:
        ap.error(f"argument --seq-len: must be more than --block = {args.block}, got {args.seq_len}")
    room = args.seq_len - args.block - args.first_anchor + 1  # anchors lie in [first_anchor, seq_len - block]
    if args.anchors > room:
        ap.error(f"argument --anchors: must be at most the {room} places a block fits, got {args.anchors}")
    return args


def distill_shape(ap, paths) -> tuple:
    """(seq_len, first anchor) of distill_data.py files; all must share the window shape. The first anchor is the
    last prompt token: draft row 1 of its block predicts the first token the target wrote."""
    shapes = set()
    for path in paths:
        try:
            d = distill_data.read(path, "argument --data")
        except ValueError as e:
            ap.error(str(e))
        shapes.add((d["train"].shape[1] - 1, d["settings"]["prompt_len"] - 1))
    if len(shapes) > 1:
        ap.error(f"argument --data: the files' windows differ in shape: {sorted(shapes)}")
    return shapes.pop()


def distill_windows(paths, vocab_size: int, eval_windows: int) -> tuple:
    """-> (training windows (n, T+1) int64, held-out windows (m, T+1) int64, source) from distill_data.py files."""
    files = [distill_data.read(p, "--data") for p in paths]
    train = torch.cat([f["train"] for f in files]).long()
    held = torch.cat([f["held"] for f in files]).long()[:eval_windows]
    if len(train) == 0:
        raise ValueError("--data: no training windows")
    if int(train.max()) >= vocab_size:
        raise ValueError(f"--data: token id {int(train.max())} >= the target's vocab_size {vocab_size}: "
                         f"the files were made for another checkpoint")
    sampled = sum(int(f["train_sampled"].sum()) for f in files)
    return train, held, f"the target's continuations ({', '.join(map(str, paths))}; {sampled} sampled)"


def drafter_config(args, cfg: ModelConfig) -> DFlashConfig:
    """The drafter's config for the target; ValueError naming --taps or the drafter field that does not fit."""
    L = cfg.num_hidden_layers
    if args.taps and max(args.taps) >= L:
        raise ValueError(f"--taps: {','.join(map(str, args.taps))} must be layers of the target (0 .. {L - 1})")
    dcfg = DFlashConfig.for_target(cfg, num_layers=args.layers, block_size=args.block, taps=args.taps)
    dcfg.check(cfg)
    return dcfg


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        base, out = Path(args.base), Path(args.out)
        train_mtp.check_dirs(base, out, log_file=LOG_FILE, script="train_dflash.py", inside_base=True)
        cfg = ModelConfig.from_file(base / "config.json")
        if not cfg.eos_ids:
            raise ValueError("eos_token_id: documents are joined by EOS, and the base config names none")
        dcfg = drafter_config(args, cfg)
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
        data = distill_windows(args.data, cfg.vocab_size, args.eval_windows) if args.data else \
            train_mtp.make_windows(args, tok, cfg.eos_ids[0], cfg.vocab_size)  # refuses a corpus it cannot use
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(args, base, out, cfg, dcfg, data)
    except base_train.Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def write_drafter(drafter: DFlashModel, out: Path, log: dict, dtype: torch.dtype):
    """out <- config.json + model.safetensors (nano_spec.model.weights.write_model, in dtype) + LOG_FILE, swapped in
    atomically (nano_spec.model.weights.replace_dir); a drafter with a NaN or an infinity is refused (train.Diverged), out left as
    it is."""
    stored = copy.deepcopy(drafter).to("cpu", dtype)  # the trained drafter stays fp32 on its device
    base_train.require_finite(log["steps"], stored.state_dict())  # as stored: fp16 turns a huge finite weight into inf

    def fill(tmp: Path):
        write_model(stored, tmp)
        (tmp / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    replace_dir(out, fill)


def run(args, base: Path, out: Path, cfg: ModelConfig, dcfg: DFlashConfig, data: tuple):
    """Train a fresh drafter on data = train_mtp.make_windows(...) and write --out."""
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    tuner = base_train.thread_tuner(args.threads)
    tuner.apply()
    device = torch.device(args.device)
    amp = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")

    train_w, held_w, source = data
    log(f"corpus: {source}: {len(train_w)} training windows of {args.seq_len + 1} tokens, {len(held_w)} held out")

    model = load_model(base, device=device, dtype=torch.float32)  # the target, frozen
    model.requires_grad_(False)
    model.ops.mamba_scan = functools.partial(ssd.mamba_scan_chunked, chunk_size=cfg.mamba_chunk_size)  # chunked SSD
    drafter = init_weights(DFlashModel(dcfg, model.ops), seed=args.seed).to(device)  # fp32, trainable
    params = list(drafter.parameters())
    n_drafter, n_base = sum(p.numel() for p in params), sum(p.numel() for p in model.model.parameters())
    log(f"target {base}: {n_base / 1e6:.2f}M params, frozen; drafter {n_drafter / 1e6:.2f}M params: "
        f"{dcfg.num_hidden_layers} layers, block {dcfg.block_size}, taps {dcfg.target_layer_ids}, "
        f"mask token {dcfg.mask_token_id}")
    w = position_weights(args.block, args.decay).tolist()
    log(f"loss weights by position: {' '.join(f'{x:.3f}' for x in w)}")

    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(args.seed)
    anchor_gen = torch.Generator().manual_seed(args.seed + 1)
    perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, 0
    save_dtype = stored_dtype(base)
    budget = 60.0 * args.minutes
    history, step, tokens, train_s, ema = [], 0, 0, 0.0, None

    def held_out():  # None without held-out windows (--eval-windows 0, or a --corpus too small to spare any)
        ev = evaluate(model, drafter, held_w, args, amp)
        return {"step": step, "minutes": round(train_s / 60, 2), **ev} if ev else None

    cache = None
    if args.cache_target:
        cache = TargetCache(len(train_w), args.seq_len, cfg.hidden_size, len(dcfg.target_layer_ids),
                            torch.bfloat16 if args.amp == "bf16" else torch.float32, device)
        log(f"target cache: {cache.nbytes() / 2**30:.2f} GiB for {len(train_w)} windows")

    step_loss = torch.compile(block_loss) if args.compile else block_loss  # held-out evaluations run it eager
    drafter.eval()
    before = held_out()
    log(f"held-out before training: {describe(before)}")
    bar = train_mtp.Progress(args.log_every)
    K = args.block - 1

    drafter.train()
    while not (step >= args.steps if args.steps else train_s >= budget):
        progress = step / args.steps if args.steps else train_s / budget
        lr = base_train.lr_at(step, max(0.0, progress), args)
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + args.batch > len(perm):
            perm, cursor, epoch = torch.randperm(len(train_w), generator=order), 0, epoch + 1
        tuner.apply()
        ran_on, t_step = tuner.threads(), time.time()
        idx = perm[cursor:cursor + args.batch]
        batch = train_w[idx].to(device)  # (B, T+1)
        cursor += args.batch
        with amp():
            loss, ce, agree, acc = losses(model, drafter, batch, args, anchor_gen, cache, idx, step_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip).item()
        base_train.require_finite(step + 1, {"loss": loss.detach()})  # no extra wait: .item() above synchronised
        opt.step()
        dt = time.time() - t_step
        train_s += dt
        step += 1
        tokens += batch.shape[0] * args.seq_len  # tokens through the target
        if step > 1:  # the first step pays one-off allocation costs
            tuner.observe(tuple(batch.shape), dt)
        vals = torch.cat([loss.detach().float().view(1), acc.float().view(1), agree.float()]).cpu()
        ema = vals if ema is None else 0.95 * ema + 0.05 * vals
        rate = tokens / train_s
        where = f"step {step}/{args.steps}  {train_s / 60:5.1f} min" if args.steps else \
            f"{train_s / 60:5.1f}/{args.minutes:g} min  step {step}"
        agree_text = "/".join(f"{x:.2f}" for x in ema[2:].tolist())
        bar.show(min(1.0, progress), f"{where}  loss {ema[0]:.3f}  agree {agree_text}  accept {ema[1]:.2f}  "
                 f"{rate:,.0f} tok/s  lr {lr:.1e}")
        if step % args.log_every == 0:
            r = lambda xs: [round(x, 4) for x in xs.tolist()]  # noqa: E731
            history.append({"step": step, "minutes": round(train_s / 60, 2), "loss_ema": round(ema[0].item(), 4),
                            "accept_len_ema": round(ema[1].item(), 4), "agree_ema": r(ema[2:2 + K]), "ce": r(ce),
                            "lr": lr, "grad_norm": round(gnorm, 3) if math.isfinite(gnorm) else str(gnorm),
                            "tokens": tokens, "tokens_per_second": round(rate, 1), "threads": ran_on})
    bar.done()

    drafter.eval()
    after = held_out()
    evals = [ev for ev in (before, after) if ev]
    d = {"finished": True, "command": " ".join([Path(sys.executable).name] + sys.argv), "args": vars(args),
         "base": str(base.resolve()), "corpus": source, "drafter": dcfg.to_dict(), "drafter_params": n_drafter,
         "loss_weights": [round(x, 4) for x in w], "steps": step, "epochs": epoch, "tokens_seen": tokens,
         "train_seconds": round(train_s, 1), "minutes": round(train_s / 60, 2),
         "tokens_per_second": round(tokens / max(train_s, 1e-9), 1), "saved_dtype": str(save_dtype),
         "held_out_before": before, "held_out": after, "agree_by_position": after["agree"] if after else [],
         "evals": evals, "history": history}
    write_drafter(drafter, out, d, save_dtype)
    log(f"held-out before training: {describe(before)}")
    log(f"held-out after {step} steps: {describe(after)}")
    log(f"saved {out}: {step} steps, {tokens:,} tokens in {train_s / 60:.1f} min of training "
        f"({tokens / max(train_s, 1e-9):,.0f} tok/s); wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
