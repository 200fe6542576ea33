"""Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens (n = max_n .. 1), from an
index per slot; works with any checkpoint. The reference loop's plain scan (reference.ngram_lookup) finds the same."""
from nano_spec.drafters.base import Drafts


class NgramDrafter:
    """Prompt lookup over an index per slot: n-gram -> the position after its latest occurrence, extended by the
    tokens a sequence gained since its last draft, so a lookup costs O(new tokens), not O(context)."""

    taps = ()

    def __init__(self, max_drafts: int, device, max_n: int = 3):
        self.max_drafts, self.device, self.max_n = max_drafts, device, max_n
        self.index = {}  # slot -> (tokens indexed, {n-gram tuple: position after its latest occurrence})

    @staticmethod
    def state_bytes(cfg, num_slots: int, max_len: int, dtype) -> int:
        return 0  # host-side: an index of ints per slot

    def admit(self, seq, hidden, first, tapped=None):
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
        for n in range(min(self.max_n, L - 1), 0, -1):
            start = table.get(tuple(tokens[L - n :]))
            if start is not None:
                return tokens[start : start + gamma]
        return []
