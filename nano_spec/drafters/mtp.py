"""The checkpoint's MTP head as a drafter (docs/DESIGN.md §2, §4): catch-up over the verified rows; the output at
the last accepted row gives draft 1, γ-1 recursive steps the rest."""
import torch

from nano_spec.drafters.base import Drafts, VerifiedRows, pick_in_order
from nano_spec.model.sampling import BatchSampling, SamplingParams
from nano_spec.model.cache import SlotIds


class MTPDrafter:
    """Its state per slot: the KV rows of its attention layer, and `head_out`, its output at the last accepted row."""
    taps = ()

    def __init__(self, model, max_drafts: int, num_slots: int, max_len: int):
        self.model, self.max_drafts = model, max_drafts
        cfg, p = model.cfg, next(model.parameters())
        self.k = torch.zeros(num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, device=p.device, dtype=p.dtype)
        self.v = torch.zeros_like(self.k)                                    # (S, L, Hkv, Dh)
        self.head_out = torch.zeros(num_slots, cfg.hidden_size, device=p.device, dtype=p.dtype)  # (S, D)
        self.pos = torch.zeros(num_slots, dtype=torch.long, device=p.device)  # (S,) the position draft 1 is for
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, p.device)  # (S,) each request's settings
        self.slot_ids = SlotIds(p.device)
        self.compiled = None  # name -> Bucketed, once compile() has run

    @staticmethod
    def state_bytes(cfg, num_slots: int, max_len: int, dtype) -> int:
        return 2 * num_slots * max_len * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def admit(self, seq, hidden, first, tapped=None):
        """Catch-up over the prompt rows 0..T-1, whose next tokens are x_1..x_{T-1} and the first token."""
        T = hidden.shape[0]
        next_ids = torch.cat([torch.tensor(seq.tokens[1:T], dtype=torch.long, device=hidden.device), first])  # (T,)
        o = self.model.mtp_prefill(next_ids, hidden, seq.slot, self.k, self.v)  # (T, D)
        self.head_out[seq.slot], self.pos[seq.slot] = o[-1], T
        self.sampling.write(seq.slot, BatchSampling.of([seq.params], hidden.device))

    def catch_up(self, seqs, rows: VerifiedRows, na):
        """The K verified rows at MTP positions seq_len..; rows past na are computed but lie beyond the new
        frontier and are overwritten later."""
        kv_len = max(s.seq_len for s in seqs) + rows.tokens.shape[1]
        self.head_out[rows.slots] = self._call("_verified", rows.tokens, rows.hidden, rows.slots, rows.seq_lens, na,
                                           kv_len=kv_len)
        self.pos[rows.slots] = rows.seq_lens + na + 1

    def draft(self, seqs, gamma, uniforms) -> Drafts:
        """Draft 1 from head_out; step i > 1 feeds draft i-1 and the previous MTP output, at position pos + i - 2."""
        slots = self.slot_ids(seqs)
        o, pos, kv_len = self.head_out[slots], self.pos[slots], max(s.seq_len for s in seqs) + gamma

        def logits(i, prev):  # draft i > 0 grows from the MTP output after draft i - 1
            nonlocal o
            if not i:
                return self.model.mtp_logits(o)
            o, out = self._call("_next", prev, o, slots, pos + i - 1, kv_len=kv_len)
            return out

        return pick_in_order(seqs, slots, self.sampling, gamma, uniforms, logits)

    # ---- the two MTP calls of a step, compiled per bucket under LLM(compile=True) ------------------------
    def _verified(self, tokens, hidden, slots, seq_lens, na, kv_len: int):
        """Catch-up over a verify's K rows (B, K), hidden (B, K, D) -> the new head_out rows (B, D), the rows at na."""
        o = self.model.mtp_forward(tokens, hidden, slots, seq_lens, self.k, self.v, kv_len)
        return self.model.ops.gather_rows(o, na)

    def _next(self, prev, o, slots, positions, kv_len: int):
        """One recursive draft step: draft tokens prev (B,), outputs o (B, D) -> (next o (B, D), logits (B, V))."""
        o = self.model.mtp_forward(prev[:, None], o[:, None], slots, positions, self.k, self.v, kv_len)[:, 0]
        return o, self.model.mtp_logits(o)

    def compile(self):
        """Both calls per bucket (nano_spec/model/compiled.py); the KV rows are written in place."""
        from nano_spec.model.compiled import Bucketed, static_buffers, use_compiled_ops

        use_compiled_ops(self.model)
        static_buffers(self.k, self.v)
        S, L = self.k.shape[:2]
        self.compiled = {"_verified": Bucketed(self._verified, 5, S, L, self.max_drafts + 1, self.k.device,
                                               "MTP catch-up"),
                         "_next": Bucketed(self._next, 4, S, L, 1, self.k.device, "MTP draft step")}

    def _call(self, name: str, *args, kv_len: int):
        """self.<name>(*args, kv_len), through its compiled buckets once compile() has run."""
        if self.compiled is None:
            return getattr(self, name)(*args, kv_len)
        return self.compiled[name](*args, kv_len=kv_len)[0]
