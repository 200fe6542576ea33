"""Structured output: grammar masks for constrained requests (docs/DESIGN.md §11).

A request with `SamplingParams(json_schema=..., regex=..., grammar=...)` gets a `Constraint`:
an llguidance matcher over the tokens it has emitted. A mask is packed as llguidance
packs it, bit t % 32 of word t // 32 set when token t is allowed, W = ceil(V / 32) words
a row; ids past the tokenizer's vocabulary (padding rows of the embedding) are never set.

The engine advances a matcher by exactly the emitted tokens. Drafting and the verify
need masks of states after drafts that may be rejected: they push the drafts, read the
masks and roll back (`DraftMasks`), so the matcher is never left ahead.
"""
import json
import time
from pathlib import Path

import llguidance
import torch

FIELDS = ("json_schema", "regex", "grammar")  # the SamplingParams fields that constrain, at most one set


class Constraint:
    """One request's grammar state over its emitted tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.m, self.W = matcher, words

    def mask(self) -> torch.Tensor:
        """(W,) int32: the tokens allowed next."""
        buf = torch.empty(self.W, dtype=torch.int32)
        self.m.unsafe_compute_mask_ptr(buf.data_ptr(), 4 * self.W)  # llguidance checks the size
        return buf

    def push(self, token: int) -> bool:
        """Advance speculatively; a refused token leaves the state as it was (no error state)."""
        return self.m.try_consume_tokens([token]) == 1

    def rollback(self, n: int):
        if n:
            self.m.rollback(n)

    def valid_prefix(self, tokens: list) -> int:
        """How many leading tokens the grammar allows, in order."""
        return self.m.validate_tokens(tokens) if tokens else 0

    def consume(self, token: int) -> bool:
        """Advance by an emitted token; False puts the matcher in its error state (see `error`)."""
        return self.m.consume_token(token)

    @property
    def stopped(self) -> bool:  # nothing but EOS can follow
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()


class DraftMasks:
    """Masks of R rows after drafts pushed one position at a time: row r is masked by its constraint's state
    after the drafts pushed so far. `num` is the drafts each row may push: `num` if given (the real drafts of a
    verify), else γ, cut where a row's matcher refuses a draft. Rows past their `num`, and rows without a
    constraint, get all ones: nothing they pick there is kept, so no mask is computed. `close()` rolls back."""

    def __init__(self, constraints: list, gamma: int, device, num: list | None = None):
        self.cons, self.device = constraints, device
        self.num = list(num) if num is not None else [gamma] * len(constraints)
        self.pushed = [0] * len(constraints)
        self.pos = 0  # positions pushed so far
        self.on = any(c is not None for c in constraints)

    def mask(self) -> torch.Tensor | None:
        """(R, W) on the device, or None when no row is constrained (no host work, no copy)."""
        if not self.on:
            return None
        W = next(c for c in self.cons if c is not None).W
        out = torch.full((len(self.cons), W), -1, dtype=torch.int32)
        for r, c in enumerate(self.cons):
            if c is not None and self.num[r] >= self.pos:
                out[r] = c.mask()
        return out.to(self.device)

    def push(self, tokens: torch.Tensor, i: int):
        """Draft i of every row, tokens (R,), advances the constrained rows' matchers."""
        if not self.on:
            return
        self.pos = i + 1
        for r, (c, t) in enumerate(zip(self.cons, tokens.tolist())):
            if c is not None and self.num[r] > i:
                if c.push(t):
                    self.pushed[r] += 1
                else:
                    self.num[r] = i

    def close(self):
        for c, n in zip(self.cons, self.pushed):
            if n:
                c.rollback(n)
        self.pushed = [0] * len(self.cons)


def verify_bitmask(constraints: list, drafts: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
    """(B, K, W) int32 on the drafts' device: row j of a constrained sequence is the mask after its drafts[:j]
    rows past its real drafts, and every row of a free sequence, allow everything. drafts (B, γ), nd (B,)."""
    host = torch.cat([nd[:, None], drafts], 1).cpu()  # one copy to the host
    masks = DraftMasks(constraints, drafts.shape[1], "cpu", host[:, 0].tolist())
    try:
        rows = [masks.mask()]
        for j in range(drafts.shape[1]):
            masks.push(host[:, 1 + j], j)
            rows.append(masks.mask())
    finally:
        masks.close()
    return torch.stack(rows, 1).to(drafts.device)


class Grammars:
    """The grammar compiler of one LLM: an llguidance tokenizer built from tokenizer.json on first use and one
    compiled matcher per distinct grammar, copied for each request."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids):
        self.file, self.V, self.eos = tokenizer_file, vocab_size, list(eos_ids)
        self.tok, self.compiled = None, {}
        self.compile_seconds, self.num_compiled = 0.0, 0

    def constraint(self, params) -> Constraint | None:
        """The request's Constraint, or None when it has no grammar. An invalid grammar is a ValueError naming
        the field and quoting llguidance."""
        field = next((f for f in FIELDS if getattr(params, f) is not None), None)
        if field is None:
            return None
        value = getattr(params, field)
        try:
            key = (field, json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)
        except (TypeError, ValueError) as e:  # a dict holding something JSON cannot write
            raise ValueError(f"SamplingParams.{field}: invalid ({e})") from None
        if key not in self.compiled:
            t0 = time.perf_counter()
            if self.tok is None:  # vocabulary as large as the model's: the padding ids exist and stay disallowed
                self.tok = llguidance.LLTokenizer(self.file.read_text(encoding="utf-8"), n_vocab=self.V,
                                                  eos_token=self.eos or None)
            try:
                g = {"json_schema": llguidance.LLMatcher.grammar_from_json_schema,
                     "regex": llguidance.LLMatcher.grammar_from_regex,
                     "grammar": llguidance.LLMatcher.grammar_from_lark}[field](value)
            except (ValueError, TypeError) as e:
                raise ValueError(f"SamplingParams.{field}: invalid ({e})") from None
            err = llguidance.LLMatcher.validate_grammar(g, self.tok)
            matcher = None if err else llguidance.LLMatcher(self.tok, g, log_level=0)
            err = err or matcher.get_error()
            if err:
                raise ValueError(f"SamplingParams.{field}: invalid (llguidance: {' '.join(err.split())})")
            if len(self.compiled) >= 64:  # a bounded cache: forget the oldest grammar
                self.compiled.pop(next(iter(self.compiled)))
            self.compiled[key] = matcher
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
        return Constraint(self.compiled[key].deep_copy(), (self.V + 31) // 32)
