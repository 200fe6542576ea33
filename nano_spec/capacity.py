"""Capacity: how much the engine may allocate and how many threads it runs, decided before any allocation.

    memory_parts        bytes of the weights, every cache and stash, and the proposer's state (MTP or DFlash)
    check_memory        refuse settings whose parts do not fit the budget, naming the numbers
    default_max_seq_len the largest max_seq_len that fits (bisection: only the KV rows grow with it)
    default_threads     one CPU thread when a step is too small to split
"""
import os

import torch

from nano_spec.cache import cache_bytes
from nano_spec.config import ModelConfig
from nano_spec.dflash import DFlashConfig
from nano_spec.model import HybridLM
from nano_spec.proposers import DFlashProposer, MTPProposer
from nano_spec.runner import cache_len


def available_bytes(device: torch.device) -> int:
    """Free memory on the device the caches will live on."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts the page cache the kernel can reclaim, which free pages alone leave out
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(cfg: ModelConfig, dtype, drafter: DFlashConfig | None = None) -> int:
    """Bytes of the model's weights (and a DFlash drafter's) in dtype, counted on the meta device (nothing is
    allocated); the drafter's from its sizes, so not even its modules are built before the memory is checked."""
    with torch.device("meta"):
        n = sum(p.numel() for p in HybridLM(cfg).parameters())
    n += drafter.num_parameters if drafter else 0
    return n * torch.tensor([], dtype=dtype).element_size()


def memory_parts(cfg: ModelConfig, max_batch: int, max_seq_len: int, max_drafts: int, dtype, weights: int,
                 proposer: str | DFlashConfig | None = None) -> dict:
    """Bytes of the weights, of every cache and stash, and of the proposer's state: "mtp" (its KV rows) or a
    DFlash drafter's config (its context K/V and the verify's tapped rows). Nothing is allocated."""
    rows = cache_len(max_seq_len, max_drafts)
    dflash = proposer if isinstance(proposer, DFlashConfig) else None
    caches = cache_bytes(cfg, max_batch, rows, max_drafts + 1, dtype, dflash.target_layer_ids if dflash else ())
    probs = max_batch * max_drafts * cfg.vocab_size * 4  # a sampled step's q (B, γ, V)
    mtp_kv = MTPProposer.state_bytes(cfg, max_batch, rows, dtype) if proposer == "mtp" else 0
    dflash_kv = DFlashProposer.state_bytes(dflash, max_batch, rows, dtype) if dflash else 0
    return {"weights": weights, **caches, "mtp_kv": mtp_kv, "dflash_kv": dflash_kv, "draft_probs": probs}


def check_memory(cfg: ModelConfig, max_batch: int, max_seq_len: int, max_drafts: int, dtype, budget: int,
                 proposer: str | DFlashConfig | None = None) -> int:
    """Refuse, before allocating anything, weights, caches and stashes that do not fit in the budget."""
    drafter = proposer if isinstance(proposer, DFlashConfig) else None
    parts = memory_parts(cfg, max_batch, max_seq_len, max_drafts, dtype, weight_bytes(cfg, dtype, drafter),
                         proposer)
    need = sum(parts.values())
    if need > budget:
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
        raise ValueError(f"memory: max_batch={max_batch}, max_seq_len={max_seq_len}, "
                         f"K={max_drafts + 1} need {_size(need)} of weights and caches ({detail}) "
                         f"but the budget is {_size(budget)}; lower max_batch or max_seq_len")
    return need


def default_max_seq_len(cfg: ModelConfig, max_batch: int, max_drafts: int, dtype, budget: int,
                        proposer: str | DFlashConfig | None = None) -> int:
    """The largest max_seq_len, at most max_position_embeddings, whose weights and caches fit.

    Only the KV caches grow with it, so the need is monotonic and a bisection finds it. When not
    even 2 fits it returns 2, which check_memory refuses with the numbers (max_batch is too big)."""
    weights = weight_bytes(cfg, dtype, proposer if isinstance(proposer, DFlashConfig) else None)

    def fits(n: int) -> bool:
        return sum(memory_parts(cfg, max_batch, n, max_drafts, dtype, weights, proposer).values()) <= budget

    lo, hi = 2, max(2, cfg.max_position_embeddings)
    while lo < hi:  # lo is 2 or fits, everything above hi does not fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


SPLIT_WORK = 32e6  # parameters x rows per step below which one CPU thread is faster (docs/BENCHMARKS.md, Threads)
TORCH_THREADS = torch.get_num_threads()  # torch's own default (one per core), as found at import
MAX_THREADS = 4 * (os.cpu_count() or 1)   # far past any gain; an absurd count (100000) crashes torch


def default_threads(model, max_batch: int, device) -> int:
    """1 on a CPU when a step's work (parameters x max_batch) is too small to split across cores,
    else torch's default (one thread per core). Measured on the shipped 8M model: 1 thread wins at
    batch 1, 2 threads at batch 8."""
    work = sum(p.numel() for p in model.parameters()) * max_batch
    return 1 if device.type == "cpu" and work < SPLIT_WORK else TORCH_THREADS


