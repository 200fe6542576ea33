"""Distillation data for the DFlash drafter: the target's own continuations of corpus prompts.

    python scripts/distill_data.py --base weights/stdlib-hybrid-8m --out /tmp/distill.pt --windows 4096

A drafter is accepted where it predicts what the target writes, not what the corpus says next, so it
should train on text the target wrote. For every window:
    1. a prompt: --prompt-len tokens at a random place in the corpus's training split (the Python
       standard library's, as train.py splits it; --corpus FILE|DIR otherwise);
    2. the engine (nano_spec.LLM, batched) continues it for --new-tokens tokens, greedily (speculative,
       proposer auto), or sampled at temperature 1 for a --sampled fraction of the prompts (the target's
       distribution, not only its mode; plain decoding, which samples faster than speculation at
       batch 64 on one core: 814 against 509 tok/s for MTP under auto, a step's cost growing with
       its 64 x (γ + 1) rows);
    3. window = prompt + continuation, (prompt_len + new_tokens) ids.
The held-out windows continue prompts from the held-out modules (never trained on), greedily, as the
benchmarks decode. Window i's prompt and its greedy-or-sampled draw depend only on (--seed, i).

The file is a cache: it is rewritten (atomically) after every batch, and a rerun with the same settings
and a larger --windows (or after an interrupt) keeps what is there and generates only the rest. A file
made with other settings is refused. scripts/train_dflash.py reads it with --data FILE.

The prompts depend on the corpus, and the default corpus on this interpreter's stdlib. --export-prompts PATH
writes the prompts of the windows of --out (then of --also FILE..) as token ids (safetensors) and exits;
--prompts PATH then continues exactly those prompts, window i the i-th, with no corpus read (the shipped
drafter's list is weights/stdlib-hybrid-8m/distill_prompts.safetensors).
"""
import os
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: train_mtp.py, train.py, arg_types.py
import train_mtp  # noqa: E402  (it imports train.py, which puts the repository root on sys.path)
from train_mtp import base_train  # noqa: E402
from arg_types import Parser, existing_path, integer, number, threads  # noqa: E402

from nano_spec import LLM, SamplingParams  # noqa: E402
from nano_spec.model.config import ModelConfig  # noqa: E402

FORMAT = "nano_spec distill v1"


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n")[0])
    size = integer(1)
    ap.add_argument("--base", required=True, help="the target checkpoint directory")
    ap.add_argument("--out", required=True, help="the data file (a cache: a rerun extends it)")
    ap.add_argument("--windows", type=size, default=2048, help="training windows wanted in the file")
    ap.add_argument("--held", type=integer(0), default=48, help="held-out windows (held-out modules, greedy)")
    ap.add_argument("--prompt-len", type=size, default=64, help="corpus tokens before each continuation")
    ap.add_argument("--new-tokens", type=size, default=192, help="tokens the target writes per window")
    ap.add_argument("--sampled", type=number(0, 1), default=0.5,
                    help="fraction of training prompts continued at temperature 1 (the rest greedily)")
    ap.add_argument("--corpus", type=existing_path, help="a text file or directory (default: the Python stdlib)")
    ap.add_argument("--prompts", type=existing_path, help="continue these prompts (a file of --export-prompts)")
    ap.add_argument("--export-prompts", metavar="PATH",
                    help="write the prompts of the windows of --out (and --also files) to PATH and exit")
    ap.add_argument("--also", type=existing_path, nargs="+", default=[], help="with --export-prompts: more data files")
    ap.add_argument("--batch", type=size, default=32, help="requests in flight (the engine's max_batch)")
    ap.add_argument("--threads", type=threads, default=1, help="intra-op threads (auto: the engine measures)")
    ap.add_argument("--seed", type=integer(0), default=0)
    return ap.parse_args(argv)


