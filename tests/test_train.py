"""The chunked SSD scan used for training equals the recurrent reference, the training script runs end to end, and
the training scripts' output swap leaves the old output or the new one whatever interrupts it."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_spec_kernels.mamba_scan import mamba_scan_ref
from nano_spec.model.ssd import mamba_scan_chunked
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[1]


def scan_inputs(T, H, P, N, G, W=4, seed=0, bias=True):
    """xBC (T, C), dt (T, H) and the layer weights, with A, dt spread so decays matter inside a chunk."""
    g = torch.Generator().manual_seed(seed)
    C = H * P + 2 * G * N
    return dict(xBC=torch.randn(T, C, generator=g), dt=torch.randn(T, H, generator=g),
                conv_weight=torch.randn(C, W, generator=g) / W ** 0.5,
                conv_bias=torch.randn(C, generator=g) if bias else None,
                dt_bias=torch.randn(H, generator=g) - 1, A_log=torch.rand(H, generator=g) * 2.5,
                D=torch.randn(H, generator=g), n_groups=G, head_dim=P)


@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_ssd_equals_recurrent_reference(T, G, dt_limit):
    kw = scan_inputs(T, H=4, P=5, N=7, G=G)
    y_ref, s_ref, w_ref = mamba_scan_ref(**kw, dt_limit=dt_limit)
    for chunk in (16, 64):  # T = 63, 200: a partial last chunk; T = 1: one padded chunk
        y, s, w = mamba_scan_chunked(**kw, dt_limit=dt_limit, chunk_size=chunk)
        assert s.dtype == torch.float32
        assert_close(f"y T={T} G={G} l={chunk}", y_ref, y)
        assert_close(f"ssm state T={T} G={G} l={chunk}", s_ref, s)
        assert_close(f"conv window T={T} G={G} l={chunk}", w_ref, w, atol=0)


def test_ssd_without_conv_bias_and_short_prompt():
    kw = scan_inputs(2, H=2, P=3, N=5, G=1, bias=False)  # T < W-1: the window is zero-padded
    for ref, out in zip(mamba_scan_ref(**kw), mamba_scan_chunked(**kw, chunk_size=8)):
        assert_close("T=2", ref, out)


def test_ssd_gradients_flow():
    kw = scan_inputs(70, H=4, P=5, N=7, G=2)
    names = ("xBC", "dt", "conv_weight", "conv_bias", "dt_bias", "A_log", "D")
    for n in names:
        kw[n] = kw[n].double().requires_grad_()
    y, s, _ = mamba_scan_chunked(**kw, dt_limit=(0.0, float("inf")), chunk_size=16)
    (y.square().sum() + s.square().sum()).backward()
    for n in names:
        assert kw[n].grad is not None and torch.isfinite(kw[n].grad).all() and kw[n].grad.abs().sum() > 0, n
    # and they are the reference's gradients
    ref_kw = {n: (v.detach().clone().requires_grad_() if n in names else v) for n, v in kw.items()}
    y_r, s_r, _ = mamba_scan_ref(**ref_kw)
    (y_r.square().sum() + s_r.square().sum()).backward()
    for n in names:
        assert_close(f"grad {n}", ref_kw[n].grad, kw[n].grad, atol=1e-6)


def test_train_smoke(tmp_path):
    """A tiny run of scripts/train.py writes a checkpoint that loads, with a tokenizer and benchmark prompts."""
    from nano_spec.text.tokenizer import Tokenizer
    from nano_spec.model.model import load_model

    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.json", "eval_prompts.jsonl"):
        assert (out / name).is_file(), name
    model = load_model(out)
    assert model.cfg.has_mtp and model.cfg.eos_ids
    tok = Tokenizer(out, model.cfg)
    log = json.loads((out / "train_log.json").read_text())
    assert log["finished"] and log["steps"] == 5 and log["held_out"]["loss"] > 0
    prompts = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert prompts and all(p["prompt"].endswith("\n") for p in prompts)
    ids = tok.encode(prompts[0]["prompt"])
    assert tok.decode(ids) == prompts[0]["prompt"]  # byte-level BPE round-trips source exactly
    with torch.no_grad():
        logits = model(torch.tensor([ids[:20]]))
    assert logits.shape == (1, min(20, len(ids)), model.cfg.vocab_size) and torch.isfinite(logits).all()


# ---- the atomic output swap (nano_spec/model/weights.py replace_dir: save_model and the training scripts) -------
OLD = {"config.json": b"old config", "sub/weights.bin": b"old weights"}
NEW = {"config.json": b"new config", "weights.bin": b"new weights", "log.json": b"new log"}


def tree(path: Path):
    """{relative path: bytes} of every file under path; None when path is not a directory."""
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in path.rglob("*") if f.is_file()} \
        if path.is_dir() else None


def write_tree(d: Path, files: dict, hit=lambda step: None):
    for i, (name, data) in enumerate(files.items()):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
        if i == 0:
            hit("fill")  # an interruption half-way through the writing


@pytest.mark.parametrize("mode", ["interrupt", "kill"])
def test_replace_dir_any_interruption_leaves_the_old_or_the_new_output(tmp_path, monkeypatch, mode):
    """Every file-system step of a save (and the writing) interrupted in turn. `interrupt`: that step raises and the
    save's own clean-up runs; `kill`: every step from it on fails too, as if the process died there. Either way the
    old output or the new one survives complete; the next save restores or clears what was left beside --out."""
    from nano_spec.model.weights import replace_dir

    real = {"replace": os.replace, "rmtree": shutil.rmtree}
    seen = set()
    for k in range(1, 50):
        out = tmp_path / str(k) / "out"
        out.mkdir(parents=True)
        write_tree(out, OLD)
        steps = []

        def hit(step):
            steps.append(step)
            if len(steps) == k or (mode == "kill" and len(steps) > k):
                raise KeyboardInterrupt(step)

        def patched(name):
            def call(*a, **kw):
                hit(name)
                return real[name](*a, **kw)
            return call

        monkeypatch.setattr(os, "replace", patched("replace"))
        monkeypatch.setattr(shutil, "rmtree", patched("rmtree"))
        try:
            replace_dir(out, lambda d: write_tree(d, NEW, hit))
            finished = True
        except KeyboardInterrupt:
            finished = False
        monkeypatch.undo()
        if finished:
            assert tree(out) == NEW and [p.name for p in out.parent.iterdir()] == ["out"]
            break
        seen.add(steps[k - 1])
        beside = [tree(p) for p in out.parent.iterdir()]
        assert OLD in beside or NEW in beside, (k, steps, beside)
        if mode == "interrupt":
            assert tree(out) in (OLD, NEW), (k, steps)

        def fail(d):
            raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):  # the next save fails while writing: the survivor stays
            replace_dir(out, fail)
        assert tree(out) in (OLD, NEW) and [p.name for p in out.parent.iterdir()] == ["out"], (k, steps)
        replace_dir(out, lambda d: write_tree(d, NEW))
        assert tree(out) == NEW and [p.name for p in out.parent.iterdir()] == ["out"], (k, steps)
    assert finished and seen >= {"fill", "replace", "rmtree"}, seen


@pytest.fixture
def writers(tmp_path):
    """name -> (write(out, log), the module whose weights it saves): train.write_checkpoint on a small model,
    train_mtp.write_checkpoint on a small head and train_dflash.write_drafter on a small drafter."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from helpers import load_script, tiny_checkpoint, tiny_config, tiny_model
    from nano_spec.model.dflash import DFlashConfig, DFlashModel
    from nano_spec.model.ops import Ops

    base = tiny_checkpoint(tmp_path / "base", num_nextn_predict_layers=0)
    train, mtp, dflash = load_script("train"), load_script("train_mtp"), load_script("train_dflash")
    model, tok = tiny_model(seed=1), Tokenizer.from_file(str(base / "tokenizer.json"))
    head = SimpleNamespace(mtp=torch.nn.Linear(4, 4))
    drafter = DFlashModel(DFlashConfig.for_target(tiny_config(), num_layers=1, block_size=4), Ops("torch"))
    return {"train": (lambda out, log: train.write_checkpoint(model, out, log, tok), model),
            "mtp": (lambda out, log: mtp.write_checkpoint(head, base, out, log, torch.float32), head.mtp),
            "dflash": (lambda out, log: dflash.write_drafter(drafter, out, log, torch.float32), drafter)}


