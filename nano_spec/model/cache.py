"""Slots and stashes (docs/DESIGN.md §3), as stacked tensors.

A slot s holds one live sequence. All Mamba layers share one tensor per kind of
state, so one launch can commit every layer of every sequence:

    k, v           (La, S, Lmax, Hkv, Dh)   attention KV, La attention layers
    conv_state     (Lm, S, C, W-1)          last W-1 conv inputs of each Mamba layer
    ssm_state      (Lm, S, H, P, N) fp32    the recurrent state

The stashes are written by a verify over B sequences x K rows:

    ssm_stash      (Lm, B, K, H, P, N) fp32 state after each row
    conv_stash     (Lm, B, C, W-1+K)        the window before the step, then the K new inputs
    hidden_stash   (B, K, D)                final-normed hidden of each row (seeds the MTP)
    tap_stash      (B, K, nT*D)             the residual after each tapped layer (a block drafter's context;
                                            nT = 0 without one)

They live in flat buffers sized for (S, max_k) and are viewed at the
step's (B, K), so every view is contiguous. A drafter keeps its own state
(the MTP head's KV rows live in drafters.mtp.MTPDrafter).
"""
import torch

from nano_spec.model.config import ModelConfig


def cache_bytes(cfg: ModelConfig, num_slots: int, max_seq_len: int, max_k: int, dtype: torch.dtype,
                taps=()) -> dict:
    """Bytes of every buffer, counted on the meta device before anything is allocated."""
    c = HybridCache(cfg, num_slots, max_seq_len, max_k, "meta", dtype, taps)
    parts = {"kv": (c.k, c.v), "conv_state": (c.conv_state,), "ssm_state": (c.ssm_state,),
             "ssm_stash": (c._ssm_stash,), "conv_stash": (c._conv_stash,), "hidden_stash": (c._hidden_stash,),
             "tap_stash": (c._tap_stash,)}
    return {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in parts.items()}


class HybridCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_seq_len: int, max_k: int, device="cpu",
                 dtype=torch.float32, taps=()):
        self.cfg, self.num_slots, self.max_seq_len, self.max_k = cfg, num_slots, max_seq_len, max_k
        La, Lm = len(cfg.attention_layers), len(cfg.mamba_layers)
        H, P, N, C, W = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.conv_dim, cfg.mamba_d_conv
        Hkv, Dh = cfg.num_key_value_heads, cfg.head_dim
        S = B = num_slots  # a verify holds at most one row per slot
        kw = dict(device=device, dtype=dtype)
        self.k = torch.zeros(La, S, max_seq_len, Hkv, Dh, **kw)
        self.v = torch.zeros_like(self.k)
        self.conv_state = torch.zeros(Lm, S, C, W - 1, **kw)
        self.ssm_state = torch.zeros(Lm, S, H, P, N, device=device, dtype=torch.float32)
        self._ssm_stash = torch.zeros(Lm * B * max_k * H * P * N, device=device, dtype=torch.float32)
        self._conv_stash = torch.zeros(Lm * B * C * (W - 1 + max_k), **kw)
        self._hidden_stash = torch.zeros(B * max_k * cfg.hidden_size, **kw)
        self.tap_index = {layer: i for i, layer in enumerate(taps)}  # tapped layer -> its column block
        self._tap_stash = torch.zeros(B * max_k * len(taps) * cfg.hidden_size, **kw)
        # layer index -> index into the stacked attention / Mamba tensors
        self.attn_index = {l: i for i, l in enumerate(cfg.attention_layers)}
        self.mamba_index = {l: i for i, l in enumerate(cfg.mamba_layers)}

    # ---- stash views at the step's shape ---------------------------------------------
    def ssm_stash(self, B: int, K: int):  # (Lm, B, K, H, P, N)
        s = self.ssm_state.shape
        return self._view(self._ssm_stash, (s[0], B, K, *s[2:]), B, K)

    def conv_stash(self, B: int, K: int):  # (Lm, B, C, W-1+K)
        s = self.conv_state.shape
        return self._view(self._conv_stash, (s[0], B, s[2], s[3] + K), B, K)

    def hidden_stash(self, B: int, K: int):  # (B, K, D)
        return self._view(self._hidden_stash, (B, K, self.cfg.hidden_size), B, K)

    def tap_stash(self, B: int, K: int):  # (B, K, nT*D)
        return self._view(self._tap_stash, (B, K, len(self.tap_index) * self.cfg.hidden_size), B, K)

    def _view(self, flat, shape, B, K):
        if not (1 <= K <= self.max_k and 1 <= B <= self.num_slots):
            raise ValueError(f"a verify of B={B} x K={K} exceeds the cache ({self.num_slots} slots, "
                             f"max_k={self.max_k})")
        return flat[: torch.Size(shape).numel()].view(shape)

    def reset_slot(self, slot: int):
        """A slot handed to a new request starts from zero recurrent state.

        KV rows need no reset: attention reads only rows < seq_len + j, all written by the new occupant.
        """
        self.conv_state[:, slot].zero_()
        self.ssm_state[:, slot].zero_()


class SlotIds:
    """The device tensor of a batch's slot ids, uploaded only when the batch changes."""

    def __init__(self, device):
        self.device, self.key, self.ids = device, None, None

    def __call__(self, seqs) -> torch.Tensor:  # (B,)
        key = tuple(s.slot for s in seqs)
        if key != self.key:
            self.key, self.ids = key, torch.tensor(key, dtype=torch.long, device=self.device)
        return self.ids


def cache_len(max_seq_len: int, max_drafts: int) -> int:
    """Rows per slot: past max_seq_len a verify writes K rows, and the MTP drafts γ more."""
    return max_seq_len + 2 * (max_drafts + 1)
