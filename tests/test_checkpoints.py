"""Config validation and strict checkpoint loading: every bad input gives one clear error."""
import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from helpers import assert_unchanged, tiny_config, tiny_model
from nano_spec.config import ConfigError, ModelConfig
from nano_spec.weights import CheckpointError, load_model, save_model


@pytest.fixture
def ckpt(tmp_path):
    model = tiny_model(seed=1)
    save_model(model, tmp_path / "ck")
    return model, tmp_path / "ck"


def test_roundtrip_all_dtypes(ckpt, tmp_path):
    model, path = ckpt
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        loaded = load_model(path, dtype=dtype)
        for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert b.dtype == dtype
            assert_unchanged(n, a.to(dtype), b)


def test_sharded_bf16_checkpoint(ckpt, tmp_path):
    model, path = ckpt
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}
    names = sorted(state)
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for f, ns in shards.items():
        save_file({n: state[n] for n in ns}, str(out / f))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    loaded = load_model(out)
    ids = torch.randint(0, 67, (1, 8))
    ref = load_model(path, dtype=torch.bfloat16).float()
    with torch.no_grad():
        assert torch.equal(ref(ids), loaded(ids))


def rewrite(path, drop=(), add=None, reshape=None):
    from nano_spec.weights import read_tensors

    t = read_tensors(path)
    for n in drop:
        t.pop(n)
    t.update(add or {})
    for n, shape in (reshape or {}).items():
        t[n] = torch.zeros(shape)
    save_file(t, str(path / "model.safetensors"))


@pytest.mark.parametrize("change, message", [
    (dict(drop=["model.norm.weight", "mtp.eh_proj.weight"]), "missing: model.norm.weight, mtp.eh_proj.weight"),
    (dict(add={"model.layers.0.extra": torch.zeros(2)}), "unexpected: model.layers.0.extra"),
    (dict(reshape={"model.layers.1.self_attn.q_proj.weight": (3, 3)}), "wrong shape: model.layers.1.self_attn"),
], ids=["missing", "unexpected", "wrong-shape"])
def test_mismatched_tensors_are_listed(ckpt, change, message):
    _, path = ckpt
    rewrite(path, **change)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_model(path)


def test_truncated_and_garbage_files(ckpt):
    _, path = ckpt
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(path)
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_model(path)


def test_pickle_file_is_never_loaded(ckpt, tmp_path):
    _, path = ckpt
    (path / "model.safetensors").unlink()

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle executed')",))

    (path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match="pickle-based files are never loaded"):
        load_model(path)
    # a pickle renamed to .safetensors is refused by the safetensors parser, not executed
    (path / "model.safetensors").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_model(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_model(tmp_path / "nope")


BASE = tiny_config().to_dict()
BAD_CONFIGS = {
    "unknown-layer": ({"layer_types": ["mamba", "conv"]}, r"layer_types\[1\]: unknown layer type 'conv'"),
    "heads-not-dividing": ({"num_attention_heads": 5}, "num_attention_heads: 5 does not divide"),
    "kv-heads": ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
    "moe": ({"num_local_experts": 8}, "num_local_experts: 8 experts"),
    "missing-field": ({"vocab_size": None}, "missing field.*vocab_size"),
    "absurd-size": ({"hidden_size": 10**9}, r"hidden_size: 1000000000 is not an integer in \[0, 65536\]"),
    "negative": ({"mamba_d_state": -1}, "mamba_d_state: -1"),
    "mamba-head-dim": ({"mamba_d_head": 7}, "mamba_d_head: 4 heads x 7"),
    "groups": ({"mamba_n_groups": 3}, "mamba_n_groups: 3 does not divide"),
    "layer-count": ({"num_hidden_layers": 9}, "num_hidden_layers: 9 but layer_types lists 4"),
    "mtp-layers": ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers: 2"),
    "not-a-number": ({"residual_multiplier": "big"}, "residual_multiplier: 'big' is not a finite number"),
}


@pytest.mark.parametrize("change, message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_names_the_field(change, message):
    d = dict(BASE)
    for k, v in change.items():
        d.pop(k) if v is None else d.__setitem__(k, v)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_config_forms_transformers_writes():
    d = dict(BASE, layer_types=["linear_attention", "full_attention"], mamba_d_head="auto", num_hidden_layers=2,
             time_step_limit=[0.0, {"__float__": "Infinity"}])
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_types == ["mamba", "attention"]
    assert cfg.mamba_d_head == cfg.mamba_expand * cfg.hidden_size // cfg.mamba_n_heads
    assert cfg.time_step_limit == (0.0, float("inf"))
    legacy = ModelConfig.from_dict(dict(BASE, layer_types=None, layers_block_type=["mamba", "attention"],
                                        num_hidden_layers=2))
    assert legacy.layer_types == ["mamba", "attention"]


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
