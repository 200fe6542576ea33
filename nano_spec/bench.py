"""python -m nano_spec.bench: end-to-end speedup of speculative decoding, configurations interleaved.

At each batch size it builds one engine per configuration: plain decoding (γ = 0), MTP at each γ, MTP with
γ = auto, the checkpoint's DFlash drafter (its dflash/ directory, when it has one) at each budget γ = 1 .. Bk-1
and auto, n-gram at γ = 3 and, with --vs-transformers, transformers' GraniteMoeHybridForCausalLM.generate on the
same base weights. It warms each up, then times them in turn for --repeats rounds in one process, checks that
every greedy output equals plain decoding's in the same mode (identity_base; exit status 1 with the first
differing prompt and token when one does not), and prints a table, the targets of the README and one JSON line.
With --json-schema FILE every nano_spec configuration also runs under that schema ("+schema"), its outputs
checked against plain decoding under the same schema. With --compile every nano_spec configuration also runs
with LLM(compile=True) ("+compiled", backend torch; under the schema too, "+schema +compiled"), warmed up on the
whole prompt set until a pass compiles no new graph (at most WARM_PASSES); each is checked against compiled plain
(under its schema, if any), and compiled plain against eager plain in fp32 (llama.cpp and transformers too). With
--vs-llama-cpp MODEL.gguf, at batch 1, llama-cpp-python decodes the same token ids, one prompt at a time, on a
GGUF of the same base weights (docs/BENCHMARKS.md, "Beside llama.cpp"); with --dtype bfloat16 every engine runs
in bf16, beside a bf16 GGUF. With --temperature the requests are sampled, and outputs are not compared. A
checkpoint without an MTP head has no MTP rows.

    tokens/s from the median wall time of the rounds; CPU seconds (all threads) beside it
    speedup = tokens/s / tokens/s of (eager) plain decoding at the same batch size, the median of each round's own
        ratio (a round's two times lie close together on a machine that drifts); the targets' ratios too
    step speedup = the same ratio over the step phases only (no prefill): what the planner predicts
    decode tokens/s = (tokens - prompts) / decode seconds: the tokens after each prompt's first, over the
        step phases (nano_spec: the median over rounds, as for step speedup; llama.cpp: from each prompt's
        first token to its last, summed); none for transformers
    step ms = the step phases' seconds / engine steps (the median round)
    floor ms = the matmuls that read a weight in the device steps of one pass of the eager engine of the same
        configuration, recorded with their own tensors and replayed alone (the same aten calls, so the same
        GEMM path and weight layout), per engine step: what the steps would cost if they were only their matmuls;
        for a compiled engine that packs its weights, the products of few rows replayed in its C instead, over
        int8 copies for the drafter's (nano_spec/bench_floor.py)
    overhead = step ms / floor ms
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from nano_spec.bench_baselines import LlamaCpp, Transformers
from nano_spec.bench_floor import matmul_floor_ms
from nano_spec.bench_plot import plot
from nano_spec.cli import check_threads, read_schema
from nano_spec.engine.llm import LLM
from nano_spec.engine.settings import resolve_device, shipped_weights
from nano_spec.model.config import ModelConfig
from nano_spec.model.cpu_rows import RowsLinear
from nano_spec.model.sampling import SamplingParams

# the README's benchmark targets: (row, goal, measured value from {batch: {config: row}}); all are "value >= goal"
TARGETS = (
    ("MTP γ=3 vs plain, batch 1", 1.6, lambda t: ratio(t, 1, "mtp γ=3", "plain")),
    ("auto vs plain, batch 1", 1.6, lambda t: ratio(t, 1, "mtp γ=auto", "plain")),
    ("auto vs plain, batch 8", 1.2, lambda t: ratio(t, 8, "mtp γ=auto", "plain")),
    ("auto vs plain, batch 16", 1.0, lambda t: ratio(t, 16, "mtp γ=auto", "plain")),
    ("auto vs plain, worst batch", 0.97, lambda t: worst(ratio(t, b, "mtp γ=auto", "plain") for b in t)),
    ("auto vs best fixed γ, worst batch", 0.95,
     lambda t: worst(ratio(t, b, "mtp γ=auto", best_fixed(t[b])) for b in t)),
    ("n-gram γ=3 vs plain, batch 1", 1.5, lambda t: ratio(t, 1, "ngram γ=3", "plain")),
    ("plain vs transformers, batch 1", 1.0, lambda t: ratio(t, 1, "plain", "transformers")),
    ("plain vs transformers, batch 8", 1.0, lambda t: ratio(t, 8, "plain", "transformers")),
    ("auto: predicted vs measured step speedup, worst batch", 0.9, lambda t: worst(
        min(q, 1 / q) for q in (r["predicted_speedup"] / r["step_speedup"] for rows in t.values()
                                for r in rows.values() if r["config"] == "mtp γ=auto"))),
    # the block drafter (docs/DESIGN.md §13)
    ("propose time, MTP γ=3 / dflash γ=3, batch 1", 2.0, lambda t: stat_ratio(t, 1, "mtp γ=3", "dflash γ=3",
                                                                             "propose_ms_per_step")),
    ("tau, dflash γ=3 / MTP γ=3, batch 1", 1.0, lambda t: stat_ratio(t, 1, "dflash γ=3", "mtp γ=3", "tau")),
    ("tau, dflash at its best budget, batch 1", 4.0, lambda t: max(
        (r["tau"] for c, r in t.get(1, {}).items() if c.startswith("dflash γ=") and r["tau"]), default=None)),
    ("dflash auto vs plain, batch 1", 1.6, lambda t: ratio(t, 1, "dflash γ=auto", "plain")),
    ("dflash auto vs plain, batch 8", 1.25, lambda t: ratio(t, 8, "dflash γ=auto", "plain")),
    ("dflash auto vs MTP auto, batch 1", 1.1, lambda t: ratio(t, 1, "dflash γ=auto", "mtp γ=auto")),
    # the compiled step (docs/DESIGN.md §12) and llama.cpp beside it
    ("compiled plain vs eager plain, decode tokens/s, batch 1", 2.5,
     lambda t: decode_ratio(t, 1, "plain +compiled", "plain")),
    ("compiled auto vs llama.cpp plain, decode tokens/s, batch 1", 1.0,
     lambda t: decode_ratio(t, 1, "mtp γ=auto +compiled", "llama.cpp")),
    ("compiled auto vs compiled plain, batch 1", 1.5,
     lambda t: ratio(t, 1, "mtp γ=auto +compiled", "plain +compiled")),
    ("compiled auto vs compiled plain, batch 8", 1.2,
     lambda t: ratio(t, 8, "mtp γ=auto +compiled", "plain +compiled")),
)


def paired(a: dict, c: dict) -> float:
    """Row a's tokens/s over row c's: the median over rounds of the ratio within each round."""
    return statistics.median(a["tokens"] / wa / (c["tokens"] / wc) for wa, wc in zip(a["rounds_s"], c["rounds_s"]))


def ratio(table, b, a, c):
    rows = table.get(b, {})
    return paired(rows[a], rows[c]) if a in rows and c in rows else None


def stat_ratio(table, b, a, c, key):
    rows = table.get(b, {})
    return rows[a][key] / rows[c][key] if a in rows and c in rows and rows[a][key] and rows[c][key] else None


def decode_ratio(table, b, a, c):
    return stat_ratio(table, b, a, c, "decode_tokens_per_s")


def eager_plain(config: str) -> str:
    """Eager plain decoding under config's schema, if it has one: its speedup's base."""
    return "plain +schema" if " +schema" in config else "plain"


def identity_base(config: str, fp32: bool) -> str | None:
    """The configuration whose greedy outputs `config`'s must equal: plain decoding in the same mode (eager,
    +schema, +compiled, +schema +compiled). Compiled plain, llama.cpp and transformers equal eager plain (compiled
    plain under a schema, eager plain under it) in fp32 only: in bf16 each rounds after reductions summed in its
    own order (the graph's fused ones, another GEMM), so logits can differ by one bf16 step and a near tie can flip
    (docs/DESIGN.md §12): there they are compared with nothing."""
    if config in ("plain +compiled", "plain +schema +compiled", "llama.cpp", "transformers"):
        return eager_plain(config) if fp32 else None
    return eager_plain(config) + (" +compiled" if config.endswith("+compiled") else "")


def first_difference(a, b):
    """(prompt, token) of the first difference between two lists of outputs (token id lists)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x, y = a[i] if i < len(a) else [], b[i] if i < len(b) else []
    return i, next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def worst(values):
    return min((v for v in values if v is not None), default=None)


def best_fixed(rows):
    return max((c for c in rows if c == "plain" or c.removeprefix("mtp γ=").isdigit()),
               key=lambda c: rows[c]["tokens_per_s"])


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m nano_spec.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--prompts-file", help="JSONL with a 'prompt' field (default: the checkpoint's eval_prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--no-ngram", action="store_true", help="skip the n-gram drafter")
    p.add_argument("--no-auto", action="store_true", help="skip num_drafts=auto")
    p.add_argument("--dflash-gammas", type=int, nargs="+",
                   help="budgets of the DFlash drafter (default: 1 .. block_size - 1, and auto unless --no-auto)")
    p.add_argument("--no-dflash", action="store_true", help="skip the checkpoint's DFlash drafter")
    p.add_argument("--vs-transformers", action="store_true",
                   help="also time transformers' generate on the same base weights (needs transformers)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported")
    p.add_argument("--threads", type=int, help="torch threads (default: the engine's rule, see README)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--compile", action="store_true",
                   help="also run each configuration with its step as one graph ('+compiled', LLM(compile=True)): "
                        "torch.compile on the CPU (backend torch whatever --backend says), a CUDA graph on CUDA; "
                        "speedups stay against eager plain")
    p.add_argument("--vs-llama-cpp", metavar="MODEL.gguf",
                   help="also time llama-cpp-python's plain decoding at batch 1 (so --batch must include 1) on "
                        "this GGUF of the same base weights (scripts/export_gguf.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", help="the engines' weights and caches, as LLM(dtype=...) takes it (default: the "
                   "engine's, float32 on a CPU); --vs-transformers runs in it too")
    p.add_argument("--plot", help="write a PNG of tau and speedup vs γ and accept_at by position")
    p.add_argument("--json-schema", metavar="FILE", help="also run every configuration under this JSON schema")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every request at this temperature, unseeded, so that auto's planner picks γ (a seeded "
                        "request runs at γ_max; default: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    return p.parse_args(argv)


def dflash_budgets(model_dir: Path, args) -> list:
    """The DFlash rows: each budget γ (1 .. Bk-1 by default) and auto, when the checkpoint ships a drafter."""
    from nano_spec.model.dflash import DFlashConfig
    from nano_spec.engine.settings import DRAFTER_DIR

    found = model_dir / DRAFTER_DIR / "config.json"
    if not found.is_file():
        return []
    block = DFlashConfig.from_file(found).block_size
    gammas = args.dflash_gammas or list(range(1, block))
    if any(not 1 <= g < block for g in gammas):
        raise ValueError(f"--dflash-gammas: budgets must be in [1, {block - 1}] (the drafter's block_size is {block})")
    return gammas + ([] if args.no_auto else ["auto"])


def load_prompts(args, model_dir: Path) -> list:
    path = Path(args.prompts_file) if args.prompts_file else model_dir / "eval_prompts.jsonl"
    if not path.is_file():
        raise ValueError(f"--prompts-file: {path} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte order mark is not part of the first line
        prompts = [(i, json.loads(line)["prompt"]) for i, line in enumerate(text.split("\n"), 1) if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"--prompts-file: {path} is not JSONL with a 'prompt' field") from None
    for i, p in prompts:
        if not isinstance(p, str):  # the bench tokenizes text; a number or a list would fail deep in the run
            raise ValueError(f"--prompts-file: line {i} of {path}: 'prompt' must be a string, got {type(p).__name__}")
    prompts = [p for _, p in prompts]
    if not prompts:
        raise ValueError(f"--prompts-file: {path} holds no prompts")
    return prompts[: args.num_prompts]


class Engine:
    """One nano_spec configuration: generate() -> token ids per prompt, stats of the last call."""

    def __init__(self, model_dir, proposer, gamma, batch, args, schema=None, compiled=False):
        self.name = ("plain" if proposer == "none" else f"{proposer} γ={gamma}") + (" +schema" if schema else "") \
            + (" +compiled" if compiled else "")
        self.proposer, self.gamma, self.schema, self.compiled, self.args = proposer, gamma, schema, compiled, args
        cpu = resolve_device(args.device).type == "cpu"  # compiled on the CPU: torch.compile of the references
        self.llm = LLM(model_dir, backend="torch" if compiled and cpu else args.backend, device=args.device,
                       dtype=args.dtype, max_batch=batch, num_drafts=gamma, proposer=proposer, threads=args.threads,
                       compile=compiled)

    def generate(self, ids, max_new_tokens):
        self.llm.telemetry.reset()  # the planner keeps learning across rounds, as in a server
        # under a schema a complete output finishes with "stop" even with ignore_eos
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, json_schema=self.schema,
                                temperature=self.args.temperature, top_k=self.args.top_k, top_p=self.args.top_p)
        return [o.token_ids for o in self.llm.generate(ids, params)]

    def stats(self):
        st = self.llm.stats
        steps_s = sum(v for k, v in st["phase_seconds"].items() if k != "prefill")  # what the planner models
        masks = sum(st["phase_histogram_ms"]["mask"])  # engine steps that built grammar masks
        drafts = sum(st["phase_histogram_ms"]["propose"])  # engine steps that drafted (eager)
        return {"steps_s": steps_s, "engine_steps": sum(st["phase_histogram_ms"]["copy"]),  # one copy a step
                **{k: st.get(k) for k in ("tau", "accept_at", "gamma_hist", "predicted_speedup")},
                "propose_ms_per_step": st["phase_seconds"]["propose"] * 1e3 / drafts if drafts else None,
                "mask_ms_per_step": st["phase_seconds"]["mask"] * 1e3 / masks if masks else None,
                "grammar_compile_s": st["grammar_compile_seconds"], "compile_s": st["compile_seconds"]}


WARM_PASSES = 4


def measure(engines, ids, args) -> list:
    """Warm every engine up, then time them in turn, args.repeats rounds (the order rotates).
    A compiled engine compiles a graph for each new shape bucket on first use, and which buckets a run meets
    depends on its γ choices: it warms up on the whole prompt set until a pass compiles nothing new (at most
    WARM_PASSES passes; the compile seconds are in the row's notes)."""
    for e in engines:
        if not getattr(e, "compiled", False):
            e.generate(ids[:1], 4)
            continue
        for _ in range(WARM_PASSES):
            before = e.llm.runner.compile_seconds()
            e.generate(ids, args.max_new_tokens)
            if e.llm.runner.compile_seconds() == before:
                break
    wall, cpu, steps = ({e.name: [] for e in engines} for _ in range(3))  # seconds per round
    engine_steps = {e.name: [] for e in engines}
    outputs, stats = {}, {}  # of the last round, but steps_s is the median of steps_rounds
    for r in range(args.repeats):
        for e in engines[r % len(engines):] + engines[: r % len(engines)]:
            print(f"\r  round {r + 1}/{args.repeats} {e.name:<21}", end="", file=sys.stderr, flush=True)
            w0, c0 = time.perf_counter(), time.process_time()
            outputs[e.name] = e.generate(ids, args.max_new_tokens)
            wall[e.name].append(time.perf_counter() - w0)
            cpu[e.name].append(time.process_time() - c0)
            stats[e.name] = e.stats()
            steps[e.name].append(stats[e.name]["steps_s"])  # None from transformers
            engine_steps[e.name].append(stats[e.name].get("engine_steps"))
    print(file=sys.stderr)
    floor = {e.name: matmul_floor_ms(e.llm, lambda: e.generate(ids, args.max_new_tokens)) for e in engines
             if isinstance(e, Engine) and not e.compiled and not e.schema}
    packs = {e.name: any(isinstance(m, RowsLinear) for m in e.llm.model.modules()) for e in engines
             if isinstance(e, Engine)}  # a compiled engine's products of few rows in C (docs/DESIGN.md §12)
    rows = []
    for e in engines:
        name = e.name
        tokens, median_wall = sum(map(len, outputs[name])), statistics.median(wall[name])
        steps_s = None if None in steps[name] else statistics.median(steps[name])
        median_round = None if steps_s is None else steps[name].index(sorted(steps[name])[len(steps[name]) // 2])
        n = None if median_round is None else engine_steps[name][median_round]
        step_ms = steps_s * 1e3 / n if n else None  # the median round's
        floor_ms = floor.get(name.removesuffix(" +compiled"), {}).get("rows" if packs.get(name) else "aten")
        rows.append({"config": name, "proposer": e.proposer, "gamma": e.gamma, "batch": None,
                     "threads": torch.get_num_threads(), "tokens": tokens, "wall_s": median_wall,
                     "cpu_s": statistics.median(cpu[name]), "tokens_per_s": tokens / median_wall,
                     "rounds_s": wall[name], **stats[name], "steps_rounds": steps[name], "outputs": outputs[name],
                     "steps_s": steps_s, "decode_tokens_per_s": (tokens - len(ids)) / steps_s if steps_s else None,
                     "step_ms": step_ms, "floor_ms": floor_ms,
                     "overhead": step_ms / floor_ms if step_ms and floor_ms else None})
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model_dir = Path(args.model) if args.model else shipped_weights()
        check_threads(args.threads)
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts: must be an integer >= 1, got {args.num_prompts}")
        prompts = load_prompts(args, model_dir)
        schema = read_schema(args.json_schema) if args.json_schema else None
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # checked once, named
        if args.temperature and (args.vs_llama_cpp or args.vs_transformers):
            raise ValueError("--temperature: llama.cpp and transformers rows decode greedily; sample without them")
        if any(g < 1 for g in args.gammas) or any(b < 1 for b in args.batch) or args.repeats < 1:
            raise ValueError("--gammas, --batch and --repeats take integers >= 1")
        dflash = [] if args.no_dflash else dflash_budgets(model_dir, args)
        mtp = ModelConfig.from_file(model_dir / "config.json").has_mtp
        if not mtp:  # a published checkpoint, say: its plain, n-gram and llama.cpp rows still run
            print(f"{model_dir.name} has no MTP head: no MTP rows", file=sys.stderr)
        if args.vs_llama_cpp:
            if 1 not in args.batch:  # llama.cpp decodes one sequence: its row exists at batch 1 only
                raise ValueError(f"--vs-llama-cpp: llama.cpp runs at batch 1 only; add 1 to --batch "
                                 f"(got --batch {' '.join(map(str, args.batch))})")
            LlamaCpp.check(args.vs_llama_cpp)
        table, dtype = {}, None
        for b in args.batch:
            configs = [("none", 0)] + ([("mtp", g) for g in args.gammas] if mtp else [])
            configs += [] if args.no_auto or not mtp else [("mtp", "auto")]
            configs += [("dflash", g) for g in dflash]
            configs += [] if args.no_ngram else [("ngram", 3)]
            engines = [Engine(model_dir, p, g, b, args) for p, g in configs]
            engines += [Engine(model_dir, p, g, b, args, schema) for p, g in configs] if schema else []
            schemas = [None, schema] if schema else [None]
            engines += [Engine(model_dir, p, g, b, args, s, compiled=True) for s in schemas for p, g in configs] \
                if args.compile else []
            ids = [engines[0].llm.tokenizer.encode(p) for p in prompts]
            weight = next(engines[0].llm.model.parameters())
            dtype = str(weight.dtype).removeprefix("torch.")
            if args.vs_llama_cpp and b == 1:  # no BOS: the same ids as nano_spec's
                engines.append(LlamaCpp(args.vs_llama_cpp, max(map(len, ids)) + args.max_new_tokens))
            if args.vs_transformers:
                engines.append(Transformers(model_dir, b, weight.device, weight.dtype))
            print(f"batch {b}: {len(engines)} configurations x {args.repeats} rounds", file=sys.stderr)
            table[b] = {r["config"]: {**r, "batch": b} for r in measure(engines, ids, args)}
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [r for batch_rows in table.values() for r in batch_rows.values()]
    for r in rows:
        base = table[r["batch"]][eager_plain(r["config"])]
        same = None if args.temperature else table[r["batch"]].get(identity_base(r["config"], dtype == "float32"))
        if same is not None and r["outputs"] != same["outputs"]:  # the premise of every speedup; an if, as
            i, j = first_difference(r["outputs"], same["outputs"])   # python -O keeps it
            print(f"error: greedy outputs differ from {same['config']}: {r['config']} at batch {r['batch']}, "
                  f"prompt {i}, token {j}", file=sys.stderr)
            return 1
        r["speedup"] = paired(r, base)
        r["step_speedup"] = base["steps_s"] / r["steps_s"] if r["steps_s"] else None
    also = ", and that, llama.cpp and transformers to eager plain" if dtype == "float32" else ""
    identical = "not compared: a drafter's steps draw their own random numbers" if args.temperature else \
        f"yes (compiled rows to compiled plain{also})"
    decoding = f"sampled at temperature {args.temperature:g}, top-k {args.top_k}, top-p {args.top_p:g}, unseeded" \
        if args.temperature else "greedy"
    print(f"model {model_dir.name} in {dtype}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, {decoding}, "
          f"median of {args.repeats} interleaved rounds; outputs identical to plain decoding: {identical}")
    print("batch thr config                     tokens/s  decode tok/s  wall s   CPU s    tau  speedup  step ms "
          "floor ms overhead  notes")
    for r in rows:
        tau = f"{r['tau']:.3f}" if r["tau"] else "-"
        note = ""
        if r["propose_ms_per_step"] and r["proposer"] in ("mtp", "dflash"):
            note = f"propose {r['propose_ms_per_step']:.2f} ms/step"
        if r["config"].removesuffix(" +compiled") in ("mtp γ=auto", "dflash γ=auto"):
            note += f"; steps only {r['step_speedup']:.2f}x, predicted {r['predicted_speedup']:.2f}x; " \
                    f"steps by γ {r['gamma_hist']}"
        if " +schema" in r["config"]:  # mask: the verify's grammar masks; masked drafting is in propose
            note = f"vs plain +schema; mask {r['mask_ms_per_step']:.3f} ms/step, compile " \
                   f"{r['grammar_compile_s'] * 1e3:.1f} ms"
        if r["config"].endswith("+compiled"):
            note += f"; compiled {r['compile_s']:.0f} s, warm-up included"
        if r["config"] == "transformers":
            note = "no MTP in transformers; its prompt lookup refuses this stateful model"
        if r["config"] == "llama.cpp":
            note = f"llama.cpp plain decoding, the same base weights in a GGUF of {r['gguf_type']}"
        decode = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-"
        step, floor, over = (f"{r[k]:.3f}" if r.get(k) else "-" for k in ("step_ms", "floor_ms", "overhead"))
        print(f"{r['batch']:>5} {r['threads']:>3} {r['config']:<25} {r['tokens_per_s']:>9.1f} {decode:>13} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {tau:>6} {r['speedup']:>7.2f}x {step:>8} {floor:>8} "
              f"{over:>8}  {note}")
    print("targets (tokens/s ratios, paired by round, unless named)")
    for name, goal, measure_ in TARGETS:
        value = measure_(table)
        shown = "not measured" if value is None else f"{value:.2f} ({'met' if value >= goal else 'not met'})"
        print(f"  {name:<58} goal >= {goal:.2f}  {shown}")
    if args.plot:
        plot([r for r in rows if not r["config"].endswith(("+schema", "+compiled"))
              and r["config"] not in ("transformers", "llama.cpp")], args.plot)  # nano_spec's eager rows
    print(json.dumps({"model": model_dir.name, "dtype": dtype, "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "identical": not args.temperature,
                      "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
                      "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
