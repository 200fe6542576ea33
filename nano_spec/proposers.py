"""Draft proposers behind one small interface.

    num_drafts                      γ, the drafts per step (K = γ + 1 verified rows)
    after_prefill(runner, seq, hidden, first_token)    drafts for a newly admitted sequence
    after_verify(runner, seqs, rows)                   drafts for the next step of seqs[i], i in rows

`none`  plain decoding (γ = 0).
`ngram` prompt lookup: the continuation of the latest earlier occurrence of the
        last n tokens (n = max_n .. 1); works with any checkpoint.
`mtp`   the checkpoint's MTP head (SPEC §2, §4): catch-up over the verified rows,
        the output at the last accepted row gives draft 1, γ-1 recursive steps the rest.
"""
import torch

from nano_spec.sampling import BatchSampling


class NoProposer:
    num_drafts = 0

    def after_prefill(self, runner, seq, hidden, first_token):
        pass

    def after_verify(self, runner, seqs, rows):
        pass


class NgramProposer:
    def __init__(self, num_drafts: int, max_n: int = 3):
        self.num_drafts, self.max_n = num_drafts, max_n

    def lookup(self, tokens: list) -> list:
        """Up to γ tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), 0, -1):
            tail = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + self.num_drafts]
        return []

    def after_prefill(self, runner, seq, hidden, first_token):
        runner.set_drafts([seq], [self.lookup(seq.tokens)])

    def after_verify(self, runner, seqs, rows):
        live = [seqs[i] for i in rows]
        runner.set_drafts(live, [self.lookup(s.tokens) for s in live])


class MTPProposer:
    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts

    def after_prefill(self, runner, seq, hidden, first_token):
        """Catch-up over the prompt rows 0..T-1 (next tokens x_1..x_{T-1}, v), then draft."""
        model, T = runner.model, hidden.shape[0]
        next_ids = torch.cat([runner._tensor(seq.tokens[1:T]), first_token])  # (T,)
        o = model.mtp_prefill(next_ids, hidden, seq.slot, runner.cache)  # (T, D)
        slots, pos = runner._tensor([seq.slot]), runner._tensor([T])
        sampling = BatchSampling.of([seq.params], runner.device)
        u = None if sampling.all_greedy else runner.uniforms([seq], self.num_drafts)
        self._draft(runner, slots, o[-1:], pos, sampling, u, kv_len=T + self.num_drafts)

    def after_verify(self, runner, seqs, rows):
        """Catch-up over the K verified rows at MTP positions seq_len.., next tokens = the emitted row;
        rows past na are computed but lie beyond the new frontier and are overwritten later."""
        st, model, K = runner.step_state, runner.model, runner.K
        idx = runner._tensor(rows)
        hidden = runner.cache.hidden_stash(st.slots.shape[0], K)[idx]  # (R, K, D)
        slots, seq_lens, na = st.slots[idx], st.seq_lens[idx], st.na[idx]
        o = model.mtp_step(st.emitted[idx], hidden, slots, seq_lens, runner.cache, st.kv_len)  # (R, K, D)
        seed = model.ops.gather_rows(o, na)  # (R, D): the row of the last accepted position
        u = None if st.uniforms is None else st.uniforms[idx, K:]
        self._draft(runner, slots, seed, seq_lens + na + 1, st.sampling.select(idx), u, st.kv_len)

    def _draft(self, runner, slots, o, pos, sampling, uniforms, kv_len):
        """o (B, D): the MTP output at position pos-1 -> γ drafts into the slots' buffers.

        Step i > 1 feeds the previous draft and the previous MTP output at position pos + i - 2.
        """
        model, drafts, probs = runner.model, [], []
        for i in range(self.num_drafts):
            tok, q = sampling.pick(model.mtp_logits(o), None if uniforms is None else uniforms[:, i])
            drafts.append(tok)
            probs.append(q)
            if i + 1 < self.num_drafts:
                o = model.mtp_step(tok[:, None], o[:, None], slots, pos + i, runner.cache, kv_len)[:, 0]
        runner.drafts[slots] = torch.stack(drafts, dim=1)
        runner.num_drafts[slots] = self.num_drafts
        if not sampling.all_greedy:
            runner.need_draft_probs()[slots] = torch.stack(probs, dim=1)


def make_proposer(name: str, num_drafts: int, has_mtp: bool):
    """name in {auto, mtp, ngram, none}; auto = mtp when the checkpoint has an MTP head, else ngram."""
    if name not in ("auto", "mtp", "ngram", "none"):
        raise ValueError(f"proposer: {name!r} is not one of auto, mtp, ngram, none")
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or not 0 <= num_drafts <= 16:
        raise ValueError(f"num_drafts: {num_drafts!r} must be an integer in [0, 16]")
    if name == "none" or num_drafts == 0:
        return NoProposer()
    if name == "auto":
        name = "mtp" if has_mtp else "ngram"
    if name == "mtp":
        if not has_mtp:
            raise ValueError("proposer: 'mtp' needs a checkpoint with an MTP head (num_nextn_predict_layers: 1); "
                             "use 'ngram'")
        return MTPProposer(num_drafts)
    return NgramProposer(num_drafts)
