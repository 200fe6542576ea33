"""python -m nano_spec.generate: complete prompts with speculative decoding.

With no prompt it runs the demo: the weights shipped in weights/ write the methods of a small class, and it
reports what speculation did against plain decoding timed in the same run. Exit status: 0 when every request
finished, 2 for a user error (one line on stderr, nothing queued), 1 when a request failed inside the engine (its
error on stderr, and in the `error` field with --json), 130 after Ctrl-C (the requests that had finished are printed
first), 141 when stdout closes early (`| head`). --show-drafts colours each token by its origin (docs/DESIGN.md §1).
"""
import argparse
import itertools
import json
import os
import sys
import time

from nano_spec.cli import check_threads, read_file, read_schema

# The demo: the model completes each method of a class in turn, every completion in the prompt of the next. The
# shipped model has 7.6M parameters: one short body at a time is what it writes well.
DEMO_CLASS = ('class Stack:\n    """A last-in, first-out stack."""\n\n'
              '    def __init__(self):\n        self.items = []\n\n')
DEMO_METHODS = ("    def push(self, item):\n        self.items.", "    def pop(self):\n        return self.items.",
                "    def peek(self):\n        return self.items[", "    def __len__(self):\n        return len(",
                "    def __iter__(self):\n        return iter(",
                "    def __contains__(self, item):\n        return item in")


def gamma_arg(value: str):
    return value if value == "auto" else int(value)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m nano_spec.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hugging Face model id, org/name, from the cache or "
                   "downloaded (default: the weights shipped in weights/)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="prompts, one per line, or JSONL with a 'prompt' field")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is one user turn, rendered by the checkpoint's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system turn before each prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-drafts", type=gamma_arg, default="auto",
                   help="γ, drafts per step, or auto: chosen per step from measured acceptance and cost")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (γ = 0)")
    p.add_argument("--proposer", choices=["auto", "mtp", "dflash", "ngram", "none"], default="auto")
    p.add_argument("--drafter", metavar="DIR",
                   help="with --proposer dflash: the DFlash drafter directory (default: the checkpoint's dflash/)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--compile", action="store_true",
                   help="each step as one graph: torch.compile on the CPU (backend torch), a CUDA graph on CUDA "
                        "(docs/DESIGN.md §12)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the stored dtype on CUDA, float32 on CPU)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch threads (default: 1 for small work on a CPU, see README)")
    p.add_argument("--max-seq-len", type=int)
    p.add_argument("--logprobs", type=int, default=0, help="report each token's logprob and the top-N")
    p.add_argument("--json-schema", metavar="FILE", help="structured output: a JSON schema the output follows")
    p.add_argument("--regex", metavar="PATTERN", help="structured output: a regular expression the output matches")
    p.add_argument("--grammar", metavar="FILE", help="structured output: a Lark grammar the output follows")
    p.add_argument("--stats", action="store_true", help="print tau, accept_at, tokens/s and phase times")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.add_argument("--show-drafts", action="store_true",
                   help="colour each token by origin: accepted draft, correction, bonus (plain marks without a tty)")
    p.add_argument("--trace", action="store_true", help="one line per step and sequence on stderr")
    return p.parse_args(argv)


def read_prompts(args) -> list:
    text = read_file("--prompts-file", args.prompts_file) if args.prompts_file else ""
    prompts = list(args.prompt or [])
    for i, line in enumerate(text.split("\n"), 1):  # i: the line number in the file, blank lines included
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--prompts-file: line {i} is not JSON with a 'prompt' field") from None
    if args.prompts_file and not text.strip():  # not the demo in its place
        raise ValueError(f"--prompts-file: {args.prompts_file} holds no prompts")
    return prompts


# origin -> (ANSI colour, plain-text brackets, legend)
ORIGINS = {
    "draft": ("\033[32m", "[]", "accepted draft"),
    "correction": ("\033[31m", "{}", "target's pick after a rejected draft"),
    "bonus": ("\033[34m", "<>", "target's pick after every draft was accepted"),
    "prefill": ("\033[1m", "||", "first token, from the prefill"),
}
RESET = "\033[0m"


def show_drafts(tok, out, colour: bool) -> str:
    """The completion with each run of tokens of one origin coloured (or bracketed without colour); a stop string's
    tokens, past the end of out.text, are left out as the text leaves them."""
    from nano_spec.text.tokenizer import IncrementalDecoder

    decoder, pieces, left = IncrementalDecoder(tok), [], len(out.text)  # a character split across tokens: the last's
    for origin, token in zip(out.origins, out.token_ids):
        pieces.append((origin, decoder.add(token)[:left]))
        left -= len(pieces[-1][1])
    runs = [(o, "".join(t for _, t in run)) for o, run in itertools.groupby(pieces, key=lambda pair: pair[0])]
    return "".join(mark(o, text, colour) for o, text in runs if text)


