"""python -m nano_spec.generate: complete prompts with speculative decoding.

With no arguments it loads the weights shipped in weights/ and streams the
completion of a default prompt. User errors print one line and exit with status 2.
"""
import argparse
import json
import sys
import time

DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        self.'


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m nano_spec.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the weights shipped in weights/)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="prompts, one per line, or JSONL with a 'prompt' field")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-drafts", type=int, default=3, help="γ, drafts per step")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (γ = 0)")
    p.add_argument("--proposer", choices=["auto", "mtp", "ngram", "none"], default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq-len", type=int)
    p.add_argument("--logprobs", type=int, default=0, help="report each token's logprob and the top-N")
    p.add_argument("--stats", action="store_true", help="print tau, accept_at, tokens/s and phase times")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    return p.parse_args(argv)


def read_prompts(args) -> list:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--prompts-file: cannot read {args.prompts_file} ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"--prompts-file: {args.prompts_file} is not UTF-8 text") from None
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("{"):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"--prompts-file: line {i} is not JSON with a 'prompt' field") from None
            else:
                prompts.append(line)
    return prompts or [DEFAULT_PROMPT]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from nano_spec import LLM, SamplingParams  # after argparse: --help stays instant

    try:
        prompts = read_prompts(args)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, logprobs=args.logprobs)
        llm = LLM(args.model, backend=args.backend, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                  num_drafts=0 if args.no_spec else args.num_drafts, proposer="none" if args.no_spec else args.proposer,
                  max_seq_len=args.max_seq_len)
        t0 = time.perf_counter()
        if len(prompts) == 1 and not args.json:
            print(prompts[0], end="", flush=True)
            for piece in llm.stream(prompts[0], params):
                print(piece, end="", flush=True)
            print()
            n_tokens = llm.stats["emitted"] + 1  # verify-emitted tokens plus the prefill's one
        else:
            outs = llm.generate(prompts, params)
            n_tokens = sum(len(o.token_ids) for o in outs)
            for o in outs:
                if args.json:
                    print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                                      "finish_reason": o.finish_reason, "tau": o.tau, "logprobs": o.logprobs,
                                      "top_logprobs": o.top_logprobs}))
                else:
                    print(f"--- {o.finish_reason} ---\n{o.prompt}{o.text}")
        elapsed = time.perf_counter() - t0
    except ValueError as e:  # every user error is a ValueError with a message naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stats:
        st = llm.stats
        print(f"tokens/s {n_tokens / elapsed:.1f}  tau {st['tau']:.3f}  accept_at "
              f"{[round(a, 3) for a in st['accept_at']]}  verify steps {st['verify_steps']}", file=sys.stderr)
        for bucket, b in st["accept_at_by_seq_len"].items():
            print(f"  seq_len {bucket:<9} steps {b['steps']:<6} accept_at {[round(a, 3) for a in b['accept_at']]}",
                  file=sys.stderr)
        for phase, secs in st["phase_seconds"].items():
            print(f"  {phase:<8} {secs * 1e3:9.1f} ms  histogram {st['phase_histogram_ms'][phase]}", file=sys.stderr)
        print(f"  histogram bucket upper edges (ms): {st['phase_histogram_ms']['edges']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