def test_every_script_saves_through_the_swap(tmp_path, monkeypatch, writers):
    """train.write_checkpoint, train_mtp.write_checkpoint and train_dflash.write_drafter: a failure moving the new
    output in leaves the earlier output there, byte for byte."""
    for name, (write, _) in writers.items():
        out = tmp_path / name
        write(out, {"steps": 1})
        before = tree(out)
        real, failed = os.replace, []

        def replace(src, dst):
            if Path(dst) == out and not failed:  # once: the move of a finished output into place
                failed.append(src)
                raise OSError("interrupted")
            return real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(OSError, match="interrupted"):
            write(out, {"steps": 2})
        monkeypatch.undo()
        assert failed and tree(out) == before, name


def test_every_script_refuses_to_save_non_finite_weights(tmp_path, writers):
    """A weight turned NaN or infinite: the writer raises (train.Diverged, a RuntimeError) and the earlier output
    stays byte for byte."""
    for name, (write, module) in writers.items():
        out = tmp_path / name
        write(out, {"steps": 1})
        before = tree(out)
        weight = next(p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() == 2)
        for bad in (float("nan"), float("inf")):
            with torch.no_grad():
                saved, weight[0, 0] = weight[0, 0].item(), bad
            with pytest.raises(RuntimeError, match="non-finite"):
                write(out, {"steps": 2})
            with torch.no_grad():
                weight[0, 0] = saved
            assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir() if name in p.name) == [name]


