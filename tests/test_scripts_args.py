"""Arguments and checks of the command-line tools and scripts (python -m nano_spec.generate / nano_spec.bench,
scripts/train.py, scripts/train_mtp.py), each in a subprocess as a user runs it: a bad argument is one line
naming the flag and exit status 2, a failed check stays a failure under python -O, and nothing is lost quietly."""
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
    assert err.strip().splitlines()[-1] == "error: greedy outputs differ from plain: mtp γ=2 at batch 2, prompt 1"
    assert '"identical": true' not in out
    rc, out, err = run(*flags, "-c", BENCH_WITH_A_WRONG_ENGINE, optimize, "as-is", *args)  # the same, untouched
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["identical"] is True, err[-2000:]