def legend(colour: bool) -> str:
    return "legend: " + "   ".join(f"{mark(o, o, colour)} {what}" for o, (_, _, what) in ORIGINS.items())


def mark(origin: str, text: str, colour: bool) -> str:
    c, brackets, _ = ORIGINS[origin]
    return f"{c}{text}{RESET}" if colour else f"{brackets[0]}{text}{brackets[1]}"


def tracer(tok):
    def on_step(report):
        times = " ".join(f"{p} {s * 1e3:.2f}" for p, s in report.phase_seconds.items())
        for seq_id, first in report.admitted:
            print(f"step {report.index} seq {seq_id} prefill -> {tok.decode([first])!r} | {times} ms", file=sys.stderr)
        for r in report.rows:
            drafts, emitted = ([tok.decode([t]) for t in ids] for ids in (r.drafts, r.emitted))
            end = f" finished: {r.finish_reason}" if r.finish_reason else ""
            print(f"step {report.index} seq {r.seq_id} drafts {drafts} na {r.na} emitted {emitted}"
                  f"{end} | {times} ms", file=sys.stderr)
    return on_step


def main(argv=None) -> int:
    args = parse_args(argv)  # None: sys.argv[1:], as argparse reads it
    try:
        status = run(args)
        sys.stdout.flush()  # a reader that has gone shows here, not in the flush at exit
        return status
    except ValueError as e:  # every user error is a ValueError with a message naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or streaming: no traceback; 130 as for SIGINT
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (| head): end quietly, as a tool that SIGPIPE ends (128 + 13)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 141


