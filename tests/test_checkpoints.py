"""Config validation and strict checkpoint loading: every bad input gives one clear error."""
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_unchanged, tiny_config, tiny_model
from nano_spec.model.config import ConfigError, ModelConfig
from nano_spec.model.weights import CheckpointError, save_model
from nano_spec.model.model import load_model


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


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def write_sharded(path, out, index_names=None):
    """The checkpoint at path as two bf16 shards in out with a model.safetensors.index.json, as transformers
    writes it; index_names maps a shard to the path the index names instead (written there, relative to out)."""
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in read_tensors(path).items()}
    names = sorted(state)
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    weight_map = {}
    for f, ns in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2 :])):
        where = (index_names or {}).get(f, f)
        (out / where).parent.mkdir(parents=True, exist_ok=True)  # an absolute where is itself
        save_file({n: state[n] for n in ns}, str(out / where))
        weight_map.update({n: where for n in ns})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def assert_loads_as_bf16(path, out):
    loaded = load_model(out)
    ids = torch.randint(0, 67, (1, 8))
    ref = load_model(path, dtype=torch.bfloat16).float()
    with torch.no_grad():
        assert torch.equal(ref(ids), loaded(ids))


def test_sharded_bf16_checkpoint(ckpt, tmp_path):
    _, path = ckpt
    assert_loads_as_bf16(path, write_sharded(path, tmp_path / "sharded"))


def test_sharded_checkpoint_of_linked_shards_loads(ckpt, tmp_path):
    """The Hugging Face cache's layout: each shard in the snapshot directory a link to a blob outside it. The
    index names plain file names, so the links' targets do not count as leaving the directory."""
    _, path = ckpt
    out = write_sharded(path, tmp_path / "snapshot")
    (tmp_path / "blobs").mkdir()
    for f in SHARDS:
        (out / f).rename(tmp_path / "blobs" / f)
        (out / f).symlink_to(Path("..") / "blobs" / f)
    assert_loads_as_bf16(path, out)


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_shard_paths_leaving_the_checkpoint_are_refused(ckpt, tmp_path, where):
    """An index naming a shard outside its directory is refused, though the file is there and readable: an index
    from the hub could otherwise read any safetensors file on the machine."""
    _, path = ckpt
    outside = tmp_path / "elsewhere" / SHARDS[1]
    name = str(outside) if where == "absolute" else f"../elsewhere/{SHARDS[1]}"
    out = write_sharded(path, tmp_path / "sharded", {SHARDS[1]: name})
    assert outside.is_file()
    with pytest.raises(CheckpointError) as e:
        load_model(out)
    assert str(e.value).startswith(f"{out / 'model.safetensors.index.json'}: shard {name!r} ")
    assert "outside" in str(e.value) and "\n" not in str(e.value), str(e.value)


def read_tensors(path) -> dict:
    """Every tensor of an unsharded checkpoint (model.safetensors, and mtp.safetensors if there)."""
    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def rewrite(path, drop=(), add=None, reshape=None):
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


def test_saved_config_is_in_the_published_spelling_and_both_spellings_read_alike(ckpt):
    model, path = ckpt
    saved = json.loads((path / "config.json").read_text())
    assert saved["layer_types"] == ["mamba", "attention", "mamba", "mamba"]
    assert saved["intermediate_size"] == saved["shared_intermediate_size"] == 40
    assert saved["position_embedding_type"] == "nope"
    transformers_spelling = dict(saved, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                     "linear_attention"], position_embedding_type=None)
    del transformers_spelling["intermediate_size"]
    assert ModelConfig.from_dict(transformers_spelling) == ModelConfig.from_dict(saved) == model.cfg


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")


def split_head(path):
    """Move the mtp.* tensors of a checkpoint into mtp.safetensors, as scripts/train_mtp.py stores a head."""
    t = read_tensors(path)
    save_file({n: v for n, v in t.items() if not n.startswith("mtp.")}, str(path / "model.safetensors"))
    save_file({n: v for n, v in t.items() if n.startswith("mtp.")}, str(path / "mtp.safetensors"))
    return t


def test_base_and_head_files_load_together(ckpt):
    model, path = ckpt
    split_head(path)
    loaded = load_model(path)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert_unchanged(n, a, b)


def test_a_tensor_in_two_files_is_refused(ckpt):
    _, path = ckpt
    t = split_head(path)
    save_file({n: v for n, v in t.items() if not n.startswith("mtp.") or n == "mtp.eh_proj.weight"},
              str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"stored more than once: mtp\.eh_proj\.weight \(model\.safetensors, "
                                              r"mtp\.safetensors\)"):
        load_model(path)


def test_head_file_without_head_in_config_is_refused(ckpt):
    _, path = ckpt
    split_head(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(CheckpointError, match=r"unexpected: mtp\."):
        load_model(path)


LOAD_PEAK = """
import sys, torch
from nano_spec.model.config import ModelConfig
from nano_spec.engine.capacity import weight_bytes
from nano_spec.model.model import load_model
# LLM counts the weights on the meta device before loading; that also pays one-off library costs
# (the kernel modules, torch's first Conv1d), which are code, not loading
weight_bytes(ModelConfig.from_file(sys.argv[1] + "/config.json"), torch.float32)
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith(key))
open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) restarts from the current RSS
before = status('VmRSS:')
model = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
print(status('VmHWM:') - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_loading_peak_memory_is_near_the_model_size(tmp_path):
    """A bf16 checkpoint loaded as fp32: the resident peak grows by at most 1.3x the loaded model, so neither
    all stored tensors nor a converted copy of them are held beside it."""
    import subprocess
    import sys

    model = tiny_model(hidden_size=512, shared_intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                       mamba_n_heads=16, mamba_n_groups=1, mamba_d_state=64, mamba_expand=2, vocab_size=512,
                       layer_types=["mamba", "attention", "mamba", "mamba", "attention", "mamba"])
    save_model(model.to(torch.bfloat16), tmp_path / "ck")  # ~28M params: 56 MB stored, 112 MB loaded
    r = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(tmp_path / "ck"), "float32"], capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    peak, size = map(int, r.stdout.split())
    assert peak <= 1.3 * size, f"loading peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB model"
