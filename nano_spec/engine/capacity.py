"""Capacity: the bytes the engine's settings need, and max_seq_len, decided before any allocation."""
from dataclasses import replace

import torch

from nano_spec.model.cache import cache_bytes, cache_len
from nano_spec.model.config import ModelConfig
from nano_spec.model.dflash import DFlashConfig
from nano_spec.model.model import HybridLM
from nano_spec.drafters.dflash import DFlashDrafter
from nano_spec.drafters.mtp import MTPDrafter


def weight_bytes(cfg: ModelConfig, dtype, drafter: DFlashConfig | None = None) -> int:
    """Bytes of the model's weights (and a DFlash drafter's) in dtype, counted on the meta device (nothing is
    allocated); the drafter's from its sizes, so not even its modules are built before the memory is checked."""
    with torch.device("meta"):
        n = sum(p.numel() for p in HybridLM(cfg).parameters())
    n += drafter.num_parameters if drafter else 0
    return n * torch.tensor([], dtype=dtype).element_size()


def memory_parts(c, max_seq_len: int, weights: int) -> dict:
    """Bytes of the weights, every cache and stash, and the drafter's state (the MTP head's KV rows, or the DFlash
    drafter's context K/V and the verify's tapped rows) for the settings c (an EngineConfig) at max_seq_len."""
    rows = cache_len(max_seq_len, c.max_drafts)
    taps = c.dflash.target_layer_ids if c.dflash else ()
    caches = cache_bytes(c.cfg, c.max_batch, rows, c.max_drafts + 1, c.dtype, taps)
    probs = c.max_batch * c.max_drafts * c.cfg.vocab_size * 4  # a sampled step's q (B, γ, V)
    mtp_kv = MTPDrafter.state_bytes(c.cfg, c.max_batch, rows, c.dtype) if c.drafter == "mtp" else 0
    dflash_kv = DFlashDrafter.state_bytes(c.dflash, c.max_batch, rows, c.dtype) if c.dflash else 0
    return {"weights": weights, **caches, "mtp_kv": mtp_kv, "dflash_kv": dflash_kv, "draft_probs": probs}


def fit(c) -> tuple:
    """The settings c with max_seq_len resolved (the largest that fits, unless given) -> (c, bytes needed).
    Settings whose parts do not fit the budget are refused, naming the numbers, before anything is allocated."""
    weights = weight_bytes(c.cfg, c.dtype, c.dflash)
    c = replace(c, max_seq_len=c.max_seq_len or default_max_seq_len(c, weights))
    parts = memory_parts(c, c.max_seq_len, weights)
    need = sum(parts.values())
    if need > c.memory_budget:
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
        raise ValueError(f"memory: max_batch={c.max_batch}, max_seq_len={c.max_seq_len}, "
                         f"K={c.max_drafts + 1} need {_size(need)} of weights and caches ({detail}) "
                         f"but the budget is {_size(c.memory_budget)}; lower max_batch or max_seq_len")
    return c, need


def default_max_seq_len(c, weights: int) -> int:
    """The largest max_seq_len, at most max_position_embeddings, whose weights and caches fit. Only the KV rows
    grow with it, so a bisection finds it. When not even 2 fits it returns 2, which fit refuses with the numbers."""
    lo, hi = 2, max(2, c.cfg.max_position_embeddings)
    while lo < hi:  # lo is 2 or fits, everything above hi does not fit
        mid = (lo + hi + 1) // 2
        fits = sum(memory_parts(c, mid, weights).values()) <= c.memory_budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def _size(n: int) -> str:
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    return next((f"{n / scale:.2f} {unit}" for unit, scale in units if n >= scale), f"{n} B")
