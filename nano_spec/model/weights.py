"""Checkpoint tensors in and out: config.json + safetensors, never pickle (model.load_model builds the model and
fills it through load_tensors).

A checkpoint directory holds config.json and either model.safetensors or a sharded
model.safetensors.index.json (the layout transformers writes), and optionally
mtp.safetensors: an MTP head trained for a base that had none (scripts/train_mtp.py).
Loading is strict: every tensor the config implies must be there exactly once with
its shape, and nothing else may be. It reads one tensor at a time straight into the
model's parameters, in the target dtype and on the target device, so the peak memory
is the model plus its largest stored tensor (not the checkpoint plus a converted copy).
"""
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # safetensors dtype names
HEAD_FILE = "mtp.safetensors"  # an MTP head stored beside an untouched base


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says which file and which tensors."""


def _shards(path: Path) -> list:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [_inside(path, index, f) for f in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    else:
        found = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(found)}: pickle-based files are never loaded)" if found else ""
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")
    return files + ([path / HEAD_FILE] if (path / HEAD_FILE).is_file() else [])


def _inside(path: Path, index: Path, name: str) -> Path:
    """path/name, the shard an index names, refused unless it lies in path: an index from the hub naming an
    absolute or ../ path would read any file. `..` is folded before the directories are resolved (and the folded
    path is the one opened), so neither a `..` nor a linked directory leads out; the file itself may be a link, as
    every file of a Hugging Face cache snapshot is (to its blob)."""
    shard = Path(os.path.normpath(path / name))
    if not shard.parent.resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"{index}: shard {name!r} lies outside the checkpoint directory {path}")
    return shard


def _use(shard: Path, read):
    """read(the open file), with a missing or unreadable file reported by name."""
    if not shard.is_file():
        raise CheckpointError(f"{shard}: shard listed in the index is missing")
    # One open per use: safetensors maps the file, and the pages a read touches stay resident
    # until the file is closed, which would hold the whole stored checkpoint beside the model.
    try:
        with safe_open(str(shard), framework="pt") as f:
            return read(f)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{shard}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def tensor_index(path) -> dict:
    """name -> (file, stored dtype name, shape) from the headers alone; no tensor data is read.

    A name stored in two files is refused: which copy would win is not something to guess.
    """
    def header(f):
        slices = {n: f.get_slice(n) for n in f.keys()}
        return {n: (s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()}

    index, twice = {}, []
    for shard in _shards(Path(path)):
        for name, (dtype, shape) in _use(shard, header).items():
            if name in index:
                twice.append(f"{name} ({index[name][0].name}, {shard.name})")
            index[name] = (shard, dtype, shape)
    if twice:
        raise CheckpointError(f"{path}: tensors stored more than once: {', '.join(sorted(twice))}")
    return index


def stored_dtype(path) -> torch.dtype:
    """The dtype most of the stored parameters are in (counted by elements), e.g. bf16 for a hub checkpoint."""
    count = {}
    for _, dt, shape in tensor_index(path).values():
        if dt in STORED_DTYPES:
            count[dt] = count.get(dt, 0) + torch.Size(shape).numel()
    return STORED_DTYPES[max(count, key=count.get)] if count else torch.float32


def load_tensors(build, path, device, dtype, skip=()):
    """build() on the meta device, filled (strictly) from the tensors of tensor_index(path) but those in skip."""
    stored = {n: t for n, t in tensor_index(path).items() if n not in skip}
    with torch.device("meta"):
        module = build()
    expected = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    problems = {
        "missing": set(expected) - set(stored),
        "unexpected": set(stored) - set(expected),
        "wrong shape": {f"{n} {s} (expected {expected[n]})" for n, (_, _, s) in stored.items()
                        if n in expected and s != expected[n]},
        "not a float dtype": {n for n, (_, dt, _) in stored.items()
                              if n in expected and dt not in STORED_DTYPES},
    }
    if any(problems.values()):
        raise CheckpointError(f"{path}: tensors do not match config.json; " + "; ".join(
            f"{label}: {', '.join(sorted(names))}" for label, names in problems.items() if names))
    module = module.to(dtype).to_empty(device=device)  # uninitialised: every parameter is written below
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, (shard, _, _) in stored.items():
            params[name].copy_(_use(shard, lambda f: f.get_tensor(name)))  # dtype and device in one
    return module.eval()


@torch.no_grad()
def init_weights(model, std: float = 0.02, seed: int | None = None):
    """Random weights for a model trained from scratch (a HybridLM or a drafter), in place: normal linears and
    embeddings, unit norms, Mamba2's A, D and dt initialisation. Returns the model."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or leaf == "D":
            p.fill_(1.0)
        elif leaf == "A_log":
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=g)))
        elif leaf == "dt_bias":  # dt ~ log-uniform(1e-3, 1e-1), stored as softplus^-1(dt)
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif leaf == "bias":
            p.zero_()
        elif "conv1d" in name:
            p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=g) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(torch.empty(p.shape).normal_(0, std, generator=g))
    return model


def write_model(model, directory):
    """Write config.json (model.cfg.to_dict()) + model.safetensors into an existing directory: a HybridLM, or a
    drafter (nano_spec/model/dflash.py). save_model and the training scripts swap it in with replace_dir."""
    directory = Path(directory)
    (directory / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def replace_dir(out: Path, fill):
    """out <- the directory fill(tmp) writes, so that an interruption at any point leaves the old output or the new
    one, never neither: the new one is written beside out (the same file system, so each move is one rename), the
    old one moved aside, the new one moved in, then the old one deleted.

    What an interrupted earlier call left beside out: half-written temporaries are deleted; the aside copy is a
    stale one when out exists (killed while deleting it), else the old output itself (killed between the two
    moves), which stays until the new one is in place and goes back to out when this call fails too."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    aside, prefix = out.parent / f".{out.name}.old", f".{out.name}.new-"
    for p in out.parent.iterdir():
        if p.name.startswith(prefix):
            shutil.rmtree(p)
    if aside.exists() and out.exists():
        shutil.rmtree(aside)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            os.replace(out, aside)
        os.replace(tmp, out)
    except BaseException:
        if aside.exists() and not out.exists():
            os.replace(aside, out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside.exists():
        shutil.rmtree(aside)


def save_model(model, path, extra_files: dict | None = None):
    """write_model (+ extra files, name -> source path) into path, swapped in whole (replace_dir)."""
    def fill(tmp: Path):
        write_model(model, tmp)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
    replace_dir(path, fill)
