"""A block drafter as a drafter (docs/DESIGN.md §13): one forward over [last token, MASK...] reading the target's
tapped layers drafts a whole block; the verify takes γ of it. Its network is nano_spec/model/dflash.py."""
import torch

from nano_spec.drafters.base import DeviceDrafter, pick_in_order
from nano_spec.model.dflash import DFlashConfig, DFlashModel
from nano_spec.model.graph_ops import kv_write
from nano_spec.model.model import DraftHead


class DFlashDrafter(DeviceDrafter):
    """Its state per slot: each drafter layer's context K/V at the committed positions, the block's row 0 (the last
    emitted token) and the context length."""

    def __init__(self, net: DFlashModel, target, max_drafts: int, num_slots: int, max_len: int):
        cfg, p = net.cfg, next(target.parameters())  # max_drafts <= Bk - 1: checked in settings
        self.net, self.target, self.max_drafts, self.device = net, target, max_drafts, p.device
        self.head = DraftHead(target)
        self.nets = (net, self.head)
        self.taps = tuple(cfg.target_layer_ids)  # the runner stashes these layers' rows for catch_up
        shape = (cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)  # (Ld, S, L, Hkv, Dh), RoPE-rotated
        self.v = torch.zeros_like(self.k)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=p.device)     # (S,) the block's row 0
        self.ctx_len = torch.zeros(num_slots, dtype=torch.long, device=p.device)  # (S,) context rows stored
        self.mask_row = torch.full((cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.long, device=p.device)

    @staticmethod
    def state_bytes(cfg: DFlashConfig, num_slots: int, max_len: int, dtype) -> int:
        return 2 * cfg.num_hidden_layers * num_slots * max_len * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def _store(self, slots, tapped, positions):
        """Context K/V of the tapped rows (B, T, nT*D) at positions (B, T) into slots (B,)."""
        c = self.net.context(tapped)
        for i in range(len(self.net.layers)):
            k, v = self.net.context_kv(i, c, positions)
            kv_write(self.k[i], self.v[i], slots, positions, k, v)  # in place, in a graph too

    def admit(self, seq, hidden, first, tapped):
        """The bootstrap: every prompt row's context K/V, so the first block already sees the whole prompt."""
        T = tapped.shape[0]
        slot = torch.tensor([seq.slot], device=tapped.device)
        self._store(slot, tapped[None], torch.arange(T, device=tapped.device)[None])
        self.last[seq.slot], self.ctx_len[seq.slot] = first[0], T

    def catch_up_rows(self, rows, na, kv: int):
        """Context K/V of the verified rows at positions seq_len + j; rows past na lie beyond the new context
        length and are overwritten later. The block's row 0 becomes the token emitted after row na."""
        K = rows.tokens.shape[1]
        self._store(rows.slots, rows.tapped, rows.seq_lens[:, None] + torch.arange(K, device=na.device))
        self.last[rows.slots] = rows.tokens.gather(1, na[:, None])[:, 0]
        self.ctx_len[rows.slots] = rows.seq_lens + na + 1

    def draft_rows(self, slots, gamma: int, sampling, uniforms, kv: int, masks=None):
        """One block forward over the context rows (at most kv); rows 1 .. γ are the drafts, picked in order from
        its logits (the rest is dropped)."""
        cfg = self.net.cfg
        ids = torch.cat([self.last[slots, None], self.mask_row.expand(len(slots), -1)], dim=1)  # (B, Bk)
        x = self.target.model.embed_tokens(ids) * cfg.input_embedding_scale
        h = self.net.draft_hidden(x, slots, self.ctx_len[slots], self.k[:, :, :kv], self.v[:, :, :kv])
        logits = self.head(h[:, 1 : gamma + 1]) * (cfg.output_multiplier * self.target.cfg.logits_scaling)
        return pick_in_order(sampling, gamma, uniforms, lambda i, prev: logits[:, i], masks)
