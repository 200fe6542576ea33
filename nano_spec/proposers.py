"""Draft proposers: where the γ tokens that a step verifies come from (docs/DESIGN.md §4).

A proposer is any object with

    max_drafts                         γ_max, the most drafts a step asks for
    admit(seq, hidden, first)          a new sequence: hidden (T, D) its final-normed prompt rows, first (1,)
                                       its first token
    draft(seqs, gamma, uniforms)       -> Drafts: γ drafts per sequence, at the start of a step
    catch_up(seqs, rows, na)           after the accept rule: the step's VerifiedRows and na (B,) accepted drafts
    compile()                          optional: under LLM(compile=True), its drafting calls through torch.compile

It keeps its own state, indexed by `seq.slot` (the MTP head keeps its KV rows and the
row that draft 1 grows from), and never writes the engine's. `uniforms` (B, γ) is its
random draw, None when every row is greedy. γ <= γ_max is fixed or chosen per step
(planner.py); draft is not called at γ = 0, but catch_up is. A sequence with a grammar
carries its `constraint` (grammar.py): drafts the grammar refuses are only ever
rejected, and a sampled draft's q must be the masked distribution it was drawn from
(DESIGN §11). `LLM(proposer=...)` takes a name or such an object; its draft ids are
checked on the device every step (the built-in proposers are `trusted`: their ids come
from the model's logits or the sequence's own tokens).

`none`  plain decoding (γ = 0).
`ngram` prompt lookup: the continuation of the latest earlier occurrence of the
        last n tokens (n = max_n .. 1); works with any checkpoint.
`mtp`   the checkpoint's MTP head (DESIGN §2): catch-up over the verified rows; the
        output at the last accepted row gives draft 1, γ-1 recursive steps the rest.
`dflash` a block drafter (dflash.py, DESIGN §13): one forward over [last token, MASK...]
        reading the target's tapped layers drafts a whole block; the verify takes γ of it.
        It asks the runner for those layers' rows: `taps`, a list of layer indices, makes
        admit and catch_up receive them (admit(..., taps=(T, nT*D)), VerifiedRows.taps).
"""
from dataclasses import dataclass

import torch

from nano_spec.cache import SlotIds
from nano_spec.config import is_int
from nano_spec.dflash import DFlashConfig, DFlashDrafter
from nano_spec.grammar import DraftMasks
from nano_spec.sampling import BatchSampling, SamplingParams


@dataclass(frozen=True)
class Drafts:
    """What a proposer returns for B sequences."""
    tokens: torch.Tensor        # (B, γ) long, every id in [0, V); rows with fewer drafts are padded (with 0)
    nd: torch.Tensor            # (B,) long, the real drafts of each row
    probs: torch.Tensor | None  # (B, γ, V) the q each draft was drawn from; None: deterministic (one-hot q)

    @classmethod
    def from_lists(cls, lists: list, gamma: int, device) -> "Drafts":
        lists = [list(d[:gamma]) for d in lists]
        padded = [d + [0] * (gamma - len(d)) for d in lists]
        return cls(torch.tensor(padded, dtype=torch.long, device=device).view(len(lists), gamma),
                   torch.tensor([len(d) for d in lists], dtype=torch.long, device=device), None)


@dataclass(frozen=True)
class VerifiedRows:
    """One verify's rows, for a proposer's catch-up. Row j of sequence b sits at position seq_lens[b] + j."""
    slots: torch.Tensor     # (B,)
    seq_lens: torch.Tensor  # (B,) tokens in the caches before the step
    tokens: torch.Tensor    # (B, K) the token emitted after each row (valid for j <= na)
    hidden: torch.Tensor    # (B, K, D) final-normed hidden of each row
    taps: torch.Tensor | None = None  # (B, K, nT*D) the residual after each layer in proposer.taps, if any


