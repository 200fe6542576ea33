"""Structured output: grammar masks for constrained requests (docs/DESIGN.md §11).

A request with `SamplingParams(json_schema=..., regex=..., grammar=...)` gets a `Constraint`:
an llguidance matcher over the tokens it has emitted. A mask is packed as llguidance
packs it, bit t % 32 of word t // 32 set when token t is allowed, Vw = ceil(V / 32) words
a row; ids past the tokenizer's vocabulary (padding rows of the embedding) are never set.

The engine advances a matcher by exactly the emitted tokens. Drafting and the verify
need masks of states after drafts that may be rejected: they push the drafts, read the
masks and roll back (`DraftMasks`), so the matcher is never left ahead.
"""
import json
import time
from contextlib import closing
from pathlib import Path

import llguidance
import torch

DEAD_END = ("NoExtension", "NoExtensionBias")  # llguidance's stop reasons when nothing can follow
# JSON without whitespace between tokens unless the schema's own "x-guidance" says otherwise (its keys win, one by
# one): in llguidance's default, any run of whitespace anywhere, a small model emits newlines until max_new_tokens
# (DESIGN §11)
JSON_DEFAULTS = {"whitespace_flexible": False}


def json_grammar(schema) -> str:
    """llguidance's grammar of a JSON schema with JSON_DEFAULTS; the schema true is {} (any JSON value), so that
    the defaults, which llguidance applies to an object only, hold for it too."""
    schema = {} if schema is True else schema
    return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS if isinstance(schema, dict) else None)


# the SamplingParams fields that constrain (at most one set) -> llguidance's grammar of a value
GRAMMAR_OF = {"json_schema": json_grammar, "regex": llguidance.LLMatcher.grammar_from_regex,
              "grammar": llguidance.LLMatcher.grammar_from_lark}


def one_line(message: str) -> str:
    """An llguidance message on one line, without the parser state dump it appends."""
    return " ".join(message.split("<state>")[0].split())


class Constraint:
    """One request's grammar state over its emitted tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.m, self.Vw = matcher, words

    def mask(self) -> torch.Tensor:
        """(Vw,) int32: the tokens allowed next."""
        buf = torch.empty(self.Vw, dtype=torch.int32)
        self.m.unsafe_compute_mask_ptr(buf.data_ptr(), 4 * self.Vw)  # llguidance checks the size
        return buf

    def push(self, token: int) -> bool:
        """Advance speculatively; a refused token leaves the state as it was (no error state)."""
        return self.m.try_consume_tokens([token]) == 1

    def rollback(self, n: int):
        self.m.rollback(n)

    def valid_prefix(self, tokens: list) -> int:
        """How many leading tokens the grammar allows, in order."""
        return self.m.validate_tokens(tokens) if tokens else 0

    def consume(self, token: int) -> bool:
        """Advance by an emitted token; False when the grammar refuses it or is in its error state (see `error`).
        A dead end lets llguidance allow EOS and accept it in the error state, so the state is checked too:
        output the grammar rejects never finishes as "stop"."""
        return self.m.consume_token(token) and not self.m.is_error()

    @property
    def stopped(self) -> bool:  # the grammar is complete: nothing but EOS can follow
        return self.m.is_stopped() and not self.m.is_error()

    @property
    def error(self) -> str:
        message = one_line(self.m.get_error())
        if message in DEAD_END:
            return f"dead end: nothing the grammar allows can follow the output ({message})"
        return message or "token refused by the grammar"


class DraftMasks:
    """Masks of R rows after drafts pushed one position at a time, row r under its constraint's state after the
    drafts pushed so far. `num`: the drafts each row may push (γ, or the real drafts of a verify), cut at a row's
    first refused draft, so a row has pushed min(num, pos). Rows past their `num`, and rows without a
    constraint, get all ones: nothing they pick there is kept, so no mask is computed. `close()` rolls back."""

    def __init__(self, constraints: list, num: list, device):
        self.cons, self.num, self.device = constraints, list(num), device
        self.pos = 0  # positions pushed so far
        self.on = any(c is not None for c in constraints)

    def mask(self) -> torch.Tensor:
        """(R, Vw) on the device; callers ask only when `on` (a free batch does no host work, no copy)."""
        Vw = next(c for c in self.cons if c is not None).Vw
        out = torch.full((len(self.cons), Vw), -1, dtype=torch.int32)
        for r, c in enumerate(self.cons):
            if c is not None and self.num[r] >= self.pos:
                out[r] = c.mask()
        return out.to(self.device)

    def push(self, tokens: torch.Tensor, i: int):
        """Draft i of every row, tokens (R,), advances the constrained rows' matchers."""
        self.pos = i + 1
        for r, (c, t) in enumerate(zip(self.cons, tokens.tolist())):
            if c is not None and self.num[r] > i and not c.push(t):
                self.num[r] = i

    def close(self):
        for c, n in zip(self.cons, self.num):
            if c is not None:
                c.rollback(min(n, self.pos))


