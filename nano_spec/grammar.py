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
import math
import re
import time
from pathlib import Path

import llguidance
import torch

FIELDS = ("json_schema", "regex", "grammar")  # the SamplingParams fields that constrain, at most one set
DEAD_END = ("NoExtension", "NoExtensionBias")  # llguidance's stop reasons when nothing can follow
# llguidance walks a forced run (text only one way can continue) item by item and fails mid-output somewhere
# past 25,000 items (x{260000}, "x"{100000}, start: "x" start); so a repetition count, or the length of the
# shortest text a constraint allows, above this is refused before anything is queued
REPEAT_LIMIT = 10_000
# JSON without whitespace between tokens unless the schema's own "x-guidance" says otherwise (its keys win, one by
# one): in llguidance's default, any run of whitespace anywhere, a small model emits newlines until max_new_tokens
# (DESIGN §11)
JSON_DEFAULTS = {"whitespace_flexible": False}


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
            if field == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"SamplingParams.json_schema: invalid (not JSON: {e})") from None
            regexes = [value] if field == "regex" else list(schema_patterns(value)) if field == "json_schema" else []
            if any(map(lone_backslash, regexes)):  # llguidance would drop it and match without it
                raise ValueError(f"SamplingParams.{field}: a regex ends in a lone backslash (write \\\\ for a "
                                 "backslash)")
            matcher = self._compile(field, value)
            self._check_sizes(field, value, regexes)
            probe = matcher.deep_copy()  # the first mask: llguidance finds an empty language only when asked
            allowed = Constraint(probe, (self.V + 31) // 32).mask().any()
            if not allowed or probe.is_error():
                err = one_line(probe.get_error()) or "no token allowed"
                what = "unsatisfiable: no text matches it" if err in DEAD_END or not allowed else "invalid"
                raise ValueError(f"SamplingParams.{field}: {what} (llguidance: {err})")
            if len(self.compiled) >= 64:  # a bounded cache: forget the oldest grammar
                self.compiled.pop(next(iter(self.compiled)))
            self.compiled[key] = matcher
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
        return Constraint(self.compiled[key].deep_copy(), (self.V + 31) // 32)

    def _compile(self, field: str, value) -> llguidance.LLMatcher:
        try:
            g = {"json_schema": json_grammar,
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

    def _check_sizes(self, field: str, value, regexes: list):
        """Refuse a Lark grammar with parts no finite text matches, and repetition counts or shortest texts
        above REPEAT_LIMIT."""
        if field == "grammar":
            dead, shortest, biggest = lark_check(value, self._shortest_match)
        else:
            sizes = [regex_sizes(r) for r in regexes]
            dead, shortest, biggest = [], max((n for n, _ in sizes), default=0), max((b for _, b in sizes), default=0)
        if dead:
            raise ValueError(f"SamplingParams.grammar: unsatisfiable: {', '.join(dead)} can match no finite text")
        if biggest > REPEAT_LIMIT:
            raise ValueError(f"SamplingParams.{field}: repetition count {biggest} is above the limit {REPEAT_LIMIT}")
        if shortest > REPEAT_LIMIT:
            what = "a pattern's shortest match" if field == "json_schema" else "the shortest text it allows"
            raise ValueError(f"SamplingParams.{field}: {what} has {shortest} characters, above the limit "
                             f"{REPEAT_LIMIT} (nested repetition counts multiply)")

    def _shortest_match(self, regex_literal: str) -> float:
        """The shortest text a Lark regex literal (/.../flags) matches: inf when its language is empty, which
        llguidance finds when it computes the first mask."""
        g = llguidance.LLMatcher.grammar_from_lark(f"start: {regex_literal}")
        if not llguidance.LLMatcher.validate_grammar(g, self.tok):  # else not something to judge alone
            m = llguidance.LLMatcher(self.tok, g, log_level=0)
            Constraint(m, (self.V + 31) // 32).mask()
            if m.is_error():
                return math.inf
        return regex_sizes(regex_literal[1 : regex_literal.rindex("/")])[0]


def json_grammar(schema) -> str:
    """llguidance's grammar of a JSON schema with JSON_DEFAULTS; the schema true is {} (any JSON value), so that
    the defaults, which llguidance applies to an object only, hold for it too."""
    schema = {} if schema is True else schema
    return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS if isinstance(schema, dict) else None)


def lone_backslash(regex: str) -> bool:
    """An odd run of backslashes at the end: the last one escapes nothing."""
    return (len(regex) - len(regex.rstrip("\\"))) % 2 == 1


def schema_patterns(schema):
    """The regexes of a JSON schema: "pattern" values and "patternProperties" keys (not inside data)."""
    if isinstance(schema, list):
        for v in schema:
            yield from schema_patterns(v)
    elif isinstance(schema, dict):
        for k, v in schema.items():
            if k == "pattern" and isinstance(v, str):
                yield v
            elif k == "patternProperties" and isinstance(v, dict):
                yield from v
            if k not in ("const", "enum", "default", "examples"):
                yield from schema_patterns(v)


REGEX_COUNT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


def regex_sizes(rx: str) -> tuple:
    """(length of the shortest text the regex matches, largest repetition count written in it), read from the
    regex syntax llguidance takes (Rust's regex crate); the emptiness of a class such as [a&&b] is not judged.
    A regex this reading does not follow gives (0, 0): llguidance has parsed it, only the sizes are unknown."""
    pos, biggest = 0, 0

    def alternatives() -> int:
        nonlocal pos
        best = sequence()
        while pos < len(rx) and rx[pos] == "|":
            pos += 1
            best = min(best, sequence())
        return best

    def sequence() -> int:
        nonlocal pos, biggest
        total = 0
        while pos < len(rx) and rx[pos] not in "|)":
            n, lo = atom(), 1
            m = REGEX_COUNT.match(rx, pos)
            if pos < len(rx) and rx[pos] in "*+?":
                lo, pos = int(rx[pos] == "+"), pos + 1
            elif m:
                lo, pos = int(m[1] or 0), m.end()
                biggest = max(biggest, lo, int(m[3] or 0))
            if pos < len(rx) and rx[pos] == "?":  # lazy
                pos += 1
            total += n * lo if lo else 0
        return total

    def atom() -> int:
        nonlocal pos
        c = rx[pos]
        if c == "(":
            flags = re.compile(r"\?[a-zA-Z-]*\)").match(rx, pos + 1)  # (?i): flags only, no text
            if flags:
                pos = flags.end()
                return 0
            head = re.compile(r"\?(P?<\w+>|[a-zA-Z-]*:)").match(rx, pos + 1)
            pos = head.end() if head else pos + 1
            n = alternatives()
            if rx[pos] != ")":
                raise ValueError("unbalanced group")
            pos += 1
            return n
        if c == "[":
            pos = class_end(rx, pos)
            return 1
        if c == "\\":
            nxt = rx[pos + 1]
            pos += 2
            if nxt in "pPxuU" and rx.startswith("{", pos):
                pos = rx.index("}", pos) + 1
            elif nxt in "pP":
                pos += 1  # one-letter class name
            elif nxt == "x":
                pos += 2  # two hex digits
            return 0 if nxt in "bBAz<>" else 1  # word boundaries and anchors match no text
        pos += 1
        return 0 if c in "^$" else 1

    try:
        shortest = alternatives()
        return (shortest, biggest) if pos == len(rx) else (0, 0)
    except (IndexError, ValueError):
        return 0, 0


def class_end(rx: str, i: int) -> int:
    """The index past the character class that opens at rx[i] (classes nest: [a-z&&[^x]], [[:alpha:]])."""
    depth = 0
    while i < len(rx):
        if rx[i] == "\\":
            i += 2
            continue
        if rx[i] == "[":
            depth += 1
            i += 1 + rx.startswith("^", i + 1)
            i += rx.startswith("]", i)  # a ] first in a class is a literal
            continue
        i += 1
        if rx[i - 1] == "]":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unclosed class")


# ---- Lark: parts of a grammar that no finite text matches, and its shortest text -------------------------
# llguidance compiles `start: "x" start` or a rule needing a terminal whose regex matches nothing, then the
# output stops or fails in a dead end. The shortest text each rule derives is found as a least fixed point
# (inf: none); every rule and terminal reachable from start must derive some. The parser follows llguidance's
# Lark syntax as far as this needs; for anything else (templates, terminal operators) it refuses nothing.

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
    an atom ("lit", its length), ("re", literal), ("name", name) or a nested ("alt", ...)."""

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
            if self.at(".."):  # a range of characters
                self.take("..")
                self.take(kind="str")
                return ("lit", 1)
            try:  # llguidance reads Lark strings as JSON strings
                return ("lit", len(json.loads(text.removesuffix("i"))))
            except json.JSONDecodeError:
                return ("lit", 1)
        if kind == "re":
            return ("re", text)
        if kind in ("rule", "token"):
            if self.at("{") and not (self.peek(1) and (self.peek(1)[0] == "num" or self.peek(1)[1] == ",")):
                raise Unsupported("template")
            return ("name", text.lstrip("!?"))
        if kind in ("special", "ref") or text == "%json":  # a special token, another grammar, a JSON schema
            if text == "%json":
                self.take(kind="blob")
            return ("lit", 1)
        raise Unsupported(text)


def lark_check(text: str, shortest_match) -> tuple:
    """(the rules, terminals and regex literals reachable from start that no finite text matches, in the order
    they are reached; the length of the shortest text start derives; the largest repetition count written),
    ([], 0, largest count in its regex literals) for syntax this check does not follow. shortest_match(literal)
    is the shortest text a regex literal matches, inf when none."""
    try:
        toks = lark_tokens(text)
    except Unsupported:
        return [], 0, 0
    biggest = max((regex_sizes(t[1 : t.rindex("/")])[1] for kind, t in toks if kind == "re"), default=0)
    try:
        defs = LarkRules(text).defs
    except Unsupported:
        return [], 0, biggest
    if "start" not in defs:
        return [], 0, biggest
    reach, order = {"start"}, [("name", "start")]
    for node in order:  # breadth first over names and regex literals
        stack = [defs[node[1]]] if node[0] == "name" and node[1] in defs else []
        while stack:
            alt = stack.pop()
            for part, lo, hi in (p for expansion in alt[1] for p in expansion):
                biggest = max(biggest, lo, hi or 0)
                if part[0] == "alt":
                    stack.append(part)
                elif part[0] in ("name", "re") and part[1] not in reach:
                    reach.add(part[1])
                    order.append(part)
    regex_len = {part[1]: shortest_match(part[1]) for part in order if part[0] == "re"}
    best = dict.fromkeys(defs, math.inf)  # name -> the shortest text it derives; inf: none (yet)

    def length(part) -> float:
        if part[0] == "alt":
            return min(sum(lo * length(p) for p, lo, _ in expansion if lo) for expansion in part[1])
        if part[0] == "name":
            return best.get(part[1], 0)  # undefined: imported or declared, taken as matching something
        return regex_len[part[1]] if part[0] == "re" else part[1]

    shorter = True
    while shorter:  # lengths only shrink, so this ends; a name left at inf derives no finite text
        shorter = False
        for name, alt in defs.items():
            n = length(alt)
            if n < best[name]:
                best[name], shorter = n, True
    dead = [part[1] for part in order if (part[0] == "re" and regex_len[part[1]] == math.inf)
            or (part[0] == "name" and best.get(part[1], 0) == math.inf)]
    return dead, best["start"], biggest