# ---- scripts/train.py's own run: its output, its refusals, its threads --------------------------------------------
@pytest.fixture
def keep_threads():
    """torch's thread count, which a training run sets, restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def train_script(keep_threads):
    """scripts/train.py as a module, run in process."""
    from helpers import load_script

    return load_script("train")


@pytest.fixture
def earlier(tmp_path):
    """An earlier output of train.py (it holds train_log.json), alone in tmp_path, with bytes to compare."""
    out = tmp_path / "out"
    out.mkdir()
    write_tree(out, {"config.json": b"earlier config", "model.safetensors": b"earlier weights",
                     "train_log.json": b"{}"})
    return out


def smoke(out, *more):
    """train.py's --smoke run (tiny config, 5 steps) into out."""
    return [str(a) for a in ["--out", out, "--smoke", *more]]


@pytest.mark.parametrize("case", ["loss", "weights"])
def test_diverged_run_fails_and_keeps_the_earlier_output(train_script, earlier, capsys, monkeypatch, case):
    """loss: --lr 1e30 blows the weights up in the first step, and the second step's loss is NaN. weights: the one
    step's update leaves a NaN weight (after a finite loss), which the save finds. Exit 1 with one line saying so;
    the earlier output is left byte for byte and nothing is left beside it."""
    if case == "weights":
        step = torch.optim.AdamW.step

        def spoiled(opt, *a, **kw):
            out = step(opt, *a, **kw)
            with torch.no_grad():
                opt.param_groups[0]["params"][0].view(-1)[0] = float("nan")
            return out
        monkeypatch.setattr(torch.optim.AdamW, "step", spoiled)
    argv = ["--lr", "1e30", "--steps", 5] if case == "loss" else ["--steps", 1]
    before = tree(earlier)
    assert train_script.main(smoke(earlier, "--threads", 1, *argv)) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    says = r"non-finite loss at step 2;" if case == "loss" else r"non-finite model\.\S+ at step 1;"
    assert last.startswith("error: training diverged: ") and re.search(says, last) and "--lr" in last, last
    assert tree(earlier) == before and [p.name for p in earlier.parent.iterdir()] == ["out"]