def corpus_streams(args, tok: Tokenizer, eos: int):
    """-> (training token stream, held-out token stream), each (n,) int64, documents joined by EOS."""
    if args.corpus is None:
        train_docs, held_docs = base_train.stdlib_files()
        return (base_train.token_stream(tok, [t for _, t in train_docs], eos),
                base_train.token_stream(tok, [t for _, t in held_docs], eos))
    stream = base_train.token_stream(tok, train_mtp.corpus_texts(Path(args.corpus)), eos)
    cut = len(stream) * 9 // 10  # the last tenth is held out
    return stream[:cut], stream[cut:]


def prompt(stream: torch.Tensor, P: int, key: int) -> list:
    """P consecutive tokens of stream at a place that depends only on key."""
    start = random.Random(key).randrange(len(stream) - P + 1)
    return stream[start:start + P].tolist()


def settings(args, base: Path) -> dict:
    """What the windows depend on: a file made with other settings is not extended."""
    stdlib = "Python {}.{} stdlib".format(*sys.version_info[:2])  # its files differ from version to version
    corpus = f"prompts {args.prompts}" if args.prompts else args.corpus or stdlib
    return {"format": FORMAT, "base": str(base.resolve()), "corpus": corpus,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "sampled": args.sampled,
            "held": args.held, "seed": args.seed}


def read(path, flag: str = "--out") -> dict:
    """A data file of this script (also train_dflash.py's reader), or ValueError naming flag."""
    try:
        data = torch.load(path, weights_only=True)
    except Exception as e:  # not a file torch.save wrote
        data = e
    if not isinstance(data, dict) or not {"settings", "train", "held", "train_sampled"} <= set(data):
        raise ValueError(f"{flag}: {path} is not a data file of distill_data.py; give another path")
    return data


def window_key(seed: int, held: bool, i: int) -> int:
    """What window i's prompt place and its greedy-or-sampled draw (and sampling seed) depend on."""
    return (seed * 2 + held) * 1_000_003 + i


def load(out: Path, want: dict) -> dict:
    if not out.exists():
        return {"settings": want, "train": [], "train_sampled": [], "held": []}
    data = read(out)
    if data.get("settings") != want:
        raise ValueError(f"--out: {out} was made with other settings ({data.get('settings')}); "
                         f"give another path or the same settings")
    return {"settings": want, "train": [w.tolist() for w in data["train"]],
            "train_sampled": data["train_sampled"].tolist(), "held": [w.tolist() for w in data["held"]]}


def save(out: Path, data: dict):
    """Written beside out, then renamed over it: an interrupt leaves the old file or the new one."""
    width = data["settings"]["prompt_len"] + data["settings"]["new_tokens"]
    rows = lambda ws: torch.tensor(ws, dtype=torch.int32).view(len(ws), width)  # noqa: E731  (n, P + R)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"settings": data["settings"], "train": rows(data["train"]), "held": rows(data["held"]),
                "train_sampled": torch.tensor(data["train_sampled"], dtype=torch.bool)}, tmp)
    os.replace(tmp, out)


def export_prompts(files: list, path: Path):
    """The first prompt_len tokens of every window of the data files, in order -> path (safetensors: train, held;
    int16 where the ids fit)."""
    data = [read(f) for f in files]
    if len({d["settings"]["prompt_len"] for d in data}) > 1:
        raise ValueError("--export-prompts: the files' prompts differ in length")
    P = data[0]["settings"]["prompt_len"]
    rows = {kind: torch.cat([d[kind][:, :P] for d in data]) for kind in ("train", "held")}
    small = all(len(r) == 0 or int(r.max()) < 2**15 for r in rows.values())
    save_file({k: r.to(torch.int16 if small else torch.int32).contiguous() for k, r in rows.items()}, str(path))