def ngram_lookup(tokens: list, gamma: int, max_n: int = 3) -> list:
    """Up to γ tokens that followed the latest earlier occurrence of the longest matching suffix: the plain scan,
    for the reference loop (NgramProposer finds the same through its index)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), 0, -1):
        tail = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + gamma]
    return []


def pick_in_order(seqs, slots, per_slot: BatchSampling, gamma: int, uniforms, logits_of) -> Drafts:
    """γ drafts picked one position at a time: draft i from logits_of(i, draft i-1) (B, V), drawn with
    uniforms[:, i] on sampled rows; a constrained row picks under its grammar's mask after the drafts before it
    (DESIGN §11). per_slot holds each slot's sampling settings."""
    sampling = per_slot.select(slots, all(s.params.greedy for s in seqs))
    masks = DraftMasks([s.constraint for s in seqs], gamma, slots.device)
    tokens, probs, tok = [], [], None
    try:
        for i in range(gamma):
            tok, q = sampling.pick(logits_of(i, tok), None if uniforms is None else uniforms[:, i], masks.mask())
            tokens.append(tok)
            probs.append(q)
            if i + 1 < gamma:
                masks.push(tok, i)
    finally:
        masks.close()
    nd = torch.tensor(masks.num, device=slots.device) if masks.on else torch.full_like(slots, gamma)
    return Drafts(torch.stack(tokens, dim=1), nd, None if sampling.all_greedy else torch.stack(probs, dim=1))


class NoProposer:
    """Plain decoding: with max_drafts 0 the runner calls none of the methods."""
    max_drafts = 0
    trusted = True  # its draft ids are in range by construction: the engine need not check them