def test_out_symlink_is_refused_before_training(train_script, earlier, tmp_path, capsys):
    """--out a symbolic link to an earlier output (the swap would replace the link, not its target): exit 2 and one
    line naming --out before the corpus is read (the run's first log line); the link and its target stay."""
    before = tree(earlier)
    link = tmp_path / "link"
    link.symlink_to(earlier, target_is_directory=True)
    assert train_script.main(smoke(link, "--threads", 1)) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: --out: ") and "symbolic link" in err and len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert link.is_symlink() and tree(earlier) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_out_that_train_did_not_write_is_refused(train_script, tmp_path, capsys, kind):
    """--out naming an existing file, or a directory of other files (no train_log.json): saving would delete it.
    Exit 2, one line naming --out, nothing touched."""
    out = tmp_path / "data"
    if kind == "directory":
        out.mkdir()
        (out / "notes.txt").write_bytes(b"keep me")
    else:
        out.write_bytes(b"keep me")
    assert train_script.main(smoke(out, "--threads", 1)) == 2
    std, err = capsys.readouterr()
    assert err.startswith("error: --out: ") and "not an output of train.py" in err, err
    assert len(err.strip().splitlines()) == 1 and std == ""
    assert (out / "notes.txt" if kind == "directory" else out).read_bytes() == b"keep me"


def test_run_replaces_the_earlier_output_and_logs_its_threads(train_script, earlier, capsys):
    """A finished run swaps in a whole new output for the earlier one. The thread count each step ran on (the step
    lines) is what train_log.json counts per thread count: every step but the first, whose one-off costs are not
    timed."""
    assert train_script.main(smoke(earlier, "--threads", "auto")) == 0
    assert sorted(tree(earlier)) == ["config.json", "eval_prompts.jsonl", "model.safetensors", "tokenizer.json",
                                     "train_log.json"]
    assert [p.name for p in earlier.parent.iterdir()] == ["out"]
    log = json.loads((earlier / "train_log.json").read_text())
    ran = [int(n) for n in re.findall(r"^\[.*\] step \d+/5 .* threads (\d+)$", capsys.readouterr().out, re.M)]
    assert len(ran) == 5 and set(ran) <= {1, 2}, ran
    counted = {int(n): k for n, k in log["steps_by_threads"].items()}
    assert counted == {n: ran[1:].count(n) for n in set(ran[1:])}
    assert {int(n) for n in log["seconds_per_step_by_threads"]} == set(counted)
    assert all(s > 0 for s in log["seconds_per_step_by_threads"].values())


@pytest.mark.parametrize("name", ["train_mtp", "train_dflash"])
def test_train_mtp_and_train_dflash_steps_run_on_the_engines_tuner(keep_threads, tmp_path, monkeypatch, name):
    """--threads auto: every step runs on the thread count the engine's tuner (nano_spec/engine/threads.py) picks, and the
    log's history says which. Step times are simulated (2 threads 13x slower, a loaded machine), so the tuner's picks
    are fixed: it stays on 1 thread and probes 2 once, at step 18 (after two segments of 8 timed steps)."""
    from helpers import load_script, tiny_checkpoint
    from nano_spec.engine.threads import ThreadTuner

    observe = ThreadTuner.observe
    monkeypatch.setattr(ThreadTuner, "observe",
                        lambda self, shape, seconds: observe(self, shape, 13e-3 if self.threads() > 1 else 1e-3))
    script, ran = load_script(name), []
    losses = script.losses

    def counted(*args):
        if torch.is_grad_enabled():  # a training step; evaluations run without grad
            ran.append(torch.get_num_threads())
        return losses(*args)
    monkeypatch.setattr(script, "losses", counted)
    base = tiny_checkpoint(tmp_path / "base", seed=3, num_nextn_predict_layers=0)
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 40)
    argv = ["--base", base, "--out", tmp_path / "out", "--corpus", tmp_path / "corpus.txt", "--steps", 20,
            "--seq-len", 16, "--batch", 2, "--threads", "auto", "--eval-windows", 0, "--amp", "none", "--log-every", 1]
    if name == "train_dflash":
        argv += ["--block", 4, "--layers", 1, "--anchors", 3]
    assert script.main([str(a) for a in argv]) == 0
    log = json.loads((tmp_path / "out" / script.LOG_FILE).read_text())
    assert ran == [1] * 17 + [2] + [1] * 2
    assert [h["threads"] for h in log["history"]] == ran
