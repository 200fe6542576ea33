"""Arguments and checks of the command-line tools and scripts (python -m nano_spec.generate / nano_spec.bench,
scripts/train.py, scripts/train_mtp.py, scripts/train_dflash.py), each in a subprocess as a user runs it: a bad
argument is one line naming the flag and exit status 2, a failed check stays a failure under python -O, and nothing
is lost quietly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # the checkout's nano_spec: cwd = ROOT


def run(*args, timeout=300, **kw):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=ENV, **kw)
    return r.returncode, r.stdout, r.stderr


def assert_one_line_error(rc, err, flag, args=None):
    assert rc == 2, (args, rc, err)
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("scripts") / "tiny", seed=2)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "x = 1"]))
    return path


# ---- 5. the bench's identity check holds under python -O ----------------------------------------------------
BENCH_WITH_A_WRONG_ENGINE = """
import sys
from nano_spec import bench

assert sys.flags.optimize == int(sys.argv[1])
generate = bench.Engine.generate

def wrong(self, ids, max_new_tokens):  # the MTP configuration changes one token of its last output
    out = generate(self, ids, max_new_tokens)
    if self.proposer == "mtp" and max_new_tokens > 4:
        out[-1] = out[-1][:-1] + [out[-1][-1] ^ 1]
    return out

if sys.argv[2] == "corrupt":
    bench.Engine.generate = wrong
