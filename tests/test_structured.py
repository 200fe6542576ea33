"""Structured output (json_schema / regex / grammar) with speculative decoding, on a small random-weight model.

- lossless: constrained greedy output with drafts == constrained greedy output with γ = 0 (MTP, n-gram, several
  γ, constrained and free requests in one batch, slots reused);
- valid: every output that finished with "stop" parses and has the schema's keys and types, or fullmatches its
  regex, and the grammar accepts exactly the emitted tokens;
- exact: sampled constrained output follows the masked target distribution (chi-square against enumeration),
  and the test rejects a plausible wrong distribution;
- bad input: one ValueError naming the field, nothing queued; CLI exit 2.
"""
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from helpers import tiny_checkpoint
from nano_spec_kernels.verdict_greedy import unpack_bitmask
from nano_spec import LLM, SamplingParams
from nano_spec.reference import filtered

XG = {"x-guidance": {"whitespace_flexible": False}}  # compact JSON: a random model wanders in free whitespace
SCHEMAS = [  # (schema, check of a parsed output)
    (dict({"type": "object", "additionalProperties": False, "required": ["id", "ok", "kind"],
           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                          "kind": {"enum": ["a", "b", "c"]}}}, **XG),
     lambda v: isinstance(v["id"], int) and 0 <= v["id"] <= 999 and isinstance(v["ok"], bool)
     and v["kind"] in "abc" and len(v) == 3),
    (dict({"type": "object", "additionalProperties": False, "required": ["name", "tags", "pos"],
           "properties": {"name": {"type": "string", "maxLength": 6},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
                          "pos": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                                  "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}, **XG),
     lambda v: isinstance(v["name"], str) and len(v["name"]) <= 6 and len(v["tags"]) <= 3
     and all(isinstance(t, str) and len(t) <= 3 for t in v["tags"])
     and all(isinstance(v["pos"][k], (int, float)) and not isinstance(v["pos"][k], bool) for k in "xy")),
    (dict({"type": "object", "additionalProperties": False, "required": ["code", "vals"],
           "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                          "vals": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                   "minItems": 1, "maxItems": 4}}}, **XG),
     lambda v: re.fullmatch("[A-Z]{2}[0-9]{2}", v["code"]) and 1 <= len(v["vals"]) <= 4
     and all(isinstance(x, int) and -5 <= x <= 5 for x in v["vals"])),
]
REGEXES = [r"[0-9]{1,4}(\.[0-9]{1,2})?", r"(yes|no|maybe)", r"(def|class) [a-z_]{1,8}\(\):"]
PROMPTS = ["def f(x):", "for i in range(10):\n", "h", "héllo", "x = 1\n", "print(", "return x", "wörld ✓"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("structured") / "tiny", seed=5)


def mixed_requests():
    """Constrained (three schemas, a regex, a Lark grammar) and free requests in one list."""
    lark = 'start: "x = " NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/'
    params = [SamplingParams(max_new_tokens=100, json_schema=s) for s, _ in SCHEMAS]
    params += [SamplingParams(max_new_tokens=40, regex=REGEXES[2]), SamplingParams(max_new_tokens=40, grammar=lark),
               SamplingParams(max_new_tokens=20, ignore_eos=True), SamplingParams(max_new_tokens=20, ignore_eos=True)]
    return PROMPTS[: len(params)], params


@pytest.fixture(scope="module")
def plain(ckpt):
    prompts, params = mixed_requests()
    return [o.token_ids for o in LLM(ckpt, proposer="none", num_drafts=0, max_batch=3).generate(prompts, params)]


@pytest.mark.parametrize("proposer, gamma, max_batch", [("mtp", 1, 3), ("mtp", 3, 2), ("mtp", 4, 8), ("ngram", 3, 3)],
                         ids=lambda v: str(v))
def test_constrained_greedy_is_lossless(ckpt, plain, proposer, gamma, max_batch):
    """Same tokens as γ = 0; max_batch < requests, so slots are reused; free requests share the batches."""
    prompts, params = mixed_requests()
    llm = LLM(ckpt, proposer=proposer, num_drafts=gamma, max_batch=max_batch)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert all(o.finish_reason == "stop" for o in outs[:5]), [o.finish_reason for o in outs]
    st = llm.stats
    c = st["constrained"]
    assert 0 < c["verify_steps"] < st["verify_steps"], "constrained steps are counted on their own"
    assert c["tau"] == pytest.approx(1 + sum(c["accept_at"]), abs=1e-12)
    if proposer == "mtp":
        assert c["accept_at"][0] > 0, "drafts made under the mask get accepted"
    assert st["grammars_compiled"] == 5 and st["grammar_compile_seconds"] > 0


def test_free_batches_build_no_masks(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=4)
    llm.generate(PROMPTS[:4], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert sum(llm.stats["phase_histogram_ms"]["mask"]) == 0
    llm.generate(PROMPTS[:4], [SamplingParams(max_new_tokens=12, regex="[a-z]{20}")] +
                 [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 3)
    assert sum(llm.stats["phase_histogram_ms"]["mask"]) > 0


def test_outputs_are_valid(ckpt):
    """Every output that finished with "stop" parses with the schema's keys and types, or fullmatches its regex,
    and a fresh matcher accepts exactly its tokens and is then complete; most outputs do finish."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=8)
    checked = total = 0
    for (schema, check), temperature in [(s, t) for s in SCHEMAS for t in (0.0, 0.9)]:
        params = SamplingParams(max_new_tokens=120, json_schema=schema, temperature=temperature, seed=3)
        for o in llm.generate(PROMPTS, params):
            total += 1
            if o.finish_reason == "stop":
                assert check(json.loads(o.text)), o.text
                assert_grammar_accepts(llm, params, o.token_ids)
                checked += 1
    for rx, temperature in [(r, t) for r in REGEXES for t in (0.0, 0.9)]:
        params = SamplingParams(max_new_tokens=40, regex=rx, temperature=temperature, seed=4)
        for o in llm.generate(PROMPTS, params):
            total += 1
            if o.finish_reason == "stop":
                assert re.fullmatch(rx, o.text), (rx, o.text)
                assert_grammar_accepts(llm, params, o.token_ids)
                checked += 1
    assert checked >= 0.8 * total, f"only {checked} of {total} outputs finished"


def assert_grammar_accepts(llm, params, tokens):
    c = llm.grammars.constraint(params)
    assert c.valid_prefix(tokens) == len(tokens)
    for t in tokens:
        assert c.consume(t)
    assert c.stopped


def test_padding_ids_are_never_allowed(ckpt):
    """A model vocabulary larger than the tokenizer's: the extra ids (embedding padding) stay masked."""
    from nano_spec.text.grammar import Grammars

    llm = LLM(ckpt, proposer="none", num_drafts=0)
    n_tok = llm.tokenizer._tok.get_vocab_size()
    V = n_tok + 45  # not a multiple of 32
    g = Grammars(ckpt / "tokenizer.json", V, llm.tokenizer.eos_ids)
    c = g.constraint(SamplingParams(regex="(.|\n){0,3}"))
    for tok in [None, *llm.tokenizer.encode("ab\n")]:
        if tok is not None:
            assert c.consume(tok)
        allowed = unpack_bitmask(c.mask(), V)
        assert allowed[:n_tok].any() and not allowed[n_tok:].any()


# ---------------------------------------------------------------- exact distribution

REGEX = "([bc][jk][mq]|vz)"  # letters the tiny tokenizer never merged: one byte, one token, each
N_REQ, PARAMS = 1500, dict(temperature=1.0, top_p=0.97)


def chi2(counts: dict, probs: dict, n: int) -> tuple:
    """Pearson's statistic over the cells expected >= 5 times (the rest pooled) and its degrees of freedom."""
    cells = [k for k in probs if probs[k] * n >= 5]
    stat = sum((counts.get(k, 0) - n * probs[k]) ** 2 / (n * probs[k]) for k in cells)
    rare_p, rare_c = 1 - sum(probs[k] for k in cells), n - sum(counts.get(k, 0) for k in cells)
    if rare_p * n >= 5:
        stat, cells = stat + (rare_c - n * rare_p) ** 2 / (n * rare_p), cells + ["rare"]
    df = len(cells) - 1
    return stat, df, df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # critical value, p = 0.999


@torch.no_grad()
def enumerate_outputs(llm, prompt: list, masked: bool) -> dict:
    """P(output tokens) by walking every path the grammar allows, with the no-cache forward. masked: each token
    from the target filtered among the allowed tokens (what the engine must produce). Not masked: the whole
    output from the unmasked target, renormalised over the grammar's outputs (a plausible wrong answer)."""
    c, V, out = llm.grammars.constraint(SamplingParams(regex=REGEX)), llm.model.cfg.vocab_size, {}

    def walk(path, prob):
        if c.stopped:
            out[tuple(path)] = prob
            return
        logits = llm.model(torch.tensor(prompt + path, device=llm.runner.device)[None])[0, -1]
        allowed = unpack_bitmask(c.mask(), V)
        p = filtered(logits.masked_fill(~allowed, float("-inf")) if masked else logits, **PARAMS, top_k=0)
        for t in allowed.nonzero()[:, 0].tolist():
            assert c.consume(t)
            walk(path + [t], prob * float(p[t]))
            c.rollback(1)

    walk([], 1.0)
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


@pytest.mark.parametrize("gamma", [0, 3], ids=["plain", "mtp-gamma3"])
def test_sampled_constrained_output_follows_the_masked_target(ckpt, gamma):
    llm = LLM(ckpt, proposer="mtp" if gamma else "none", num_drafts=gamma, max_batch=64)
    prompt = llm.tokenizer.encode("def f(x):")
    exact = enumerate_outputs(llm, prompt, masked=True)
    assert len(exact) == 9 and max(exact.values()) < 0.6, "a non-trivial distribution over the 9 outputs"
    outs = llm.generate([prompt] * N_REQ, [SamplingParams(max_new_tokens=8, seed=i, regex=REGEX, **PARAMS)
                                           for i in range(N_REQ)])
    assert all(o.finish_reason == "stop" for o in outs)
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    stat, df, crit = chi2(counts, exact, N_REQ)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"
    if gamma:
        c = llm.stats["constrained"]["accept_at"]
        assert 0 < c[0] < 1, "drafts are both accepted and rejected"
    # negative control: the same samples against the unmasked target renormalised over whole outputs
    wrong = enumerate_outputs(llm, prompt, masked=False)
    stat, df, crit = chi2(counts, wrong, N_REQ)
    assert stat > crit, "the test cannot tell the masked target from the renormalised unmasked one"


# ---------------------------------------------------------------- bad input

def test_bad_constraints_name_the_field(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=2)
    cases = [(dict(json_schema={"type": "foo"}), "SamplingParams.json_schema: invalid .*Invalid type"),
             (dict(json_schema="{not json"), "SamplingParams.json_schema: invalid"),
             (dict(json_schema={"type": "object", "default": {1, 2}}), "SamplingParams.json_schema: invalid"),
             (dict(regex="(ab"), "SamplingParams.regex: invalid .*unclosed group"),
             (dict(grammar="start: foo"), 'SamplingParams.grammar: invalid .*unknown name: "foo"')]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(["x = 1", "h"], [SamplingParams(), SamplingParams(**kw)])  # the good one is not queued
        assert not llm.scheduler.has_work() and len(llm.scheduler.free_slots) == llm.runner.cache.num_slots
    with pytest.raises(ValueError, match="SamplingParams.regex: json_schema and regex given; use at most one"):
        SamplingParams(json_schema={"type": "integer"}, regex="[0-9]+")
    with pytest.raises(ValueError, match="SamplingParams.grammar: must be None or a Lark grammar string"):
        SamplingParams(grammar=5)


def test_cli_structured_output(ckpt, tmp_path):
    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "nano_spec.generate", "--model", str(ckpt), *map(str, args)],
                           capture_output=True, text=True, timeout=300,
                           env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        return r.returncode, r.stdout, r.stderr

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[0][0]))
    rc, out, err = cli("--json-schema", schema, "--prompt", "x", "--max-new-tokens", 60, "--json")
    assert rc == 0, err
    assert SCHEMAS[0][1](json.loads(json.loads(out)["text"]))
    (tmp_path / "bad.json").write_text('{"type": "foo"}')
    (tmp_path / "bad.lark").write_text("start: foo")
    (tmp_path / "notjson.json").write_text("{")
    cases = {("--json-schema", tmp_path / "bad.json"): "SamplingParams.json_schema: invalid",
             ("--json-schema", tmp_path / "notjson.json"): "--json-schema: ",
             ("--json-schema", tmp_path / "missing.json"): "--json-schema: cannot read",
             ("--grammar", tmp_path / "bad.lark"): "SamplingParams.grammar: invalid",
             ("--regex", "(", "--grammar", tmp_path / "bad.lark"): "use at most one"}
    for args, message in cases.items():
        rc, out, err = cli(*args)
        assert rc == 2 and message in err and "Traceback" not in err and not out, (args, err)


def test_bench_under_a_schema(ckpt, tmp_path):
    prompts, schema = tmp_path / "p.jsonl", tmp_path / "s.json"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    schema.write_text(json.dumps(SCHEMAS[0][0]))
    r = subprocess.run([sys.executable, "-m", "nano_spec.bench", "--model", str(ckpt), "--prompts-file", str(prompts),
                        "--json-schema", str(schema), "--max-new-tokens", "40", "--gammas", "2", "--batch", "2",
                        "--no-ngram", "--no-auto", "--repeats", "1", "--backend", "torch"],
                       capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rows = {row["config"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"plain", "mtp γ=2", "plain +schema", "mtp γ=2 +schema"}
    s = rows["mtp γ=2 +schema"]
    assert s["tau"] > 1 and s["speedup"] > 0 and s["mask_ms_per_step"] > 0 and s["grammar_compile_s"] > 0
    assert rows["mtp γ=2"]["mask_ms_per_step"] is None and "vs plain +schema" in r.stdout
