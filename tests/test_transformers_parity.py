"""Parity with transformers' GraniteMoeHybridForCausalLM: the independent oracle for the model math.

A tiny random model is built and saved by transformers, loaded by nano_spec's
load_model, and both give the same logits. Our own save loads back in transformers.
"""
import json

import pytest
import torch

from helpers import assert_close
from nano_spec.model.weights import save_model
from nano_spec.model.model import load_model

transformers = pytest.importorskip("transformers")

CASES = {
    "nope-g1-tied": dict(position_embedding_type=None, mamba_n_groups=1, tie_word_embeddings=True),
    "nope-g2-untied": dict(position_embedding_type=None, mamba_n_groups=2, tie_word_embeddings=False),
    "rope-g2-tied": dict(position_embedding_type="rope", mamba_n_groups=2, tie_word_embeddings=True),
    "rope-g1-untied-bias-gqa1": dict(position_embedding_type="rope", mamba_n_groups=1, tie_word_embeddings=False,
                                     attention_bias=True, mamba_proj_bias=True, num_key_value_heads=1),
    "dt-limit": dict(position_embedding_type=None, mamba_n_groups=2, time_step_limit=(0.05, 0.4)),
}


def hf_model(**kw):
    cfg = dict(vocab_size=61, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
               shared_intermediate_size=40, num_hidden_layers=5,
               layer_types=["mamba", "attention", "mamba", "attention", "mamba"],
               mamba_n_heads=4, mamba_d_state=12, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
               embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5,
               num_local_experts=0, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg.update(kw)
    if cfg.get("layer_types"):
        cfg["layer_types"] = ["linear_attention" if t == "mamba" else "full_attention" for t in cfg["layer_types"]]
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**cfg)).eval()
    with torch.no_grad():  # make every weight matter: no unit norms, no zero biases
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p)) if ("norm" in name or "bias" in name or name.endswith(".D")) else None
    return model


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_logits_match_transformers(case, tmp_path):
    hf = hf_model(**case)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, 61, (2, 19))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    err = assert_close("logits vs transformers", ref, out, atol=1e-4)
    print(f"max abs logits error vs transformers: {err:.2e}")


def test_our_save_loads_in_transformers(tmp_path):
    from helpers import tiny_model

    ours = tiny_model(num_nextn_predict_layers=0, position_embedding_type="rope", rope_theta=300.0,
                      time_step_limit=(0.0, float("inf")))
    save_model(ours, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["time_step_limit"][1] == {"__float__": "Infinity"}
    hf = transformers.GraniteMoeHybridForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 67, (1, 13))
    with torch.no_grad():
        assert_close("transformers on nano_spec weights", ours(ids), hf(ids).logits, atol=1e-4)


def test_shipped_weights_load_in_transformers():
    from nano_spec.engine.settings import shipped_weights

    ckpt = shipped_weights()
    hf = transformers.GraniteMoeHybridForCausalLM.from_pretrained(ckpt).eval()  # mtp.* are ignored there
    ours = load_model(ckpt)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 40))
    with torch.no_grad():
        assert_close("shipped weights in transformers", ours(ids), hf(ids).logits, atol=1e-4)
