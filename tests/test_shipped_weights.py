"""The checkpoint shipped in weights/: it loads, its config validates, and speculative greedy output
equals plain greedy output on held-out prompts, for the MTP head at every γ and for n-grams."""
import json

import pytest

from nano_spec import LLM, SamplingParams
from nano_spec.model.config import ModelConfig
from nano_spec.engine.settings import shipped_weights
from nano_spec.model.model import load_model


@pytest.fixture(scope="module")
def ckpt():
    return shipped_weights()


@pytest.fixture(scope="module")
def prompts(ckpt):
    lines = (ckpt / "eval_prompts.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines[:3]]


def test_shipped_checkpoint_loads(ckpt):
    cfg = ModelConfig.from_file(ckpt / "config.json")
    assert cfg.has_mtp and cfg.mamba_layers and cfg.attention_layers
    model = load_model(ckpt)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    assert sum(f.stat().st_size for f in ckpt.iterdir()) < 40 * 2**20


@pytest.fixture(scope="module")
def plain(ckpt, prompts):
    return [o.token_ids for o in LLM(ckpt, proposer="none", max_batch=3).generate(prompts, PARAMS)]


PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("proposer, gamma", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4), ("ngram", 3),
                                             ("dflash", 1), ("dflash", 3)], ids=lambda v: str(v))
def test_shipped_weights_lossless(ckpt, prompts, plain, proposer, gamma):
    llm = LLM(ckpt, proposer=proposer, num_drafts=gamma, max_batch=2)  # 3 prompts, 2 slots: one is reused
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == plain
    if proposer in ("mtp", "dflash"):
        assert llm.stats["tau"] > 1.2, "the trained head (or drafter) drafts tokens the model accepts"
