"""What a smaller draft vocabulary costs the MTP head in accepted drafts (eager engine, greedy, batch 1).

    python scripts/draft_vocab.py [--model DIR] [--sizes 512 1024 2048] [--gamma 3] [--prompts 16] [--tokens 64]

A draft head over the N most frequent tokens only reads N/V of the output layer per draft; the verify keeps the
whole vocabulary, so the output is unchanged and only the drafts can lose. Here the head's logits outside the N
tokens are set to -inf (what such a head drafts), the N ranked by their count in the checkpoint's distillation
prompts (`distill_prompts.safetensors`, its "train" rows: corpus text, not the benchmark's). For each N, on the
eval prompts: the share of emitted tokens inside the N, tau and accept_at; every run's tokens must equal the
full vocabulary's, or the script fails.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import Parser, integer  # noqa: E402

from nano_spec import LLM, SamplingParams  # noqa: E402
from nano_spec.engine.settings import shipped_weights  # noqa: E402


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory with an MTP head (default: the shipped one)")
    ap.add_argument("--sizes", type=integer(1), nargs="+", default=[512, 1024, 2048], help="draft vocabulary sizes")
    ap.add_argument("--gamma", type=integer(1), default=3, help="drafts per step")
    ap.add_argument("--prompts", type=integer(1), default=16, help="eval prompts used")
    ap.add_argument("--tokens", type=integer(1), default=64, help="new tokens per prompt")
    args = ap.parse_args(argv)
    model = args.model or shipped_weights()
    counts_file, prompts_file = model / "distill_prompts.safetensors", model / "eval_prompts.jsonl"
    for path, role in ((counts_file, "its token counts rank the vocabulary"), (prompts_file, "the prompts")):
        if not path.is_file():
            ap.error(f"--model: {path} not found ({role})")
    try:
        llm = LLM(str(model), proposer="mtp", num_drafts=args.gamma, max_batch=1, threads=1)
    except ValueError as e:  # no checkpoint there, or one without an MTP head
        ap.error(f"--model: {e}")
    V = llm.config.cfg.vocab_size
    if max(args.sizes) > V:
        ap.error(f"--sizes: at most the vocabulary size, {V}")
    ranked = torch.bincount(load_file(counts_file)["train"].long().flatten(), minlength=V).argsort(descending=True)
    lines = prompts_file.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.prompts]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    full_logits = llm.model.mtp_logits
    reference = None
    for n in sorted({V, *args.sizes}, reverse=True):  # the whole vocabulary first: the reference
        inside = torch.zeros(V, dtype=torch.bool)
        inside[ranked[:n]] = True
        # the instance's head only: the verify's logits keep the whole vocabulary
        llm.model.mtp_logits = lambda o, head=None, inside=inside: \
            full_logits(o, head).masked_fill(~inside, float("-inf"))
        llm.telemetry.reset()
        outputs = llm.generate(prompts, params)
        failed = [o.error for o in outputs if o.finish_reason == "error"]
        if failed:
            print(f"draft vocabulary {n}: a request failed: {failed[0]}", file=sys.stderr)
            return 1
        tokens = [o.token_ids for o in outputs]
        if reference is None:
            reference = tokens
        elif tokens != reference:
            print(f"draft vocabulary {n}: the output changed; a draft head must not change it", file=sys.stderr)
            return 1
        emitted = torch.tensor([t for row in tokens for t in row])
        st = llm.stats
        print(f"N={n:<6} ({n / V:6.1%} of V)  emitted inside {inside[emitted].float().mean().item():6.1%}  "
              f"tau {st['tau']:.3f}  accept_at {[round(a, 3) for a in st['accept_at']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
