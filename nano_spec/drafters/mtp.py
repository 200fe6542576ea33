"""The checkpoint's MTP head as a drafter (docs/DESIGN.md §2, §4): the catch-up runs the first half of the head's
layer, the attention, over the verified rows and keeps its residual at the last accepted row; a draft runs the
second half, the MLP, there for draft 1, and γ-1 recursive steps give the rest."""
import torch

from nano_spec.drafters.base import DeviceDrafter, Drafts, VerifiedRows, pick_in_order
from nano_spec.model.model import DraftHead


class MTPDrafter(DeviceDrafter):
    """Its state per slot: the KV rows of its attention layer, and `head_mid`, its residual after the attention at
    the last accepted row."""

    def __init__(self, model, max_drafts: int, num_slots: int, max_len: int):
        cfg, p = model.cfg, next(model.parameters())
        self.model, self.max_drafts, self.device = model, max_drafts, p.device
        self.head = DraftHead(model)
        self.nets = (model.mtp, self.head)  # the head's layer inside the target, and the drafts' output layer
        self.k = torch.zeros(num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, device=p.device, dtype=p.dtype)
        self.v = torch.zeros_like(self.k)                                    # (S, L, Hkv, Dh)
        self.head_mid = torch.zeros(num_slots, cfg.hidden_size, device=p.device, dtype=p.dtype)  # (S, D)
        self.pos = torch.zeros(num_slots, dtype=torch.long, device=p.device)  # (S,) the position draft 1 is for

    @staticmethod
    def state_bytes(cfg, num_slots: int, max_len: int, dtype) -> int:
        return 2 * num_slots * max_len * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def admit(self, seq, hidden, first, tapped=None):
        """Catch-up over the prompt rows 0..T-1, whose next tokens are x_1..x_{T-1} and the first token."""
        T = hidden.shape[0]
        next_ids = torch.cat([torch.tensor(seq.tokens[1:T], dtype=torch.long, device=hidden.device), first])  # (T,)
        r = self.model.mtp_prefill(next_ids, hidden, seq.slot, self.k, self.v)  # (T, D)
        self.head_mid[seq.slot], self.pos[seq.slot] = r[-1], T

    def catch_up_rows(self, rows: VerifiedRows, na, kv: int):
        """The attention over the K verified rows at MTP positions seq_len..: their K/V rows (those past na lie
        beyond the new frontier and are overwritten later), and row na's residual."""
        r = self.model.mtp_attention(rows.tokens, rows.hidden, rows.slots, rows.seq_lens, self.k, self.v, kv)
        self.head_mid[rows.slots] = self.model.ops.gather_rows(r, na)
        self.pos[rows.slots] = rows.seq_lens + na + 1

    def draft_rows(self, slots, gamma: int, sampling, uniforms, kv: int, masks=None) -> Drafts:
        """Draft 1 from the MLP half at head_mid; step i > 1 feeds draft i-1 and the previous MTP output, at
        position pos + i - 2."""
        o, pos = self.model.mtp_mlp(self.head_mid[slots]), self.pos[slots]  # (B, D), (B,)

        def logits(i, prev):  # draft i > 0 grows from the MTP output after draft i - 1
            nonlocal o
            if i:
                o = self.model.mtp_forward(prev[:, None], o[:, None], slots, pos + i - 1, self.k, self.v, kv)[:, 0]
            return self.model.mtp_logits(o, self.head)

        return pick_in_order(sampling, gamma, uniforms, logits, masks)