def given_prompts(path: str, P: int, args):
    """The prompts of an --export-prompts file, as two 'streams' of rows (n, P): window i of a kind takes row i."""
    rows = load_file(path)
    if any(rows[k].shape[1] != P for k in ("train", "held")):
        raise ValueError(f"--prompts: {path} holds prompts of {rows['train'].shape[1]} tokens, not --prompt-len {P}")
    for kind, want in (("train", args.windows), ("held", args.held)):
        if len(rows[kind]) < want:
            raise ValueError(f"--prompts: {path} holds {len(rows[kind])} {kind} prompts, fewer than the {want} asked")
    return rows["train"].long(), rows["held"].long()


def main(argv=None) -> int:
    args = parse_args(argv)
    base, out = Path(args.base), Path(args.out)
    try:
        if args.export_prompts:
            if not out.is_file():
                raise ValueError(f"--export-prompts: no data file at --out {out}")
            export_prompts([out, *args.also], Path(args.export_prompts))
            return 0
        cfg = ModelConfig.from_file(base / "config.json")
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
        if not cfg.eos_ids:
            raise ValueError("eos_token_id: documents are joined by EOS, and the base config names none")
        data = load(out, settings(args, base))
        if args.prompts:
            train_s, held_s = given_prompts(args.prompts, args.prompt_len, args)
        else:
            train_s, held_s = corpus_streams(args, tok, cfg.eos_ids[0])
        for name, s in (("training", train_s), ("held-out", held_s)):
            if not args.prompts and len(s) < args.prompt_len:
                raise ValueError(f"--prompt-len: the {name} corpus has {len(s)} tokens, fewer than {args.prompt_len}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_threads = None if args.threads == "auto" else args.threads
    engines = {}  # sampled -> its engine, loaded when first needed
    P, R, t0, made = args.prompt_len, args.new_tokens, time.time(), 0
    # (kind, index): held-out windows first, so a short run still has its evaluation set
    todo = [("held", i) for i in range(len(data["held"]), args.held)] + \
           [("train", i) for i in range(len(data["train"]), args.windows)]
    for c in range(0, len(todo), 4 * args.batch):  # a few batches per call: the engine refills freed slots
        chunk, prompts, params = todo[c:c + 4 * args.batch], [], []
        for kind, i in chunk:
            key = window_key(args.seed, kind == "held", i)
            source = held_s if kind == "held" else train_s
            prompts.append(source[i].tolist() if args.prompts else prompt(source, P, key))
            sampled = kind == "train" and random.Random(f"sampled {key}").random() < args.sampled
            params.append(SamplingParams(max_new_tokens=R, ignore_eos=True, temperature=1.0 if sampled else 0.0,
                                         seed=key if sampled else None))
        outs = [None] * len(chunk)
        for sampled in (False, True):
            rows = [r for r, sp in enumerate(params) if (sp.temperature > 0) == sampled]
            if not rows:
                continue
            if sampled not in engines:
                engines[sampled] = LLM(base, max_batch=args.batch, threads=n_threads,
                                       proposer="none" if sampled else "auto")
            for r, o in zip(rows, engines[sampled].generate([prompts[r] for r in rows], [params[r] for r in rows])):
                outs[r] = o
        for (kind, _), p, sp, o in zip(chunk, prompts, params, outs):  # in index order: a rerun continues it
            if o.finish_reason != "length":
                raise RuntimeError(f"the engine stopped a continuation early: {o.finish_reason} {o.error or ''}")
            data[kind].append(p + o.token_ids)
            if kind == "train":
                data["train_sampled"].append(sp.temperature > 0)
        save(out, data)
        made += len(chunk) * R
        print(f"[{time.time() - t0:7.1f}s] {len(data['train'])}/{args.windows} training, "
              f"{len(data['held'])}/{args.held} held-out windows; {made / (time.time() - t0):,.0f} tok/s",
              file=sys.stderr, flush=True)
    print(f"{out}: {len(data['train'])} training windows ({sum(data['train_sampled'])} sampled), "
          f"{len(data['held'])} held out, {P} + {R} tokens each", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