class NgramProposer:
    """Prompt lookup over an index per slot: n-gram -> the position after its latest occurrence, extended by the
    tokens a sequence gained since its last draft, so a lookup costs O(new tokens), not O(context)."""

    trusted = True

    def __init__(self, max_drafts: int, device, max_n: int = 3):
        self.max_drafts, self.device, self.max_n = max_drafts, device, max_n
        self.index = {}  # slot -> (tokens indexed, {n-gram tuple: position after its latest occurrence})

    def admit(self, seq, hidden, first):
        self.index[seq.slot] = (0, {})

    def catch_up(self, seqs, rows, na):  # the index follows seq.tokens when it drafts
        pass

    def draft(self, seqs, gamma, uniforms) -> Drafts:
        found = [self.lookup(s, gamma) for s in seqs]
        found = [d if s.constraint is None else d[: s.constraint.valid_prefix(d)] for d, s in zip(found, seqs)]
        return Drafts.from_lists(found, gamma, self.device)

    def lookup(self, seq, gamma: int) -> list:
        """ngram_lookup(seq.tokens, γ, max_n), from the index."""
        tokens, L = seq.tokens, len(seq.tokens)
        done, table = self.index.get(seq.slot, (0, {}))
        for end in range(max(done, 1), L):  # n-grams ending before the last token: the suffix itself is excluded
            for n in range(1, min(self.max_n, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        self.index[seq.slot] = (max(done, L), table)
        if not gamma:
            return []
        for n in range(min(self.max_n, L - 1), 0, -1):
            start = table.get(tuple(tokens[L - n :]))
            if start is not None:
                return tokens[start : start + gamma]
        return []


class MTPProposer:
    """The checkpoint's MTP head. Its state per slot: the KV rows of its attention layer, and `seed`, its output
    at the last accepted position, which draft 1 is read from (DESIGN §4)."""
    trusted = True

    def __init__(self, model, max_drafts: int, num_slots: int, max_len: int):
        self.model, self.max_drafts = model, max_drafts
        cfg, p = model.cfg, next(model.parameters())
        self.k = torch.zeros(num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, device=p.device, dtype=p.dtype)
        self.v = torch.zeros_like(self.k)                                    # (S, L, Hkv, Dh)
        self.seed = torch.zeros(num_slots, cfg.hidden_size, device=p.device, dtype=p.dtype)  # (S, D)
        self.pos = torch.zeros(num_slots, dtype=torch.long, device=p.device)  # (S,) the position draft 1 is for
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, p.device)  # (S,) each request's settings
        self.slot_ids = SlotIds(p.device)
        self.compiled = None  # name -> Bucketed, once compile() has run

    @staticmethod
    def state_bytes(cfg, num_slots: int, max_len: int, dtype) -> int:
        """Bytes of the KV rows, before anything is allocated."""
        return 2 * num_slots * max_len * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def admit(self, seq, hidden, first):
        """Catch-up over the prompt rows 0..T-1, whose next tokens are x_1..x_{T-1} and the first token."""
        T = hidden.shape[0]
        next_ids = torch.cat([torch.tensor(seq.tokens[1:T], dtype=torch.long, device=hidden.device), first])  # (T,)
        o = self.model.mtp_prefill(next_ids, hidden, seq.slot, self.k, self.v)  # (T, D)
        self.seed[seq.slot], self.pos[seq.slot] = o[-1], T
        self.sampling.write(seq.slot, BatchSampling.of([seq.params], hidden.device))

    def catch_up(self, seqs, rows: VerifiedRows, na):
        """The K verified rows at MTP positions seq_len..; rows past na are computed but lie beyond the new
        frontier and are overwritten later."""
        kv_len = max(s.seq_len for s in seqs) + rows.tokens.shape[1]
        self.seed[rows.slots] = self._call("_verified", rows.tokens, rows.hidden, rows.slots, rows.seq_lens, na,
                                           kv_len=kv_len)
        self.pos[rows.slots] = rows.seq_lens + na + 1

    def draft(self, seqs, gamma, uniforms) -> Drafts:
        """Draft 1 from the seed; step i > 1 feeds draft i-1 and the previous MTP output at position pos + i - 2.
        A constrained row picks draft i under its grammar's mask after drafts 1..i-1."""
        slots = self.slot_ids(seqs)
        if not gamma:
            return Drafts(slots.new_zeros(len(seqs), 0), slots.new_zeros(len(seqs)), None)
        o, pos, kv_len = self.seed[slots], self.pos[slots], max(s.seq_len for s in seqs) + gamma

        def logits(i, prev):  # draft i > 0 grows from the MTP output after draft i - 1
            nonlocal o
            if not i:
                return self.model.mtp_logits(o)
            o, out = self._call("_next", prev, o, slots, pos + i - 1, kv_len=kv_len)
            return out

        return pick_in_order(seqs, slots, self.sampling, gamma, uniforms, logits)

    # ---- the two MTP calls of a step, compiled per bucket under LLM(compile=True) ------------------------
    def _verified(self, tokens, hidden, slots, seq_lens, na, kv_len: int):
        """Catch-up over a verify's K rows (B, K), hidden (B, K, D) -> the new seeds (B, D), the rows at na."""
        o = self.model.mtp_step(tokens, hidden, slots, seq_lens, self.k, self.v, kv_len)
        return self.model.ops.gather_rows(o, na)

    def _next(self, prev, o, slots, positions, kv_len: int):
        """One recursive draft step: draft tokens prev (B,), outputs o (B, D) -> (next o (B, D), logits (B, V))."""
        o = self.model.mtp_step(prev[:, None], o[:, None], slots, positions, self.k, self.v, kv_len)[:, 0]
        return o, self.model.mtp_logits(o)

    def compile(self):
        """Both calls per bucket (nano_spec/compiled.py); the KV rows are written in place."""
        from nano_spec.compiled import Bucketed, static_buffers, use_compiled_ops

        use_compiled_ops(self.model)
        static_buffers(self.k, self.v)
        S, L = self.k.shape[:2]
        self.compiled = {"_verified": Bucketed(self._verified, 5, S, L, self.max_drafts + 1, self.k.device),
                         "_next": Bucketed(self._next, 4, S, L, 1, self.k.device)}

    def _call(self, name: str, *args, kv_len: int):
        """self.<name>(*args, kv_len), through its compiled buckets once compile() has run."""
        if self.compiled is None:
            return getattr(self, name)(*args, kv_len)
        return self.compiled[name](*args, kv_len=kv_len)[0]


class DFlashProposer:
    """Drafts with a DFlashDrafter. Its state per slot: the context K/V of every drafter layer at the
    committed positions, the last emitted token (the block's row 0) and the context length."""
    trusted = True

    def __init__(self, drafter: DFlashDrafter, target, max_drafts: int, num_slots: int, max_len: int):
        cfg, p = drafter.cfg, next(target.parameters())
        if not 1 <= max_drafts <= cfg.block_size - 1:
            raise ValueError(f"num_drafts: {max_drafts} drafts need a block of {max_drafts + 1}; this drafter's "
                             f"block_size is {cfg.block_size} (at most {cfg.block_size - 1} drafts)")
        self.drafter, self.target, self.max_drafts = drafter, target, max_drafts
        self.taps = list(cfg.target_layer_ids)  # the runner stashes these layers' rows for catch_up
        shape = (cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)  # (Ld, S, L, Hkv, Dh), RoPE-rotated
        self.v = torch.zeros_like(self.k)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=p.device)     # (S,) the block's row 0
        self.ctx_len = torch.zeros(num_slots, dtype=torch.long, device=p.device)  # (S,) context rows stored
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, p.device)
        self.slot_ids = SlotIds(p.device)
        self.mask_row = torch.full((cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.long, device=p.device)
        self.compiled = None  # a Bucketed block forward, once compile() has run

    @staticmethod
    def state_bytes(cfg: DFlashConfig, num_slots: int, max_len: int, dtype) -> int:
        """Bytes of the context K/V, before anything is allocated."""
        return 2 * cfg.num_hidden_layers * num_slots * max_len * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def _store(self, slots, taps, positions):
        """Context K/V of rows taps (B, T, nT*D) at positions (B, T) into slots (B,)."""
        c = self.drafter.context(taps)
        for i in range(len(self.drafter.layers)):
            k, v = self.drafter.context_kv(i, c, positions)
            self.k[i, slots[:, None], positions], self.v[i, slots[:, None], positions] = k, v

    def admit(self, seq, hidden, first, taps):
        """The bootstrap: every prompt row's context K/V, so the first block already sees the whole prompt."""
        T = taps.shape[0]
        slot = torch.tensor([seq.slot], device=taps.device)
        self._store(slot, taps[None], torch.arange(T, device=taps.device)[None])
        self.last[seq.slot], self.ctx_len[seq.slot] = first[0], T
        self.sampling.write(seq.slot, BatchSampling.of([seq.params], taps.device))

    def catch_up(self, seqs, rows, na):
        """Context K/V of the verified rows at positions seq_len + j; rows past na lie beyond the new context
        length and are overwritten later. The block's row 0 becomes the token emitted after row na."""
        K = rows.tokens.shape[1]
        self._store(rows.slots, rows.taps, rows.seq_lens[:, None] + torch.arange(K, device=na.device))
        self.last[rows.slots] = rows.tokens.gather(1, na[:, None])[:, 0]
        self.ctx_len[rows.slots] = rows.seq_lens + na + 1

    def draft(self, seqs, gamma, uniforms):
        """One block forward; rows 1 .. γ are the drafts (the rest of the block is dropped). A constrained row
        picks draft j under its grammar's mask after drafts[:j], from the same forward's logits."""
        slots = self.slot_ids(seqs)
        kv_len = max(s.seq_len for s in seqs)  # context rows read: the longest context
        if self.compiled is None:
            logits = self._block(slots, gamma, kv_len)
        else:
            logits = self.compiled(slots, gamma, kv_len=kv_len)[0]
        return pick_in_order(seqs, slots, self.sampling, gamma, uniforms, lambda i, prev: logits[:, i])

    def _block(self, slots, gamma: int, kv_len: int):
        """The block forward of slots (B,) -> the logits of drafts 1 .. γ (B, γ, V)."""
        cfg = self.drafter.cfg
        ids = torch.cat([self.last[slots, None], self.mask_row.expand(len(slots), -1)], dim=1)  # (B, Bk)
        x = self.target.model.embed_tokens(ids) * cfg.input_embedding_scale
        h = self.drafter.draft_hidden(x, slots, self.ctx_len[slots], self.k[:, :, :kv_len], self.v[:, :, :kv_len])
        return self.target.logits(h[:, 1 : gamma + 1]) * (cfg.output_multiplier * self.target.cfg.logits_scaling)

    def compile(self):
        """The block forward per bucket (the catch-up's context K/V writes stay eager)."""
        from nano_spec.compiled import Bucketed, static_buffers

        static_buffers(self.k, self.v, self.last, self.ctx_len)
        S, L = self.k.shape[1:3]
        self.compiled = Bucketed(self._block, 1, S, L, self.max_drafts, self.k.device)


AUTO_MAX_DRAFTS = 4  # γ_max under num_drafts="auto"; each extra draft also costs stash memory per slot
METHODS = ("admit", "draft", "catch_up")
NAMES = ("auto", "mtp", "dflash", "ngram", "none")


def resolve_proposer(proposer, num_drafts, has_mtp: bool, block_size: int | None = None) -> tuple:
    """Check the settings before anything is loaded -> (a name in {mtp, dflash, ngram, none} or the caller's
    object, γ_max).

    proposer: a name in {auto, mtp, dflash, ngram, none} (auto = mtp when the checkpoint has an MTP head, else
    ngram), or an object with max_drafts and the methods of the module docstring.
    num_drafts: γ, or "auto" (γ_max = AUTO_MAX_DRAFTS, or a DFlash block's Bk - 1; the planner picks γ per step).
    block_size: the DFlash drafter's Bk, when one was found."""
    if not isinstance(proposer, str):
        n = getattr(proposer, "max_drafts", None)
        if not is_int(n, 0, 16):
            raise ValueError(f"proposer: {type(proposer).__name__} needs an integer max_drafts in [0, 16], got {n!r}")
        missing = [m for m in METHODS if not callable(getattr(proposer, m, None))]
        if missing:
            raise ValueError(f"proposer: {type(proposer).__name__} needs methods {', '.join(METHODS)}; "
                             f"missing {', '.join(missing)}")
        return proposer, n
    if proposer not in NAMES:
        raise ValueError(f"proposer: {proposer!r} is not one of {', '.join(NAMES)}")
    if num_drafts == "auto":
        num_drafts = min(block_size - 1, 16) if proposer == "dflash" and block_size else AUTO_MAX_DRAFTS
    if not is_int(num_drafts, 0, 16):
        raise ValueError(f"num_drafts: {num_drafts!r} must be 'auto' or an integer in [0, 16]")
    if proposer == "none" or num_drafts == 0:
        return "none", 0
    if proposer == "auto":
        proposer = "mtp" if has_mtp else "ngram"
    if proposer == "mtp" and not has_mtp:
        raise ValueError("proposer: 'mtp' needs a checkpoint with an MTP head (num_nextn_predict_layers: 1); "
                         "use 'ngram'")
    if proposer == "dflash" and block_size is None:
        raise ValueError("proposer: 'dflash' needs a drafter: <checkpoint>/dflash/ or drafter=<directory> "
                         "(scripts/train_dflash.py trains one)")
    if proposer == "dflash" and num_drafts > block_size - 1:
        raise ValueError(f"num_drafts: {num_drafts} exceeds what one block drafts: the drafter's block_size is "
                         f"{block_size}, so at most {block_size - 1}")
    return proposer, num_drafts


def make_proposer(kind, max_drafts: int, model, num_slots: int, max_len: int, drafter: DFlashDrafter = None):
    """The proposer `resolve_proposer` chose, built for a loaded model (an object is used as it is)."""
    if not isinstance(kind, str):
        return kind
    if kind == "mtp":
        return MTPProposer(model, max_drafts, num_slots, max_len)
    if kind == "dflash":
        return DFlashProposer(drafter, model, max_drafts, num_slots, max_len)
    return NgramProposer(max_drafts, next(model.parameters()).device) if kind == "ngram" else NoProposer()
