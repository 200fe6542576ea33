"""python -m nano_spec.bench: end-to-end speedup of speculative decoding.

Runs the same prompts with plain decoding (γ = 0), with the MTP proposer at each
γ and with the n-gram proposer, at each batch size, in one process; asserts the
greedy outputs are identical to γ = 0; prints a table and, last, one JSON line.

    speedup = tokens/s with drafts / tokens/s with γ = 0   (same prompts, same run, greedy)
"""
import argparse
import json
import sys
import time
from pathlib import Path

from nano_spec.llm import LLM, shipped_weights
from nano_spec.sampling import SamplingParams


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m nano_spec.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--prompts-file", help="JSONL with a 'prompt' field (default: the checkpoint's eval_prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--no-ngram", action="store_true", help="skip the n-gram proposer")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the median is reported")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--plot", help="write a PNG of tau and speedup vs γ and accept_at by position")
    return p.parse_args(argv)


def load_prompts(args, model_dir: Path) -> list:
    path = Path(args.prompts_file) if args.prompts_file else model_dir / "eval_prompts.jsonl"
    if not path.is_file():
        raise ValueError(f"--prompts-file: {path} not found")
    try:
        prompts = [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"--prompts-file: {path} is not JSONL with a 'prompt' field") from None
    if not prompts:
        raise ValueError(f"--prompts-file: {path} holds no prompts")
    return prompts[: args.num_prompts]


def progress(i: int, n: int, label: str):
    filled = int(30 * i / n)
    print(f"\r[{'#' * filled}{' ' * (30 - filled)}] {i}/{n} {label:<24}", end="" if i < n else "\n",
          file=sys.stderr, flush=True)


def run(model_dir, prompts, proposer, gamma, batch, params, args) -> dict:
    llm = LLM(model_dir, backend=args.backend, device=args.device, max_batch=batch, num_drafts=gamma,
              proposer=proposer)
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up (compiles kernels)
    times = []
    for _ in range(args.repeats):
        llm.telemetry.reset()  # count only the last measured run
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    secs = sorted(times)[len(times) // 2]  # the median: one slow run on a shared machine does not decide
    st, tokens = llm.stats, sum(len(o.token_ids) for o in outs)
    return {"proposer": proposer, "gamma": gamma, "batch": batch, "tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs, "tau": st["tau"] if gamma else 1.0, "accept_at": st["accept_at"],
            "accept_at_by_seq_len": st["accept_at_by_seq_len"], "outputs": [o.token_ids for o in outs]}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model_dir = Path(args.model) if args.model else shipped_weights()
        prompts = load_prompts(args, model_dir)
        if any(g < 1 for g in args.gammas) or any(b < 1 for b in args.batch) or args.repeats < 1:
            raise ValueError("--gammas, --batch and --repeats take integers >= 1")
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        configs = [(b, "none", 0) for b in args.batch]
        configs += [(b, "mtp", g) for b in args.batch for g in args.gammas]
        configs += [] if args.no_ngram else [(b, "ngram", max(args.gammas)) for b in args.batch]
        rows = []
        for i, (b, proposer, g) in enumerate(configs):
            progress(i, len(configs), f"batch {b} {proposer} γ={g}")
            rows.append(run(model_dir, prompts, proposer, g, b, params, args))
        progress(len(configs), len(configs), "done")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = {r["batch"]: r for r in rows if r["gamma"] == 0}
    for r in rows:
        assert r["outputs"] == base[r["batch"]]["outputs"], \
            f"greedy outputs differ: {r['proposer']} γ={r['gamma']} batch {r['batch']}"
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]]["tokens_per_s"]
    print(f"model {model_dir.name}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"median of {args.repeats} runs; outputs identical to γ = 0: yes")
    print(f"{'batch':>5} {'proposer':>8} {'γ':>2} {'tokens/s':>9} {'tau':>6} {'speedup':>8}  accept_at")
    for r in rows:
        print(f"{r['batch']:>5} {r['proposer']:>8} {r['gamma']:>2} {r['tokens_per_s']:>9.1f} {r['tau']:>6.3f} "
              f"{r['speedup']:>7.2f}x  {[round(a, 3) for a in r['accept_at']]}")
    if args.plot:
        plot(rows, args.plot)
    summary = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    print(json.dumps({"model": model_dir.name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "identical": True, "rows": summary}))
    return 0


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'nano-spec[plot]'", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        mtp = sorted((r for r in rows if r["batch"] == b and r["proposer"] in ("none", "mtp")), key=lambda r: r["gamma"])
        ax1.plot([r["gamma"] for r in mtp], [r["tau"] for r in mtp], "o-", label=f"tau, batch {b}")
        ax1.plot([r["gamma"] for r in mtp], [r["speedup"] for r in mtp], "s--", label=f"speedup, batch {b}")
        top = mtp[-1]
        ax2.bar([j + i * width for j in range(len(top["accept_at"]))], top["accept_at"], width=width,
                label=f"batch {b}, γ={top['gamma']}")
    ax1.set_xticks(sorted({r["gamma"] for r in rows if r["proposer"] in ("none", "mtp")}))
    ax2.set_xticks([j + (len(batches) - 1) * width / 2 for j in range(len(top["accept_at"]))],
                   [str(j) for j in range(len(top["accept_at"]))])
    ax1.set(xlabel="γ (drafts per step)")
    ax2.set(xlabel="draft position j", ylabel="accept_at[j]")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