def run(args) -> int:
    from nano_spec.engine.llm import LLM  # after argparse: --help stays instant
    from nano_spec.model.sampling import SamplingParams

    check_threads(args.threads)
    prompts = read_prompts(args)
    run_demo = not (prompts or args.chat or args.json)
    prompts = prompts or [DEMO_CLASS + DEMO_METHODS[0]]  # --chat or --json with no prompt: the demo's first
    if args.system is not None and not args.chat:
        raise ValueError("--system: only with --chat")
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    chats = [system + [{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, logprobs=args.logprobs, regex=args.regex,
                            json_schema=None if args.json_schema is None else read_schema(args.json_schema),
                            grammar=None if args.grammar is None else read_file("--grammar", args.grammar))
    llm = LLM(args.model, backend=args.backend, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
              num_drafts=0 if args.no_spec else args.num_drafts, proposer="none" if args.no_spec else args.proposer,
              max_seq_len=args.max_seq_len, threads=args.threads, compile=args.compile,
              drafter=None if args.no_spec else args.drafter)
    if args.trace:
        llm.on_step = tracer(llm.tokenizer)
    llm.watch_compile(announce)
    t0 = time.perf_counter()
    if run_demo:
        outs = demo(args, llm, params)
    elif len(prompts) == 1 and not (args.json or args.show_drafts):
        # validates the request before anything is printed; a chat prints the reply only
        stream = llm.chat_stream(chats[0], params) if args.chat else llm.stream(prompts[0], params)
        print("" if args.chat else prompts[0], end="", flush=True)
        try:
            for piece in stream:
                print(piece, end="", flush=True)
        finally:
            print(flush=True)  # end the line, also when Ctrl-C cuts the text
        outs = [stream.output]
    else:
        outs = [None] * len(prompts)
        complete, requests = (llm.chat, chats) if args.chat else (llm.generate, prompts)
        try:
            complete(requests, params, on_finish=outs.__setitem__)
        except KeyboardInterrupt:  # what had finished is printed as in a full run
            done = [o for o in outs if o is not None]
            print_outputs(args, llm, done)
            print(f"interrupted: {len(done)} of {len(outs)} requests had finished", file=sys.stderr)
            return 130
        print_outputs(args, llm, outs)
    elapsed = time.perf_counter() - t0
    failed = [(i, o) for i, o in enumerate(outs) if o.finish_reason == "error"]
    for i, o in failed:
        print(f"error: request {i} failed in the engine: {o.error}", file=sys.stderr)
    if args.stats:
        print_stats(llm.stats, [o for o in outs if o.finish_reason != "error"], elapsed)
    return 1 if failed else 0


def announce(what: str, n: int, most: int | None, threads: int):
    """A graph about to be compiled, on stderr."""
    print(f"compiling: {what}, graph {n}{'' if most is None else f' of at most {most}'} at {threads} thread(s) "
          "(once per shape bucket; later runs read inductor's on-disk cache)", file=sys.stderr, flush=True)


def demo(args, llm, params) -> list:
    """Print the class as the model completes it, drafted tokens coloured on a terminal; then what speculation did,
    against plain decoding of the same prompts, timed in turn with it. Returns the Outputs."""
    from dataclasses import replace

    from nano_spec.engine.llm import LLM

    params, colour = replace(params, stop=("\n\n",)), sys.stdout.isatty() and "NO_COLOR" not in os.environ
    spec = llm.config.max_drafts > 0
    plain = LLM(llm.config.path, backend=args.backend, device=args.device, dtype=args.dtype, threads=args.threads,
                proposer="none", max_batch=1, compile=args.compile) if spec else None  # the same mode
    if spec:
        plain.watch_compile(lambda what, *rest: announce(f"plain decoding's {what}", *rest))
    text, outs, same = DEMO_CLASS, [], True
    for method in DEMO_METHODS:
        o = llm.generate(text + method, params)[0]  # a bad request fails here, before anything is printed
        if spec:  # the same prompt plainly, in turn, so both see the machine alike
            same = same and plain.generate(text + method, params)[0].token_ids == o.token_ids
        outs.append(o)
        written = show_drafts(llm.tokenizer, o, colour) if colour or args.show_drafts else o.text
        print(("" if len(outs) > 1 else DEMO_CLASS) + method + written, end="\n\n", flush=True)
        text += method + o.text + "\n\n"
    origins = [x for o in outs for x in o.origins]
    n, drafted, st = len(origins), origins.count("draft"), llm.stats
    if spec:
        decode = [decode_seconds(st), decode_seconds(plain.stats)]
        print(f"speculation: {n} tokens, {len(outs)} from prefills, the rest in {st['verify_steps']} verify steps (tau "
              f"{st['tau']:.2f}); {drafted} were accepted drafts, {n - drafted} the target's picks", file=sys.stderr)
        print(f"plain decoding of the same prompts, in turn with it: {'the same' if same else 'OTHER'} tokens in "
              f"{n - len(outs)} steps; decoding took {decode[0] * 1e3:.0f} ms with speculation, {decode[1] * 1e3:.0f} "
              f"ms plain ({decode[1] / decode[0]:.1f}x)", file=sys.stderr)
    if colour or args.show_drafts:
        print(legend(colour), file=sys.stderr)
    return outs


def decode_seconds(st: dict) -> float:
    """Decoding: every phase but the prompts' forward, less the making of step graphs (docs/DESIGN.md §7, §12).
    A prompt graph is made inside the prefill phase, so it is already out."""
    phases = st["phase_seconds"]
    return sum(phases.values()) - phases["prefill"] - st["compile_seconds_by_call"].get("step", 0.0)


def print_outputs(args, llm, outs: list):
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if args.show_drafts and not args.json:
        print(legend(colour))
    for o in outs:
        if args.json:
            print(json.dumps({k: getattr(o, k) for k in ("prompt", "text", "token_ids", "origins", "finish_reason",
                                                         "error", "tau", "logprobs", "top_logprobs")}))
        else:
            text = show_drafts(llm.tokenizer, o, colour) if args.show_drafts else o.text
            print(f"--- {o.finish_reason} ---\n{o.prompt}{text}")


def print_stats(st: dict, good: list, elapsed: float):
    n_tokens = sum(len(o.token_ids) for o in good)
    seconds = max(elapsed - st["compile_seconds"], 1e-9)  # generation alone: compiling a graph is not decoding
    rate = f"tokens/s {n_tokens / seconds:.1f}  " if n_tokens else "tokens/s -  "  # failed requests do not count
    accept = ", ".join(f"{a:.3f}" if tried else "not tried" for a, tried in zip(st["accept_at"], st["drafted_at"]))
    print(f"{rate}tau {st['tau']:.3f}  accept_at [{accept}]  verify steps {st['verify_steps']}", file=sys.stderr)
    print("  threads " + ", ".join(f"{n} ({steps} steps)" for n, steps in st["threads"].items()), file=sys.stderr)
    if st["compile_seconds"]:
        calls = "".join(f"{label} {s:.1f} s, " for label, s in st["compile_seconds_by_call"].items() if s)
        print(f"  compile {st['compile_seconds']:.1f} s ({calls}first calls of the compiled graphs; not in tokens/s)",
              file=sys.stderr)
    print(f"  max_seq_len {st['max_seq_len']}  weights + caches {st['memory_bytes'] / 2**30:.2f} GiB of a "
          f"{st['memory_budget'] / 2**30:.2f} GiB budget", file=sys.stderr)
    for bucket, b in st["accept_at_by_seq_len"].items():
        print(f"  seq_len {bucket:<9} steps {b['steps']:<6} accept_at {[round(a, 3) for a in b['accept_at']]}",
              file=sys.stderr)
    c = st["constrained"]
    if c["verify_steps"]:
        print(f"  with a grammar: tau {c['tau']:.3f}  accept_at {[round(a, 3) for a in c['accept_at']]}  verify steps "
              f"{c['verify_steps']}  grammar compile {st['grammar_compile_seconds'] * 1e3:.1f} ms", file=sys.stderr)
    for phase, secs in st["phase_seconds"].items():
        print(f"  {phase:<8} {secs * 1e3:9.1f} ms  histogram {st['phase_histogram_ms'][phase]}", file=sys.stderr)
    print(f"  histogram bucket upper edges (ms): {st['phase_histogram_ms']['edges']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
