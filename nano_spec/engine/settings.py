"""The engine's settings: LLM(...)'s arguments, each checked once and resolved into one frozen EngineConfig before a
weight is read or a cache allocated. Every refusal is a ValueError naming the argument (docs/ERRORS.md).

Three names for draft counts, one meaning each: `num_drafts` is the argument (an integer, or "auto"), `max_drafts`
is γ_max (the most drafts any step verifies; the caches are sized for it), and γ is one step's.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nano_spec.engine.threads import MAX_THREADS
from nano_spec.model import hub
from nano_spec.model.config import ModelConfig, is_int
from nano_spec.model.dflash import DFlashConfig
from nano_spec.model.ops import resolve_backend
from nano_spec.model.weights import stored_dtype

WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "weights"  # nano_spec/engine/ -> the repository
DRAFTER_DIR = "dflash"  # a checkpoint's DFlash drafter, when it ships one
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
AUTO_MAX_DRAFTS = 4  # max_drafts under num_drafts="auto"; each extra draft also costs stash memory per slot
DRAFTERS = ("auto", "mtp", "dflash", "ngram", "none")
METHODS = ("admit", "draft", "catch_up")  # an outside drafter's (nano_spec/drafters/base.py)


@dataclass(frozen=True)
class EngineConfig:
    path: Path                    # the checkpoint directory
    cfg: ModelConfig              # its config.json
    device: torch.device
    dtype: torch.dtype
    backend: str                  # "torch" or "triton"
    compile: bool                 # the step as one graph per bucket (docs/DESIGN.md §12)
    max_batch: int                # slots
    drafter: object               # "none", "ngram", "mtp", "dflash", or an outside drafter object
    max_drafts: int               # γ_max (0: plain decoding)
    auto: bool                    # γ chosen per step by the planner (num_drafts="auto")
    dflash: DFlashConfig | None   # the block drafter's config, when drafter is "dflash"
    drafter_dir: Path | None      # and its directory
    threads: int | None           # torch's intra-op threads; None: chosen by the engine (threads.py)
    memory_budget: int            # bytes the weights, caches and drafter state may take
    max_seq_len: int | None       # None until capacity.fit: the largest that fits

    @classmethod
    def resolve(cls, model=None, backend="auto", device="auto", dtype=None, max_batch=8, num_drafts="auto",
                proposer="auto", max_seq_len=None, memory_budget=None, threads=None, compile=False,
                drafter=None) -> "EngineConfig":
        """LLM's arguments (see LLM) -> the settings; the memory fit is capacity.fit's."""
        device, dtype = resolve_device(device), DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype is not None and dtype not in DTYPES.values():
            raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)} or their torch dtypes")
        for name, value, ok, what in (
                ("max_batch", max_batch, is_int(max_batch, 1, 1024), "an integer in [1, 1024]"),
                ("memory_budget", memory_budget, memory_budget is None or is_int(memory_budget, 1),
                 "a positive integer (bytes) or None"),
                ("threads", threads, threads is None or is_int(threads, 1, MAX_THREADS),
                 f"None or an integer in [1, {MAX_THREADS}]"),
                ("compile", compile, compile in (True, False), "True or False"),
                ("max_seq_len", max_seq_len, max_seq_len is None or is_int(max_seq_len, 2), "an integer >= 2")):
            if not ok:
                raise ValueError(f"{name}: {value!r} must be {what}")
        backend = resolve_compile_backend(backend, device, compile)
        path = checkpoint(model)
        cfg = ModelConfig.from_file(path / "config.json")
        kind, max_drafts, dflash, drafter_dir = resolve_drafter(proposer, num_drafts, drafter, path, cfg)
        if dtype is None:  # CUDA: the stored dtype (bf16 for hub checkpoints); CPU: fp32, see README
            dtype = stored_dtype(path) if device.type == "cuda" else torch.float32
        budget = int(0.9 * available_bytes(device)) if memory_budget is None else memory_budget
        return cls(path, cfg, device, dtype, backend, compile, max_batch, kind, max_drafts,
                   num_drafts == "auto" and max_drafts > 0, dflash, drafter_dir, threads, budget, max_seq_len)


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts the page cache the kernel can reclaim, which free pages alone leave out
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_device(device) -> torch.device:
    """"auto", "cpu", "cuda" or "cuda:i" -> a device that can hold the weights."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: {device!r} is not a torch device") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {str(device)!r} cannot hold the weights; use 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device: {device} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return device