def verify_bitmask(constraints: list, drafts: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
    """(B, K, Vw) int32 on the drafts' device: row j of a constrained sequence is the mask after its drafts[:j]
    rows past its real drafts, and every row of a free sequence, allow everything. drafts (B, γ), nd (B,)."""
    host = torch.cat([nd[:, None], drafts], 1).cpu()  # one copy to the host
    with closing(DraftMasks(constraints, host[:, 0].tolist(), "cpu")) as masks:
        rows = [masks.mask()]
        for j in range(drafts.shape[1]):
            masks.push(host[:, 1 + j], j)
            rows.append(masks.mask())
    return torch.stack(rows, 1).to(drafts.device)


class Grammars:
    """The grammar compiler of one LLM: an llguidance tokenizer built from tokenizer.json on first use and one
    compiled matcher per distinct grammar, copied for each request."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids):
        self.file, self.V, self.eos = tokenizer_file, vocab_size, list(eos_ids)
        self.Vw = (vocab_size + 31) // 32  # mask words per row
        self.tok, self.compiled = None, {}
        self.compile_seconds, self.num_compiled = 0.0, 0

    def constraint(self, params) -> Constraint | None:
        """The request's Constraint, or None when it has no grammar. An invalid grammar, or one that no text
        satisfies, is a ValueError naming the field (quoting llguidance where it found the problem)."""
        field = next((f for f in GRAMMAR_OF if getattr(params, f) is not None), None)
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
            if field == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"SamplingParams.json_schema: invalid (not JSON: {e})") from None
            regexes = [value] if field == "regex" else list(schema_patterns(value)) if field == "json_schema" else []
            # an odd run of backslashes at the end escapes nothing: llguidance would drop it and match without it
            if any((len(r) - len(r.rstrip("\\"))) % 2 for r in regexes):
                raise ValueError(f"SamplingParams.{field}: a regex ends in a lone backslash (write \\\\ for a "
                                 "backslash)")
            matcher = self._compile(field, value)
            self._probe(field, matcher.deep_copy())
            if len(self.compiled) >= 64:  # a bounded cache: forget the oldest grammar
                self.compiled.pop(next(iter(self.compiled)))
            self.compiled[key] = matcher
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
        return Constraint(self.compiled[key].deep_copy(), self.Vw)

    def _compile(self, field: str, value) -> llguidance.LLMatcher:
        try:
            g = GRAMMAR_OF[field](value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"SamplingParams.{field}: invalid ({one_line(str(e))})") from None
        # an invalid grammar leaves the matcher in its error state, with validate_grammar's message: one compile
        matcher = llguidance.LLMatcher(self.tok, g, log_level=0)
        err = matcher.get_error()
        if err:
            raise ValueError(f"SamplingParams.{field}: invalid (llguidance: {one_line(err)})")
        return matcher

    def _probe(self, field: str, m: llguidance.LLMatcher):
        """Walk the text the grammar forces from the start (the first mask, then the forced tokens): llguidance
        finds an empty language, a dead end after the forced text, or a forced run longer than it can follow
        (x{4294967295}, start: "x" start) only there. A dead end off the forced path ends its request at run time
        with an error instead (Constraint.consume)."""
        Constraint(m, self.Vw).mask()
        if not m.is_error():
            m.consume_tokens(m.compute_ff_tokens())
            if not m.is_error():
                Constraint(m, self.Vw).mask()
        if m.is_error():
            err = one_line(m.get_error())
            what = "unsatisfiable: no text matches it" if err in DEAD_END else "refused"
            raise ValueError(f"SamplingParams.{field}: {what} (llguidance: {err})")


def schema_patterns(schema):
    """The regexes of a JSON schema: "pattern" values and "patternProperties" keys (not inside data)."""
    items = schema.items() if isinstance(schema, dict) else enumerate(schema) if isinstance(schema, list) else ()
    for k, v in items:  # a list's keys are ints: never a keyword
        if k == "pattern" and isinstance(v, str):
            yield v
        elif k == "patternProperties" and isinstance(v, dict):
            yield from v
        if k not in ("const", "enum", "default", "examples"):
            yield from schema_patterns(v)
