"""Watching speculation happen: each token's origin, --show-drafts and --trace, checked against the verdicts.

Greedy with a fixed γ on the shipped weights, so two runs give the same tokens and origins, and the trained MTP
head makes every origin occur (accepted drafts, corrections after a rejection, bonuses after a full accept).
"""
import ast
import json
import re
import subprocess
import sys

import pytest

from nano_spec import LLM, SamplingParams
from nano_spec.generate import ORIGINS, RESET, legend, show_drafts

PROMPTS = ["class Stack:\n    def push(self, x):\n        self.", "import os\n\ndef main():\n    for name in"]


def expected_from_reports(reports: list) -> dict:
    """seq id -> (tokens, origins) rebuilt from the step reports alone: the prefill's token, then per verify
    the accepted drafts and the target's pick, a bonus when every draft was accepted, else a correction."""
    seqs = {}
    for rep in reports:
        for seq_id, first in rep.admitted:
            seqs[seq_id] = ([first], ["prefill"])
        for r in rep.rows:
            tokens, origins = seqs[r.seq_id]
            assert r.na <= len(r.drafts) and r.emitted[: r.na] == r.drafts[: len(r.emitted[: r.na])]
            tokens += r.emitted
            origins += ["draft"] * min(r.na, len(r.emitted))
            if len(r.emitted) > r.na:  # the target's pick was emitted (a finishing token may come earlier)
                origins.append("bonus" if r.na == len(r.drafts) else "correction")
    return seqs


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_origins_follow_the_verdicts(proposer):
    reports = []
    llm = LLM(proposer=proposer, num_drafts=3, max_batch=2, backend="torch", on_step=reports.append)
    outs = llm.generate(PROMPTS + PROMPTS[:1], SamplingParams(max_new_tokens=40, ignore_eos=True))  # 3 > max_batch
    want = expected_from_reports(reports)
    assert [(o.token_ids, o.origins) for o in outs] == [want[i] for i in range(len(outs))]
    if proposer == "mtp":
        assert {"prefill", "draft", "correction", "bonus"} == {x for o in outs for x in o.origins}


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "nano_spec.generate", "--backend", "torch", "--proposer", "mtp",
                        "--num-drafts", "3", "--max-new-tokens", "32", *args], capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                         "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


def runs(tokenizer, token_ids, origins) -> list:
    """(origin, text) per maximal run of tokens of one origin, each run decoded on its own."""
    out = []
    for tok, origin in zip(token_ids, origins):
        if out and out[-1][0] == origin:
            out[-1][1].append(tok)
        else:
            out.append((origin, [tok]))
    return [(origin, tokenizer.decode(ids)) for origin, ids in out]


def test_show_drafts_marks_each_run_by_its_origin():
    (line,) = cli("--prompt", PROMPTS[0], "--json")[0].splitlines()
    row = json.loads(line)
    out, _ = cli("--prompt", PROMPTS[0], "--show-drafts")
    tok = LLM(max_batch=1, max_seq_len=64).tokenizer
    marked = "".join(f"{ORIGINS[o][1][0]}{text}{ORIGINS[o][1][1]}" for o, text in runs(tok, row["token_ids"],
                                                                                      row["origins"]))
    assert "\033" not in out  # NO_COLOR, and stdout is a pipe
    assert out == f"{legend(False)}\n--- {row['finish_reason']} ---\n{PROMPTS[0]}{marked}\n"
    assert {"draft", "correction", "bonus"} <= set(row["origins"])


def test_show_drafts_in_colour():
    llm = LLM(proposer="mtp", num_drafts=3, max_batch=1, max_seq_len=128, backend="torch")
    (o,) = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=32, ignore_eos=True))
    shown = show_drafts(llm.tokenizer, o, colour=True)
    assert re.sub(r"\033\[[0-9;]*m", "", shown) == o.text
    colours = re.findall(r"(\033\[[0-9;]*m)[^\033]+" + re.escape(RESET), shown)
    assert colours == [ORIGINS[origin][0] for origin, _ in runs(llm.tokenizer, o.token_ids, o.origins)]
    assert all(ORIGINS[name][0] in legend(True) for name in ORIGINS)


TRACE_ROW = re.compile(r"step (\d+) seq (\d+) drafts (\[.*\]) na (\d+) emitted (\[.*\])( finished: \w+)? \| (.+) ms")
TRACE_PREFILL = re.compile(r"step (\d+) seq (\d+) prefill -> (.+) \| (.+) ms")


def test_trace_has_one_line_per_step_and_sequence():
    out, err = cli("--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--json", "--trace", "--max-batch", "2")
    rows = [json.loads(line) for line in out.splitlines()]
    per_seq = {0: [], 1: []}
    for line in err.splitlines():
        if m := TRACE_PREFILL.fullmatch(line):
            per_seq[int(m[2])].append(("prefill", 0, 0, 1))
            assert "prefill" in m[4]
        elif m := TRACE_ROW.fullmatch(line):
            drafts, emitted = ast.literal_eval(m[3]), ast.literal_eval(m[5])
            per_seq[int(m[2])].append(("verify", len(drafts), int(m[4]), len(emitted)))
            assert "verify" in m[7] and "verdict" in m[7]
    for seq_id, row in enumerate(rows):
        lines = per_seq[seq_id]
        assert lines[0][0] == "prefill" and all(kind == "verify" for kind, *_ in lines[1:])
        assert sum(n for *_, n in lines) == len(row["token_ids"])  # every emitted token is on a trace line
        assert sum(min(na, n) for _, _, na, n in lines) == row["origins"].count("draft")
        assert all(na <= nd for _, nd, na, _ in lines)


def test_stats_tell_a_position_never_tried_from_one_never_accepted(capsys):
    """Under auto a planner that only ever picks γ <= 1 leaves drafts 2..4 untried: --stats says "not tried" there,
    while a tried position keeps its rate, however low."""
    from nano_spec.generate import print_stats

    llm = LLM(proposer="mtp", num_drafts="auto", max_batch=1)  # the shipped weights
    llm.scheduler.planner.choose = lambda B: 1
    out = llm.generate("def f(x):", SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    st = llm.stats
    assert st["drafted_at"][0] == st["verify_steps"] and st["drafted_at"][1:] == [0, 0, 0]
    print_stats(st, [out], 1.0)
    line = capsys.readouterr().err.splitlines()[0]
    assert f"accept_at [{st['accept_at'][0]:.3f}, not tried, not tried, not tried]" in line, line
