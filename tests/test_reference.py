"""The reference loop (nano_spec/reference.py) as the oracle of the engine.

The reference re-runs the no-cache forward every step; the engine batches, caches,
stashes and commits. Both must emit the same tokens with the same origins: greedy
for every drafter and γ, and seeded sampling (same seed, same draw order).
"""
import pytest

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.reference import filtered, speculative_generate

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "x = 1\ny = 2\n" * 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ref") / "tiny", seed=3)


def engine_vs_reference(ckpt, drafter, gamma, params, max_batch=3):
    llm = LLM(ckpt, proposer=drafter if gamma else "none", num_drafts=gamma, max_batch=max_batch)
    outs = llm.generate(PROMPTS, params)
    for prompt, o in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        want = speculative_generate(llm.model, ids, params.max_new_tokens, gamma, drafter, params.temperature,
                                    params.top_k, params.top_p, params.seed or 0,
                                    () if params.ignore_eos else llm.tokenizer.eos_ids)
        assert (o.token_ids, o.origins) == want, f"prompt {prompt!r}"
    return outs


@pytest.mark.parametrize("drafter, gamma", [("mtp", 0), ("mtp", 1), ("mtp", 3), ("ngram", 2), ("ngram", 4)],
                         ids=lambda v: str(v))
def test_engine_equals_reference_greedy(ckpt, drafter, gamma):
    engine_vs_reference(ckpt, drafter, gamma, SamplingParams(max_new_tokens=20, ignore_eos=True))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_engine_equals_reference_on_shipped_weights(temperature):
    """The trained MTP head drafts well, so every origin occurs: accepted drafts, corrections, bonuses."""
    llm = LLM(proposer="mtp", num_drafts=3, max_batch=2)
    prompts = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n"]
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    for prompt, o in zip(prompts, llm.generate(prompts, params)):
        want = speculative_generate(llm.model, llm.tokenizer.encode(prompt), 24, 3, "mtp", temperature, seed=5)
        assert (o.token_ids, o.origins) == want
    origins = [x for o in llm.generate(prompts, params) for x in o.origins]
    assert {"prefill", "draft", "correction", "bonus"} <= set(origins)


@pytest.mark.parametrize("drafter, gamma", [("mtp", 3), ("ngram", 3), ("mtp", 0)], ids=lambda v: str(v))
@pytest.mark.parametrize("seed", [1, 2])
def test_engine_equals_reference_seeded_sampling(ckpt, drafter, gamma, seed):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=seed, ignore_eos=True)
    engine_vs_reference(ckpt, drafter, gamma, params, max_batch=2)


def test_reference_stops_where_the_engine_stops(ckpt):
    """EOS inside an accepted run: both stop at the first finishing token."""
    llm = LLM(ckpt, proposer="none")
    full = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
    stop = full[5]
    ids = llm.tokenizer.encode(PROMPTS[1])
    out, origins = speculative_generate(llm.model, ids, 20, 3, "mtp", eos_ids=(stop,))
    assert out == full[: full.index(stop) + 1] and len(origins) == len(out)


def test_filtered_distribution():
    import torch

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = filtered(logits, 1.0, 0, 1.0)
    assert torch.allclose(p, torch.softmax(logits, -1))
    p = filtered(logits, 1.0, 2, 1.0)
    assert (p[2:] == 0).all() and torch.allclose(p[:2], torch.softmax(logits[:2], -1))
    p = filtered(logits, 0.5, 0, 0.5)  # the top token alone holds more than half the mass at T = 0.5
    assert p[0] == 1 and p[1:].sum() == 0
