"""The hybrid loop (nano_spec/reference_hybrid.py): caches, per-row stash and commit for one sequence, held token for
token, origins included, to the engine and to the cache-free reference loop."""
import pytest

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.reference import speculative_generate
from nano_spec.reference_hybrid import hybrid_generate

PROMPTS = ["def f(x):", "h", "for i in range(10):\n    print(i)\n" * 2]


@pytest.fixture(scope="module", params=["nope", "rope"])
def ckpt(tmp_path_factory, request):
    """Random weights (drafts are mostly rejected, so the commit restores row 0 or 1), NoPE and RoPE."""
    return tiny_checkpoint(tmp_path_factory.mktemp("hybrid") / "tiny", seed=5, position_embedding_type=request.param)


def three_ways(llm, prompts, gamma, n, eos_ids=()):
    for prompt in prompts:
        ids = llm.tokenizer.encode(prompt)
        got = hybrid_generate(llm.model, ids, n, gamma, eos_ids)
        assert got == speculative_generate(llm.model, ids, n, gamma, "mtp", eos_ids=eos_ids), f"prompt {prompt!r}"
        o = llm.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=eos_ids))[0]
        assert got == (o.token_ids, o.origins), f"prompt {prompt!r}"
    return got


@pytest.mark.parametrize("gamma", [0, 1, 3])
def test_hybrid_loop_equals_engine_and_reference(ckpt, gamma):
    three_ways(LLM(ckpt, proposer="mtp" if gamma else "none", num_drafts=gamma), PROMPTS, gamma, 16)


def test_hybrid_loop_on_shipped_weights_takes_every_origin():
    """The trained head drafts well: accepted runs, bonuses and corrections all pass through the commit."""
    llm = LLM(proposer="mtp", num_drafts=3)
    prompts = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n"]
    origins = [x for p in prompts for x in three_ways(llm, [p], 3, 32)[1]]
    assert {"prefill", "draft", "correction", "bonus"} <= set(origins)


def test_hybrid_loop_stops_at_eos_inside_an_accepted_run():
    llm = LLM(proposer="mtp", num_drafts=3)
    ids = llm.tokenizer.encode(PROMPTS[0])
    full, origins = hybrid_generate(llm.model, ids, 32, 3)
    stop = full[origins.index("draft", 1)]  # a token emitted as an accepted draft
    out, _ = three_ways(llm, [PROMPTS[0]], 3, 32, eos_ids=(stop,))
    assert out == full[: full.index(stop) + 1]