def resolve_compile_backend(backend, device: torch.device, compile: bool) -> str:
    """Compiled on the CPU, the graph holds inductor's own kernels: "auto" means the references there. On CUDA
    compile captures a CUDA graph around whatever the backend runs (our Triton kernels under "auto")."""
    backend = resolve_backend(backend, device)
    if compile and device.type != "cuda" and backend != "torch":
        raise ValueError(f"compile: on the CPU needs backend='torch' or 'auto', not {backend!r} (torch.compile "
                         "writes the compiled kernels; the Triton ones are not wrapped for it)")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend: 'triton' on {device.type} needs the Triton interpreter "
                         "(TRITON_INTERPRET=1 before the first import of the kernels); use backend='torch'")
    return backend


def shipped_weights() -> Path:
    """The checkpoint shipped in weights/ (the first directory there holding a config.json)."""
    found = sorted(p.parent for p in WEIGHTS_DIR.glob("*/config.json"))
    if not found:
        raise ValueError(f"model: no checkpoint in {WEIGHTS_DIR}; pass model=<checkpoint directory>")
    return found[0]


def checkpoint(model) -> Path:
    """A checkpoint directory, a Hugging Face model id (a directory of that name wins), or None (the shipped
    weights) -> the directory."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model: expected a checkpoint directory path or a model id, got {type(model).__name__}")
    if model is not None and not str(model).strip():  # as a path it is the working directory: nobody means that
        raise ValueError("model: empty; expected a checkpoint directory or a Hugging Face model id (org/name)")
    path = hub.resolve(model) if hub.is_model_id(model) else Path(model) if model is not None else shipped_weights()
    if not path.is_dir():
        raise ValueError(f"model: {path} is not a checkpoint directory")
    return path


def resolve_drafter(proposer, num_drafts, drafter, path: Path, cfg: ModelConfig) -> tuple:
    """-> (a name in {mtp, dflash, ngram, none} or the caller's object, max_drafts, and for "dflash" the block
    drafter's config and directory, else None, None). proposer "auto": mtp when the checkpoint has an MTP head,
    else ngram. drafter: the DFlash drafter's directory; None: <checkpoint>/dflash/."""
    if drafter is not None and proposer != "dflash":
        raise ValueError(f"drafter: is read only with proposer='dflash', not {proposer!r}")
    if not isinstance(proposer, str):
        n = getattr(proposer, "max_drafts", None)
        if not is_int(n, 0, 16):
            raise ValueError(f"proposer: {type(proposer).__name__} needs an integer max_drafts in [0, 16], got {n!r}")
        missing = [m for m in METHODS if not callable(getattr(proposer, m, None))]
        if missing:
            raise ValueError(f"proposer: {type(proposer).__name__} needs methods {', '.join(METHODS)}; "
                             f"missing {', '.join(missing)}")
        return proposer, n, None, None
    if proposer not in DRAFTERS:
        raise ValueError(f"proposer: {proposer!r} is not one of {', '.join(DRAFTERS)}")
    dflash = directory = None
    if proposer == "dflash":
        directory = Path(drafter) if drafter is not None else path / DRAFTER_DIR
        if not (directory / "config.json").is_file():
            raise ValueError(f"drafter: no DFlash drafter at {directory} (a directory with config.json and "
                             "model.safetensors; scripts/train_dflash.py trains one)")
        dflash = DFlashConfig.from_file(directory / "config.json")
        dflash.check(cfg)
    if num_drafts == "auto":
        num_drafts = min(dflash.block_size - 1, 16) if dflash else AUTO_MAX_DRAFTS
    if not is_int(num_drafts, 0, 16):
        raise ValueError(f"num_drafts: {num_drafts!r} must be 'auto' or an integer in [0, 16]")
    if proposer == "none" or num_drafts == 0:
        return "none", 0, None, None
    if proposer == "auto":
        proposer = "mtp" if cfg.has_mtp else "ngram"
    if proposer == "mtp" and not cfg.has_mtp:
        raise ValueError("proposer: 'mtp' needs a checkpoint with an MTP head (num_nextn_predict_layers: 1); "
                         "use 'ngram'")
    if dflash and num_drafts > dflash.block_size - 1:
        raise ValueError(f"num_drafts: {num_drafts} exceeds what one block drafts: the drafter's block_size is "
                         f"{dflash.block_size}, so at most {dflash.block_size - 1}")
    return proposer, num_drafts, dflash, directory
