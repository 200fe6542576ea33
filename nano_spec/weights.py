"""Checkpoint loading and saving: config.json + safetensors, never pickle.

A checkpoint directory holds config.json and either model.safetensors or a
sharded model.safetensors.index.json (the layout transformers writes). Loading
is strict: every tensor the config implies must be there with its shape, and
nothing else may be.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nano_spec.config import ModelConfig
from nano_spec.model import HybridLM
from nano_spec.ops import Ops

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says which file and which tensors."""


def _shards(path: Path) -> list:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return [path / f for f in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    found = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {', '.join(found)}: pickle-based files are never loaded)" if found else ""
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")


def read_tensors(path) -> dict:
    """All tensors of a checkpoint directory, by name, as stored."""
    tensors = {}
    for shard in _shards(Path(path)):
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard listed in the index is missing")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{shard}: not a readable safetensors file (truncated or corrupt?): {e}") from None
    return tensors


def load_model(path, device="cpu", dtype=torch.float32, backend: str = "torch") -> HybridLM:
    """Build the model of path/config.json and fill it from its safetensors, converted to dtype on device."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of {FLOAT_DTYPES}")
    cfg = ModelConfig.from_file(path / "config.json")
    tensors = read_tensors(path)
    with torch.device("meta"):
        model = HybridLM(cfg, Ops(backend))
    expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some writers store the tied head too; it is the embedding
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(f"{n} {tuple(tensors[n].shape)} (expected {expected[n]})"
                   for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
    bad_dtype = sorted(n for n, t in tensors.items() if n in expected and t.dtype not in FLOAT_DTYPES)
    if missing or unexpected or wrong or bad_dtype:
        parts = [f"{label}: {', '.join(names)}" for label, names in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                  ("not a float dtype", bad_dtype)) if names]
        raise CheckpointError(f"{path}: tensors do not match config.json; " + "; ".join(parts))
    model = model.to_empty(device=device)
    model.load_state_dict({n: t.to(dtype) for n, t in tensors.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def save_model(model: HybridLM, path, extra_files: dict | None = None):
    """Write config.json + model.safetensors (+ extra files, name -> source path) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
        state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
