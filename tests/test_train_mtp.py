"""scripts/train_mtp.py: an MTP head trained for a frozen base that has none, stored beside the untouched base."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import load_script, tiny_checkpoint
from nano_spec.engine.llm import LLM
from nano_spec.model.sampling import SamplingParams
from nano_spec.model.model import load_model

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 40


def train_mtp(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_mtp.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_mtp")
    base = tiny_checkpoint(tmp / "base", seed=3, num_nextn_predict_layers=0)
    (tmp / "corpus.txt").write_text(CORPUS)
    out = tmp / "out"
    proc = train_mtp("--base", base, "--out", out, "--corpus", tmp / "corpus.txt", "--steps", 4, "--seq-len", 16,
                     "--batch", 2, "--threads", 1, "--eval-windows", 2, "--amp", "none", "--lr", "3e-3", "--warmup", 1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return base, out, proc.stderr


def test_output_is_the_untouched_base_plus_a_head(trained):
    base, out, log = trained
    assert "mtp.layer initialised from model.layers.1" in log  # the tiny base's only attention layer
    assert "tok/s" in log
    for f in base.iterdir():
        if f.name != "config.json":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name  # bit-identical base files
    cfg_base, cfg_out = (json.loads((d / "config.json").read_text()) for d in (base, out))
    assert cfg_base["num_nextn_predict_layers"] == 0 and cfg_out.pop("num_nextn_predict_layers") == 1
    assert cfg_out == {k: v for k, v in cfg_base.items() if k != "num_nextn_predict_layers"}
    with safe_open(str(out / "mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    model = load_model(out)
    assert names == {n for n in model.state_dict() if n.startswith("mtp.")}
    assert json.loads((out / "mtp_train_log.json").read_text())["steps"] == 4


def test_base_frozen_head_trained(trained):
    base, out, _ = trained
    ours, ref = load_model(out).state_dict(), load_model(base).state_dict()
    for n, t in ref.items():
        assert torch.equal(ours[n], t), n
    src, head = ref["model.layers.1.self_attn.q_proj.weight"], ours["mtp.layer.self_attn.q_proj.weight"]
    assert not torch.equal(src, head) and torch.allclose(src, head, atol=0.1)  # started as the copy, then trained


def test_engine_runs_the_trained_head_losslessly(trained):
    base, out, _ = trained
    prompts = ["def f(x):\n", "for i in range(3):\n    print("]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    kw = dict(backend="torch", device="cpu", max_batch=2, max_seq_len=64)
    plain = LLM(base, proposer="none", **kw).generate(prompts, params)
    llm = LLM(out, proposer="mtp", num_drafts=3, **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.stats["verify_steps"] > 0


def test_refusals_name_the_problem(trained, tmp_path, capsys):
    script = load_script("train_mtp")
    base, out, _ = trained
    for args, message in [(["--base", out, "--out", tmp_path / "again"], "num_nextn_predict_layers: "),  # has a head
                          (["--base", base, "--out", base / "inside"], "--out: "),
                          (["--base", tmp_path, "--out", tmp_path / "x"], "--base: ")]:
        assert script.main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_init_head_refusals_are_one_line(tmp_path, capsys):
    """--init-head that is missing, not a checkpoint, headless or of another shape: exit 2, one line naming the flag."""
    script = load_script("train_mtp")
    base = tiny_checkpoint(tmp_path / "base", seed=3, num_nextn_predict_layers=0)
    wide = tiny_checkpoint(tmp_path / "wide", seed=4, num_nextn_predict_layers=1, hidden_size=96)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
    for init, message in [(tmp_path / "missing", "not a checkpoint directory"),
                          (tmp_path / "junk", "no config.json"),
                          (tmp_path / "junk" / "notes.txt", "not a checkpoint directory"),
                          (base, "has no MTP head"),
                          (wide, "does not fit the base")]:
        argv = ["--base", base, "--out", tmp_path / "out", "--init-head", init, "--corpus", tmp_path / "corpus.txt",
                "--steps", 1, "--seq-len", 16, "--batch", 2, "--threads", 1, "--eval-windows", 2, "--amp", "none"]
        assert script.main([str(a) for a in argv]) == 2, init
        err = capsys.readouterr().err
        assert err.startswith("error: --init-head: ") and message in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def files(d: Path) -> dict:
    return {f.name: f.read_bytes() for f in d.iterdir()}


def tiny_run(base, out, corpus):
    return [str(a) for a in ["--base", base, "--out", out, "--corpus", corpus, "--steps", 3, "--seq-len", 16,
                             "--batch", 2, "--threads", 1, "--eval-windows", 2, "--amp", "none", "--warmup", 1]]


def test_diverged_run_fails_and_keeps_the_earlier_output(trained, tmp_path, capsys):
    """--lr 1e30 blows the head up: exit 1 with one line saying so, and the earlier output is left byte for byte."""
    script = load_script("train_mtp")
    base, out, _ = trained
    earlier = Path(shutil.copytree(out, tmp_path / "out"))
    before = files(earlier)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    assert script.main(tiny_run(base, earlier, tmp_path / "corpus.txt") + ["--lr", "1e30"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "non-finite" in last and "--lr" in last, last
    assert files(earlier) == before and sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]


def test_out_symlink_is_refused_before_training(trained, tmp_path, capsys):
    """--out a symbolic link to an earlier output: exit 2 and one line naming --out before anything trains."""
    script = load_script("train_mtp")
    base, out, _ = trained
    before = files(out)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    assert script.main(tiny_run(base, link, tmp_path / "corpus.txt")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out: ") and len(err.strip().splitlines()) == 1, err
    assert link.is_symlink() and files(out) == before
