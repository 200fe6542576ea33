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
import re
import time
from pathlib import Path

import llguidance
import torch

FIELDS = ("json_schema", "regex", "grammar")  # the SamplingParams fields that constrain, at most one set
DEAD_END = ("NoExtension", "NoExtensionBias")  # llguidance's stop reasons when nothing can follow


def one_line(message: str) -> str:
    """An llguidance message on one line, without the parser state dump it appends."""
    return " ".join(message.split("<state>")[0].split())


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
        """Advance by an emitted token; False when the grammar refuses it or is in its error state (see `error`).
        A dead end lets llguidance allow EOS and accept it in the error state, so the state is checked too:
        output the grammar rejects never finishes as "stop"."""
        return self.m.consume_token(token) and not self.m.is_error()

    @property
    def stopped(self) -> bool:  # the grammar is complete: nothing but EOS can follow
        return self.m.is_stopped() and not self.m.is_error()

    @property
    def error(self) -> str:
        """What went wrong, on one line."""
        message = one_line(self.m.get_error())
        if message in DEAD_END:
            return f"dead end: nothing the grammar allows can follow the output ({message})"
        return message or "token refused by the grammar"


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


def verify_bitmask(constraints: list, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """(B, K, W) int32 on the drafts' device: row j of a constrained sequence is the mask after its drafts[:j]
    rows past its real drafts, and every row of a free sequence, allow everything. drafts (B, γ), num_drafts (B,)."""
    host = torch.cat([num_drafts[:, None], drafts], 1).cpu()  # one copy to the host
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
        """The request's Constraint, or None when it has no grammar. An invalid grammar, or one that no text
        satisfies, is a ValueError naming the field (quoting llguidance where it found the problem)."""
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
            if field == "regex" and lone_backslash(value):  # llguidance would drop it and match without it
                raise ValueError("SamplingParams.regex: ends in a lone backslash (write \\\\ for a backslash)")
            matcher = self._compile(field, value)
            if field == "grammar":
                dead = lark_dead_parts(value, self._matches_nothing)
                if dead:
                    raise ValueError(f"SamplingParams.grammar: unsatisfiable: {', '.join(dead)} can match no "
                                     "finite text")
            probe = matcher.deep_copy()  # the first mask: llguidance finds an empty language only when asked
            if not Constraint(probe, (self.V + 31) // 32).mask().any() or probe.is_error():
                raise ValueError(f"SamplingParams.{field}: unsatisfiable: no text matches it "
                                 f"(llguidance: {one_line(probe.get_error()) or 'no token allowed'})")
            if len(self.compiled) >= 64:  # a bounded cache: forget the oldest grammar
                self.compiled.pop(next(iter(self.compiled)))
            self.compiled[key] = matcher
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
        return Constraint(self.compiled[key].deep_copy(), (self.V + 31) // 32)

    def _compile(self, field: str, value) -> llguidance.LLMatcher:
        try:
            g = {"json_schema": llguidance.LLMatcher.grammar_from_json_schema,
                 "regex": llguidance.LLMatcher.grammar_from_regex,
                 "grammar": llguidance.LLMatcher.grammar_from_lark}[field](value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"SamplingParams.{field}: invalid ({one_line(str(e))})") from None
        err = llguidance.LLMatcher.validate_grammar(g, self.tok)
        matcher = None if err else llguidance.LLMatcher(self.tok, g, log_level=0)
        err = err or matcher.get_error()
        if err:
            raise ValueError(f"SamplingParams.{field}: invalid (llguidance: {one_line(err)})")
        return matcher

    def _matches_nothing(self, regex_literal: str) -> bool:
        """Whether a Lark regex literal (/.../flags) has an empty language: its first mask is an error."""
        g = llguidance.LLMatcher.grammar_from_lark(f"start: {regex_literal}")
        if llguidance.LLMatcher.validate_grammar(g, self.tok):
            return False  # not something to judge alone; the whole grammar compiled
        m = llguidance.LLMatcher(self.tok, g, log_level=0)
        Constraint(m, (self.V + 31) // 32).mask()
        return m.is_error()


def lone_backslash(regex: str) -> bool:
    """An odd run of backslashes at the end: the last one escapes nothing."""
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


# ---- Lark: parts of a grammar that no finite text matches ------------------------------------------------
# llguidance compiles `start: "x" start` or a rule needing a terminal whose regex matches nothing, then the
# output stops or fails in a dead end. A rule is productive when one of its expansions needs only productive
# parts; every rule and terminal reachable from start must be. The parser follows llguidance's Lark syntax
# as far as this needs; for anything else (templates, terminal operators) it gives up and refuses nothing.

LARK_TOKEN = re.compile(r"""(?P<skip>(?:\#|//)[^\n]*|[ \t]+)|(?P<nl>(?:\r?\n[ \t]*)+)|(?P<dir>%[a-z_]+)
    |(?P<str>"(?:\\.|[^"\\])*"i?)|(?P<re>/(?:\\.|[^/\\\n])+/[imslux]*)
    |(?P<rule>!?[_?]?[a-z][_a-z0-9\-]*)|(?P<token>_?[A-Z][_A-Z0-9]*)|(?P<num>[0-9]+)
    |(?P<special><[^<>\s]+>)|(?P<ref>@[\w\-]+)|(?P<op>->|\.\.|[:|()\[\]{}~,.=&+*?])""", re.X)
JSON_STRING = re.compile(r'"(?:\\.|[^"\\])*"')


class Unsupported(Exception):
    """Lark syntax the dead-part check does not follow."""


def lark_tokens(text: str) -> list:
    """(kind, text) pairs; a %directive followed by a JSON object carries it as one 'blob' token."""
    out, i = [], 0
    while i < len(text):
        m = LARK_TOKEN.match(text, i)
        if m is None:
            raise Unsupported(text[i : i + 10])
        i = m.end()
        if m.lastgroup == "skip":
            continue
        out.append((m.lastgroup, m.group()))
        start = len(text) - len(text[i:].lstrip(" \t"))  # the next character that is not a blank
        if m.lastgroup == "dir" and text.startswith("{", start):
            i = json_end(text, start)
            out.append(("blob", text[start:i]))
    return out


def json_end(text: str, i: int) -> int:
    """The end of the JSON object that starts at text[i]."""
    depth = 0
    while i < len(text):
        if text[i] == '"':
            m = JSON_STRING.match(text, i)
            if m is None:
                raise Unsupported("string")
            i = m.end()
            continue
        depth += (text[i] in "{[") - (text[i] in "}]")
        i += 1
        if depth == 0:
            return i
    raise Unsupported("unclosed {")


class LarkRules:
    """Definitions name -> ("alt", [expansion]), an expansion a list of (atom, min repeats, max repeats or None),
    an atom ("lit",), ("re", literal), ("name", name) or a nested ("alt", ...)."""

    def __init__(self, text: str):
        self.toks, self.pos, self.defs = lark_tokens(text), 0, {}
        while self.peek():
            if self.peek()[0] == "nl":
                self.pos += 1
            else:
                self.item()

    def peek(self, ahead: int = 0):
        return self.toks[self.pos + ahead] if self.pos + ahead < len(self.toks) else None

    def take(self, text: str | None = None, kind: str | None = None):
        t = self.peek()
        if t is None or (text is not None and t[1] != text) or (kind is not None and t[0] != kind):
            raise Unsupported(f"expected {text or kind}")
        self.pos += 1
        return t

    def at(self, *texts) -> bool:
        t = self.peek()
        return t is not None and t[0] == "op" and t[1] in texts

    def item(self):
        kind, text = self.peek()
        if kind in ("rule", "token"):
            self.definition()
        elif text in ("%ignore", "%import", "%declare"):  # nothing a derivation from start needs
            while self.peek() and self.peek()[0] != "nl":
                self.pos += 1
        elif text == "%override":
            self.pos += 1
            self.definition()
        elif text == "%llguidance":  # options, no symbols
            self.take(text)
            self.take(kind="blob")
        else:
            raise Unsupported(text)
        if self.peek():
            self.take(kind="nl")

    def definition(self):
        name = self.take()[1].lstrip("!?")
        if self.at("{"):
            raise Unsupported("template")
        if self.at("["):  # attributes such as max_tokens=: they do not change what matches
            while not self.at("]"):
                self.take()
            self.take("]")
        if self.at("."):
            self.take(".")
            self.take(kind="num")
        self.take(":")
        self.defs[name] = self.alternatives()

    def alternatives(self):
        alts = [self.expansion()]
        while self.at("|") or (self.peek() and self.peek()[0] == "nl" and self.peek(1) == ("op", "|")):
            self.pos += 1 if self.at("|") else 2
            alts.append(self.expansion())
        return ("alt", alts)

    def expansion(self) -> list:
        parts = []
        while self.peek() and self.peek()[0] != "nl" and not self.at("|", "->", ")", "]", "}"):
            parts.append(self.repeated())
        if self.at("->"):  # an alias names the tree node only
            self.take("->")
            self.take(kind="rule")
        return parts

    def repeated(self) -> tuple:
        atom = self.atom()
        lo, hi = 1, 1
        if self.at("?", "*", "+"):
            lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[self.take()[1]]
        elif self.at("~"):
            self.take("~")
            lo = hi = int(self.take(kind="num")[1])
            if self.at(".."):
                self.take("..")
                hi = int(self.take(kind="num")[1])
        elif self.at("{"):
            self.take("{")
            lo = int(self.take(kind="num")[1]) if self.peek() and self.peek()[0] == "num" else 0
            hi = lo
            if self.at(","):
                self.take(",")
                hi = int(self.take(kind="num")[1]) if self.peek() and self.peek()[0] == "num" else None
            self.take("}")
        return atom, lo, hi

    def atom(self) -> tuple:
        kind, text = self.peek()
        if self.at("(", "["):
            self.pos += 1
            alts = self.alternatives()
            self.take(")" if text == "(" else "]")
            return ("alt", alts[1] + ([[]] if text == "[" else []))  # [x]: x or nothing
        self.pos += 1
        if kind == "str":
            if self.at(".."):
                self.take("..")
                self.take(kind="str")
            return ("lit",)
        if kind == "re":
            return ("re", text)
        if kind in ("rule", "token"):
            if self.at("{") and not (self.peek(1) and (self.peek(1)[0] == "num" or self.peek(1)[1] == ",")):
                raise Unsupported("template")
            return ("name", text.lstrip("!?"))
        if kind in ("special", "ref") or text == "%json":  # a special token, another grammar, a JSON schema
            if text == "%json":
                self.take(kind="blob")
            return ("lit",)
        raise Unsupported(text)


def lark_dead_parts(text: str, matches_nothing) -> list:
    """Rules, terminals and regex literals reachable from start that no finite text matches, in the order
    they are reached; [] when there are none or the grammar uses syntax this check does not follow."""
    try:
        defs = LarkRules(text).defs
    except Unsupported:
        return []
    if "start" not in defs:
        return []
    reach, order = {"start"}, [("name", "start")]
    for node in order:  # breadth first over names and regex literals
        stack = [defs[node[1]]] if node[0] == "name" and node[1] in defs else []
        while stack:
            alt = stack.pop()
            for part in (p for expansion in alt[1] for p, _, _ in expansion):
                if part[0] == "alt":
                    stack.append(part)
                elif part[0] in ("name", "re") and part[1] not in reach:
                    reach.add(part[1])
                    order.append(part)
    empty = {part[1] for part in order if part[0] == "re" and matches_nothing(part[1])}

    def productive(part, done) -> bool:
        if part[0] == "alt":
            return any(all(lo == 0 or productive(p, done) for p, lo, _ in expansion) for expansion in part[1])
        return (part[0] == "lit" or (part[0] == "re" and part[1] not in empty)
                or (part[0] == "name" and (part[1] in done or part[1] not in defs)))  # undefined: imported

    done, grew = set(), True
    while grew:  # the least fixed point: productive from productive parts only
        grew = False
        for name, alt in defs.items():
            if name not in done and productive(alt, done):
                done.add(name)
                grew = True
    return [part[1] for part in order if (part[0] == "re" and part[1] in empty)
            or (part[0] == "name" and part[1] in defs and part[1] not in done)]