sys.exit(bench.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("optimize", [0, 1], ids=["plain", "python-O"])
def test_bench_refuses_outputs_that_differ(ckpt, prompts_file, optimize):
    args = ["--model", ckpt, "--prompts-file", prompts_file, "--max-new-tokens", 6, "--gammas", 2, "--batch", 2,
            "--no-ngram", "--no-auto", "--repeats", 1, "--backend", "torch"]
    flags = ["-O"] if optimize else []
    rc, out, err = run(*flags, "-c", BENCH_WITH_A_WRONG_ENGINE, optimize, "corrupt", *args)
    assert rc == 1, (rc, out[-500:], err[-2000:])
    assert err.strip().splitlines()[-1] == \
        "error: greedy outputs differ from plain: mtp γ=2 at batch 2, prompt 1, token 5"
    assert '"identical": true' not in out
    rc, out, err = run(*flags, "-c", BENCH_WITH_A_WRONG_ENGINE, optimize, "as-is", *args)  # the same, untouched
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["identical"] is True, err[-2000:]


# ---- 6. train_mtp.py --save-at replaces only what train_mtp.py wrote ---------------------------------------
CORPUS = "def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 40


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """A base without an MTP head, and a small corpus."""
    tmp = tmp_path_factory.mktemp("train_mtp")
    (tmp / "corpus.txt").write_text(CORPUS)
    return tiny_checkpoint(tmp / "base", seed=3, num_nextn_predict_layers=0), tmp / "corpus.txt"


def train_mtp(base, out, corpus, *extra):
    return run(ROOT / "scripts" / "train_mtp.py", "--base", base, "--out", out, "--corpus", corpus, "--steps", 2,
               "--seq-len", 16, "--batch", 2, "--threads", 1, "--eval-windows", 2, "--amp", "none", *extra)


def test_save_at_keeps_a_directory_it_did_not_write(headless, tmp_path):
    base, corpus = headless
    out = tmp_path / "out"
    unrelated = tmp_path / "out-0.0001min"  # --save-at 0.0001 is reached after the first step
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    rc, _, err = train_mtp(base, out, corpus, "--save-at", "0.0001")
    assert_one_line_error(rc, err, f"--save-at: {unrelated} exists and is not an output of train_mtp.py")
    assert (unrelated / "notes.txt").read_text() == "mine" and sorted(unrelated.iterdir()) == [unrelated / "notes.txt"]
    assert not out.exists()
    (tmp_path / "file-0.0001min").write_text("a file")
    rc, _, err = train_mtp(base, tmp_path / "file", corpus, "--save-at", "0.0001")
    assert_one_line_error(rc, err, "--save-at: ")
    assert (tmp_path / "file-0.0001min").read_text() == "a file"


def test_save_at_never_replaces_the_base(headless, tmp_path):
    base, corpus = headless
    import shutil

    copy = tmp_path / "m-0.0001min"  # a base whose name is the snapshot name of --out m
    shutil.copytree(base, copy)
    before = {f.name: f.read_bytes() for f in copy.iterdir()}
    rc, _, err = train_mtp(copy, tmp_path / "m", corpus, "--save-at", "0.0001")
    assert_one_line_error(rc, err, f"--save-at: {copy} must not be the base directory")
    assert {f.name: f.read_bytes() for f in copy.iterdir()} == before


def test_save_at_rewrites_its_own_snapshot(headless, tmp_path):
    """The control: a second run over the outputs of the first replaces them, snapshot included."""
    base, corpus = headless
    out = tmp_path / "out"
    for _ in range(2):
        rc, _, err = train_mtp(base, out, corpus, "--save-at", "0.0001")
        assert rc == 0, err[-2000:]
        for d in (out, tmp_path / "out-0.0001min"):
            assert (d / "mtp_train_log.json").is_file() and (d / "mtp.safetensors").is_file(), d


# ---- 7. training arguments: one line naming the flag, exit status 2, before anything runs ------------------
def load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BAD_COMMON = [  # (flag, value, what the message says) for every training script
    ("--lr", "nan", "finite number > 0"), ("--lr", "inf", "finite number > 0"), ("--lr", "0", "> 0"),
    ("--lr", "-1e-3", "> 0"), ("--threads", "0", "integer in [1, "), ("--threads", "abc", "integer in [1, "),
    ("--threads", "-2", "integer in [1, "), ("--threads", "100000", "integer in [1, "),
    ("--device", "foo", "not one of cpu, cuda"), ("--device", "meta", "not one of cpu, cuda"),
    ("--device", "cuda:7", "CUDA devices"), ("--log-every", "0", "integer in [1, "),
    ("--steps", "-1", "integer in [0, "),
    ("--batch", "0", "integer in [1, "), ("--min-lr-frac", "1.5", "<= 1"), ("--clip", "nan", "finite number"),
    ("--seed", "x", "integer in [0, "), ("--warmup", "2.5", "integer in [0, "),
]
BAD = {
    "train_mtp": BAD_COMMON + [("--minutes", "nan", "finite number > 0"), ("--minutes", "inf", "finite"),
                               ("--minutes", "0", "> 0"), ("--save-at", "nan", "finite number > 0"),
                               ("--save-at", "-5", "> 0"), ("--seq-len", "2", "integer in [3, "),
                               ("--unroll", "0", "integer in [1, "), ("--depth-decay", "nan", "finite"),
                               ("--corpus", "/nonexistent/corpus.txt", "does not exist")],
    "train_dflash": BAD_COMMON + [("--minutes", "nan", "finite number > 0"), ("--minutes", "inf", "finite"),
                                  ("--minutes", "0", "> 0"), ("--block", "1", "integer in [2, 64]"),
                                  ("--block", "65", "integer in [2, 64]"), ("--layers", "0", "integer in [1, 64]"),
                                  ("--layers", "x", "integer in [1, 64]"), ("--anchors", "0", "integer in [1, "),
                                  ("--decay", "nan", "finite number > 0"), ("--decay", "0", "> 0"),
                                  ("--taps", "", "distinct integers >= 0"), ("--taps", "1,1", "distinct integers"),
                                  ("--taps", "-1", "integers >= 0"), ("--taps", "a,b", "distinct integers"),
                                  ("--seq-len", "2", "integer in [3, "),
                                  ("--corpus", "/nonexistent/corpus.txt", "does not exist")],
    "train": BAD_COMMON + [("--max-minutes", "nan", "finite number > 0"), ("--max-minutes", "0", "> 0"),
                           ("--eval-every", "0", "integer in [1, "), ("--layers", "mx", "letters m"),
                           ("--layers", "", "letters m"), ("--seq-len", "1", "integer in [2, ")],
}
REQUIRED = {"train_mtp": ["--base", "b", "--out", "o"], "train_dflash": ["--base", "b", "--out", "o"],
            "train": ["--out", "o"]}
CASES = [(script, *case) for script, cases in BAD.items() for case in cases]


@pytest.mark.parametrize("script, flag, value, message", CASES, ids=[f"{c[0]} {c[1]} {c[2]}" for c in CASES])
def test_bad_training_arguments_are_one_line(script, flag, value, message, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as e:
        module.parse_args(REQUIRED[script] + [f"{flag}={value}"])  # the = form: values such as -1e-3
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: argument {flag}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("script", sorted(REQUIRED))
@pytest.mark.parametrize("value", ["1e300", "3.5e37", "1.1e30"])
def test_lr_too_large_for_adamw_is_one_line(script, value, capsys):
    """An --lr from ~3.4e37 up made AdamW's first step raise (its fp32 step size lr / (1 - beta1) overflows): a
    traceback. Every training script refuses an --lr above 1e30 while parsing; 1e30 itself parses (it trains and
    fails as diverged, exit 1: the diverged-run tests of test_train*.py)."""
    module = load_script(script)
    with pytest.raises(SystemExit) as e:
        module.parse_args(REQUIRED[script] + ["--lr", value])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == f"error: argument --lr: must be a finite number > 0 and <= 1e+30, got {value!r}\n"
    assert module.parse_args(REQUIRED[script] + ["--lr", "1e30"]).lr == 1e30


@pytest.mark.parametrize("script, argv, message", [
    ("train_mtp", ["--seq-len", "16", "--unroll", "15"],
     "argument --unroll: must be at most --seq-len - 2 = 14, got 15"),
    ("train_dflash", ["--seq-len", "16", "--block", "8", "--anchors", "9"],
     "argument --anchors: must be at most the 8 places a block fits, got 9"),
    ("train_dflash", ["--seq-len", "8", "--block", "8", "--anchors", "1"],
     "argument --seq-len: must be more than --block = 8, got 8"),
], ids=["unroll", "anchors", "block"])
def test_more_than_the_window_holds_is_one_line(script, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(script).parse_args(REQUIRED[script] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {message}\n"


@pytest.mark.parametrize("script, argv, want", [
    ("train_mtp", ["--threads", "1", "--lr", "3e-3", "--device", "cpu", "--minutes", "0.5", "--save-at", "1", "2.5",
                   "--seq-len", "16", "--unroll", "14"],
     dict(threads=1, lr=3e-3, device="cpu", minutes=0.5, save_at=[1.0, 2.5], unroll=14)),
    ("train_mtp", [], dict(threads="auto", device="cpu", minutes=30.0)),
    ("train", ["--threads", "auto", "--max-minutes", "1", "--layers", "ma", "--device", "auto"],
     dict(threads="auto", max_minutes=1.0, layers="ma", device="cpu")),
    ("train_dflash", ["--taps", "3,1", "--block", "16", "--anchors", "4", "--seq-len", "20", "--decay", "2"],
     dict(taps=[3, 1], block=16, anchors=4, seq_len=20, decay=2.0)),
    ("train_dflash", [], dict(threads="auto", device="cpu", minutes=30.0, block=8, layers=2, taps=None, anchors=16,
                              decay=4.0, seq_len=512, batch=8, amp="bf16")),
], ids=["train_mtp-values", "train_mtp-defaults", "train-values", "train_dflash-values", "train_dflash-defaults"])
def test_good_training_arguments_parse(script, argv, want, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # auto: the CPU here
    args = vars(load_script(script).parse_args(REQUIRED[script] + argv))
    assert {k: args[k] for k in want} == want


def test_corpus_it_cannot_use_is_one_line(headless, tmp_path):
    """A binary file, an empty one, a directory without text, a corpus shorter than one window: exit 2, one line
    naming --corpus, nothing written."""
    base, _ = headless
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.bin").write_bytes(b"\xff\xfe\x00" * 10)
    (tmp_path / "short.txt").write_text("x = 1\n")
    for corpus, message in [("binary.bin", "--corpus: no UTF-8 text in"), ("empty.txt", "--corpus: no UTF-8 text"),
                            ("dir", "--corpus: no UTF-8 text"), ("short.txt", "--corpus: fewer than 17 tokens")]:
        rc, _, err = train_mtp(base, tmp_path / "out", tmp_path / corpus)
        assert_one_line_error(rc, err, message, corpus)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["scripts/train.py", "--out", "o", "--max-minutes", "nan"],
                                  ["scripts/train_mtp.py", "--base", "b", "--out", "o", "--minutes", "nan"],
                                  ["scripts/train_dflash.py", "--base", "b", "--out", "o", "--minutes", "nan"]],
                         ids=["train", "train_mtp", "train_dflash"])
def test_nan_minutes_end_at_once(argv):
    """`--minutes nan` trained forever (no comparison with NaN is true); now it is refused as the user runs it."""
    rc, _, err = run(*argv)  # a run that trained forever would meet the timeout: the test still fails
    assert_one_line_error(rc, err, "minutes: must be a finite number > 0, got 'nan'")


# ---- 8. the CLI does not change its input quietly -----------------------------------------------------------
def generate(*args, **kw):
    return run("-m", "nano_spec.generate", *args, **kw)


@pytest.mark.parametrize("content", [b"", b"\n  \n\t\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n \n"],
                         ids=["empty", "blank", "bom-only", "bom-blank"])
def test_prompts_file_without_prompts_is_refused(ckpt, tmp_path, content):
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    rc, out, err = generate("--model", ckpt, "--prompts-file", path, "--max-new-tokens", 2)
    assert_one_line_error(rc, err, f"--prompts-file: {path} holds no prompts")
    assert out == ""  # nothing generated, not the demo prompt


@pytest.mark.parametrize("lines, want", [
    (['{"prompt": "x = 1"}', '{"prompt": "def f(x):"}'], ["x = 1", "def f(x):"]),
    (["x = 1", '{"prompt": "def f(x):"}'], ["x = 1", "def f(x):"]),
], ids=["jsonl", "text-then-jsonl"])
def test_prompts_file_with_a_byte_order_mark(ckpt, tmp_path, lines, want):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    rc, out, err = generate("--model", ckpt, "--prompts-file", path, "--max-new-tokens", 2, "--json")
    assert rc == 0, err
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == want


def test_bench_prompts_file_with_a_byte_order_mark(tmp_path):
    import argparse

    from nano_spec.bench import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "x = 1"}\n{"prompt": "y"}\n')
    assert load_prompts(argparse.Namespace(prompts_file=str(path), num_prompts=16), tmp_path) == ["x = 1", "y"]


# ---- 9. one-line errors, not tracebacks; a closed pipe and Ctrl-C end quietly --------------------------------
def test_undecodable_prompt_bytes_are_one_line(ckpt):
    """Bytes that are not UTF-8 in argv reach Python as lone surrogates."""
    r = subprocess.run([sys.executable, "-m", "nano_spec.generate", "--model", str(ckpt), "--prompt", b"ab\xff"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert_one_line_error(r.returncode, r.stderr, "prompt: not valid Unicode: lone surrogate '\\udcff' at index 2")
    assert r.stdout == ""


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "--num-prompts: must be an integer >= 1, got 0"),
    (["--num-prompts", "-1"], "--num-prompts: must be an integer >= 1, got -1"),  # was: all prompts but the last
], ids=["zero", "negative"])
def test_bench_num_prompts(ckpt, prompts_file, flags, message):
    rc, out, err = run("-m", "nano_spec.bench", "--model", ckpt, "--prompts-file", prompts_file, *flags)
    assert_one_line_error(rc, err, message)


@pytest.mark.parametrize("line, kind", [('{"prompt": 5}', "int"), ('{"prompt": null}', "NoneType"),
                                        ('{"prompt": ["def"]}', "list"), ('{"prompt": {"a": 1}}', "dict")])
def test_bench_prompts_that_are_not_strings(ckpt, tmp_path, line, kind):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x = 1"}\n\n' + line + "\n")
    rc, out, err = run("-m", "nano_spec.bench", "--model", ckpt, "--prompts-file", path)
    assert_one_line_error(rc, err, f"--prompts-file: line 3 of {path}: 'prompt' must be a string, got {kind}")


@pytest.mark.parametrize("flags", [["--prompt", "def f(x):"], ["--prompt", "a", "--prompt", "b", "--json"]],
                         ids=["stream", "json"])
def test_closed_pipe_ends_quietly(ckpt, flags):
    """`... | head -1`: the reader is gone before the first line; the status is that of a tool SIGPIPE ended."""
    proc = subprocess.Popen([sys.executable, "-m", "nano_spec.generate", "--model", str(ckpt), "--max-new-tokens",
                             "8", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=ENV)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", err


def test_json_output_equals_the_api(ckpt, tmp_path):
    """The CLI collects each output as its request finishes (so Ctrl-C keeps the finished ones); its --json
    output is what LLM.generate gives, with slots reused (5 requests, 2 slots)."""
    from nano_spec import LLM, SamplingParams

    prompts = ["def f(x):", "x = 1", "for i in", "héllo", "print("]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    rc, out, err = generate("--model", ckpt, "--prompts-file", path, "--max-new-tokens", 12, "--max-batch", 2,
                            "--num-drafts", 3, "--backend", "torch", "--json")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    want = LLM(ckpt, backend="torch", max_batch=2, num_drafts=3).generate(prompts, SamplingParams(max_new_tokens=12))
    assert [(r["prompt"], r["token_ids"], r["origins"], r["finish_reason"], r["text"]) for r in rows] == \
        [(p, o.token_ids, o.origins, o.finish_reason, o.text) for p, o in zip(prompts, want)]


GENERATE_THAT_WAITS_FOR_CTRL_C = """
import signal, sys
from nano_spec import generate

tracer = generate.tracer

def waiting_tracer(tok):  # after the step that finished request 0, wait for the parent's SIGINT
    trace = tracer(tok)
    def on_step(report):
        if any(r.seq_id == 0 and r.finish_reason for r in report.rows):
            # SIGINT stays pending from before the parent can read the line until sigwait takes it, so it cannot
            # land between a check and a pause (signal.pause() then waits for a second one: a hang under load)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            trace(report)
            sys.stderr.flush()
            signal.sigwait({signal.SIGINT})
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            signal.raise_signal(signal.SIGINT)  # Ctrl-C's own path: the handler raises KeyboardInterrupt here
        else:
            trace(report)
    return on_step

generate.tracer = waiting_tracer
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's handler, even where the parent ignores SIGINT
sys.exit(generate.main(sys.argv[1:]))
"""


def test_ctrl_c_prints_the_requests_that_finished(ckpt, tmp_path):
    """Two requests: the first fills max_seq_len within a few tokens, the second would run for hundreds of steps.
    The child stops after the step that finished the first, so Ctrl-C always lands while the second runs: the
    first's JSON line is printed, the other is not, exit status 130, no traceback."""
    import signal

    from tokenizers import Tokenizer

    limit = 400
    line_tokens = len(Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode("x = 1\n" * 100).ids) // 100
    long_prompt = "x = 1\n" * ((limit - 10) // line_tokens)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": long_prompt}) + "\n" + json.dumps({"prompt": "def f(x):"}) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", GENERATE_THAT_WAITS_FOR_CTRL_C, "--model", str(ckpt),
                             "--prompts-file", str(path), "--max-seq-len", str(limit), "--max-new-tokens", str(limit),
                             "--regex", "[a-z]{5000}", "--json", "--trace", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    seen = []
    while not seen or not (seen[-1].startswith("step ") and " seq 0 " in seen[-1] and "finished: length" in seen[-1]):
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen[-20:])  # the process ended before the first request finished
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt"], r["finish_reason"]) for r in rows] == [(long_prompt, "length")]
    assert err.strip().splitlines()[-1] == "interrupted: 1 of 2 requests had finished" and "Traceback" not in err


# ---- 10. --threads of the CLIs has an upper bound -----------------------------------------------------------
@pytest.mark.parametrize("module", ["nano_spec.generate", "nano_spec.bench"], ids=["generate", "bench"])
@pytest.mark.parametrize("threads", ["100000", "0"])
def test_cli_threads_are_bounded(ckpt, prompts_file, module, threads):
    rc, out, err = run("-m", module, "--model", ckpt, "--prompts-file", prompts_file, "--threads", threads)
    assert_one_line_error(rc, err, f"--threads: must be an integer in [1, {4 * os.cpu_count()}] (4 per CPU core), "
                                   f"got {threads}")
