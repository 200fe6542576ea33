"""scripts/train_dflash.py: a DFlash drafter trained for a frozen target, written where the engine reads it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_close, load_script, tiny_checkpoint, tiny_config
from nano_spec.model.dflash import DFlashConfig, DFlashModel, load_drafter
from nano_spec.engine.llm import LLM
from nano_spec.model.ops import Ops
from nano_spec.model.sampling import SamplingParams
from nano_spec.model.model import load_model
from nano_spec.model.weights import init_weights

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 40
SMALL = ["--steps", 3, "--seq-len", 32, "--batch", 2, "--block", 4, "--layers", 1, "--anchors", 3, "--threads", 1,
         "--eval-windows", 2, "--amp", "none", "--lr", "3e-3", "--warmup", 1]


def train_dflash(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_dflash.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and its drafter, trained into <target>/dflash as the engine looks for it."""
    tmp = tmp_path_factory.mktemp("train_dflash")
    base = tiny_checkpoint(tmp / "base", seed=3)
    (tmp / "corpus.txt").write_text(CORPUS)
    before = {f.name: f.read_bytes() for f in base.iterdir()}
    proc = train_dflash("--base", base, "--out", base / "dflash", "--corpus", tmp / "corpus.txt", *SMALL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {f.name: f.read_bytes() for f in base.iterdir() if f.is_file()} == before  # the target untouched
    return base, base / "dflash", tmp / "corpus.txt", proc.stderr


def test_writes_a_drafter_that_loads(trained):
    base, out, _, err = trained
    assert "tok/s" in err and "agreement by position: 1: " in err
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "dflash_train_log.json", "model.safetensors"]
    target = load_model(base)
    drafter = load_drafter(out, DFlashConfig.from_file(out / "config.json"), target.ops, "cpu", torch.float32)
    cfg = drafter.cfg
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.mask_token_id) == (4, 1, 0)
    fresh = init_weights(DFlashModel(cfg, target.ops), seed=0).state_dict()  # the script's start (--seed 0)
    assert any(not torch.equal(t, fresh[n]) for n, t in drafter.state_dict().items())  # trained
    log = json.loads((out / "dflash_train_log.json").read_text())
    assert log["steps"] == 3 and log["tokens_seen"] == 3 * 2 * 32 and log["finished"]
    assert len(log["agree_by_position"]) == 3 and len(log["held_out_before"]["agree"]) == 3
    assert log["drafter"]["dflash_config"]["block_size"] == 4 and log["args"]["anchors"] == 3


def test_engine_drafts_with_it(trained):
    """Greedy decoding with the trained drafter is plain decoding's output."""
    base, out, _, _ = trained
    prompts = ["def f(x):\n", "for i in range(3):\n    print("]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw = dict(backend="torch", device="cpu", max_batch=2, max_seq_len=64)
    llm = LLM(base, proposer="dflash", drafter=out, num_drafts=2, **kw)
    outs = llm.generate(prompts, params)
    plain = LLM(base, proposer="none", **kw).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.stats["verify_steps"] > 0


def test_stacked_anchors_equal_one_forward_per_anchor():
    """The training forward (every anchor's block stacked, block_mask) equals a draft forward per anchor on the
    context cut at the anchor, with no mask: the same rows within 1e-5."""
    script = load_script("train_dflash")
    cfg = tiny_config()
    drafter = DFlashModel(DFlashConfig.for_target(cfg, num_layers=2, block_size=4, mask_token_id=5), Ops("torch"))
    init_weights(drafter, std=0.2, seed=1).eval()
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    g = torch.Generator().manual_seed(0)
    B, T, Bk = 2, 12, 4
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g)
    taps = torch.randn(B, T, len(drafter.cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    anchors = torch.tensor([[1, 4, 8], [2, 3, 7]])  # adjacent and overlapping blocks; the last ends at T - 1
    with torch.no_grad():
        got = script.stacked_draft(drafter, embed, ids, taps, anchors)  # (B, n, Bk, D)
        for b in range(B):
            for k, a in enumerate(anchors[b].tolist()):
                block = torch.tensor([[ids[b, a].item()] + [5] * (Bk - 1)])
                x = embed(block) * drafter.cfg.input_embedding_scale
                want = drafter(x, taps[b:b + 1, :a], torch.arange(a + Bk)[None])
                assert_close(f"sequence {b} anchor {a}", want[0], got[b, k], atol=1e-5)


def loss_inputs(model_seed: int):
    """The script, a tiny frozen target, a 1-layer block-3 drafter config and the settings losses() reads."""
    from types import SimpleNamespace
    from helpers import tiny_model

    model = tiny_model(seed=model_seed).requires_grad_(False)
    args = SimpleNamespace(seq_len=13, anchors=3, first_anchor=2, labels="target", decay=2.0, prefix_weights=False)
    return load_script("train_dflash"), model, DFlashConfig.for_target(model.cfg, num_layers=1, block_size=3), args


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_target_cache_changes_nothing_but_time(amp):
    """--cache-target: the loss, its gradient and the logged figures equal those of the target's forward, bit for bit,
    on the visit that fills the cache and on a later one that reads it; only the windows not yet kept are computed."""
    from types import SimpleNamespace

    script, model, dcfg, args = loss_inputs(model_seed=2)
    windows = torch.randint(1, model.cfg.vocab_size, (5, 14), generator=torch.Generator().manual_seed(1))
    cache = script.TargetCache(5, 13, model.cfg.hidden_size, len(dcfg.target_layer_ids),
                               torch.bfloat16 if amp == "bf16" else torch.float32, "cpu")
    computed = []  # the rows each visit's forward ran on
    counted = SimpleNamespace(  # the cache, counting the rows it computes
        get=lambda i, compute: cache.get(i, lambda rows: computed.append(len(rows)) or compute(rows)))
    for visit, idx in enumerate([torch.tensor([3, 0]), torch.tensor([0, 4, 3])]):
        runs = []
        for use_cache in (False, True):
            drafter = init_weights(DFlashModel(dcfg, model.ops), std=0.2, seed=1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
                if use_cache:
                    out = script.losses(model, drafter, windows[idx], args, torch.Generator().manual_seed(visit),
                                        counted, idx)
                else:
                    out = script.losses(model, drafter, windows[idx], args, torch.Generator().manual_seed(visit))
            out[0].backward()
            runs.append([*out, *(p.grad for p in drafter.parameters())])
        for name, ref, got in zip(["loss", "ce", "agree", "accept"], runs[0], runs[1]):
            assert torch.equal(ref, got), (visit, name, ref, got)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][4:], runs[1][4:])), visit
    assert computed == [2, 1] and cache.have.tolist() == [True, False, False, True, True]


def test_compiled_block_loss_equals_eager():
    """--compile's function (torch.compile of block_loss): the loss, CE by position, agreement and every gradient of
    the eager one, within 1e-5."""
    script, model, dcfg, args = loss_inputs(model_seed=4)
    batch = torch.randint(1, model.cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(5))
    runs = []
    for block_loss in (script.block_loss, torch.compile(script.block_loss)):
        drafter = init_weights(DFlashModel(dcfg, model.ops), std=0.2, seed=1)
        out = script.losses(model, drafter, batch, args, torch.Generator().manual_seed(0), block_loss=block_loss)
        out[0].backward()
        runs.append([*out, *(p.grad for p in drafter.parameters())])
    names = ["loss", "ce", "agree", "accept"] + [n for n, _ in drafter.named_parameters()]
    for name, ref, got in zip(names, *runs):
        assert_close(name, ref, got, atol=1e-5)


def test_prefix_weights_count_a_draft_by_the_chance_its_prefix_is_accepted():
    """--prefix-weights: the loss is sum_j w_j mean_blocks(prod_{i<j} q_i * CE_j), q_i the drafter's probability of the
    target's pick at row i, held constant: loss and gradients equal that sum written out block by block."""
    script, model, _, args = loss_inputs(model_seed=6)
    dcfg = DFlashConfig.for_target(model.cfg, num_layers=1, block_size=4)  # three rows: a prefix of two
    g = torch.Generator().manual_seed(7)
    ids, anchors = torch.randint(1, model.cfg.vocab_size, (2, 13), generator=g), torch.tensor([[2, 5, 9], [3, 4, 8]])
    taps = script.target_rows(model, ids, dcfg.target_layer_ids)[0]
    labels = torch.randn(2, 3, 3, model.cfg.vocab_size, generator=g).softmax(-1)  # (B, n, Bk-1, V): any distribution
    w = script.position_weights(4, args.decay)
    runs = []
    for prefix in (True, False):
        drafter = init_weights(DFlashModel(dcfg, model.ops), std=0.2, seed=1)
        loss = script.block_loss(model, drafter, ids, taps, anchors, labels, w, prefix)[0]
        loss.backward()
        runs.append([loss, *(p.grad for p in drafter.parameters())])
    # the reference: the drafter's rows again, each block's weights as plain numbers
    drafter = init_weights(DFlashModel(dcfg, model.ops), std=0.2, seed=1)
    h = script.stacked_draft(drafter, model.model.embed_tokens, ids, taps, anchors)[:, :, 1:]
    logp = (model.logits(h) * (dcfg.output_multiplier * model.cfg.logits_scaling)).log_softmax(-1)
    ref = 0.0
    for b in range(2):
        for k in range(3):
            chance = 1.0
            for j in range(3):
                ref = ref + w[j] * chance * -(labels[b, k, j] * logp[b, k, j]).sum() / 6
                chance *= logp[b, k, j, labels[b, k, j].argmax()].exp().item()
    ref.backward()
    names = ["loss"] + [n for n, _ in drafter.named_parameters()]
    for name, want, got in zip(names, [ref, *(p.grad for p in drafter.parameters())], runs[0]):
        assert_close(name, want, got, atol=1e-6)
    assert not torch.allclose(runs[0][0], runs[1][0])  # the weights change the loss: rows 2 and 3 count less


def test_compile_flag_compiles_the_training_steps(trained, tmp_path, monkeypatch):
    """--compile hands block_loss to torch.compile once, and the steps run what it returns."""
    base, _, corpus, _ = trained
    script, compiled, ran = load_script("train_dflash"), [], []

    def compile_(f):
        compiled.append(f)
        return lambda *a: ran.append(1) or f(*a)
    monkeypatch.setattr(torch, "compile", compile_)
    argv = ["--base", base, "--out", tmp_path / "out", "--corpus", corpus, *SMALL, "--compile"]
    assert script.main([str(a) for a in argv]) == 0
    assert compiled == [script.block_loss] and len(ran) == 3  # the 3 steps; held-out evaluations run eager
    assert json.loads((tmp_path / "out" / "dflash_train_log.json").read_text())["args"]["compile"] is True


def test_mask_rows():
    mask = load_script("train_dflash").block_mask(torch.tensor([[1, 3]]), 5, 2)[0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 1, 1, 0, 0],  # anchor 1: context position 0, its own block
                             [1, 0, 0, 0, 0, 1, 1, 0, 0],
                             [1, 1, 1, 0, 0, 0, 0, 1, 1],  # anchor 3: context 0..2, its own block
                             [1, 1, 1, 0, 0, 0, 0, 1, 1]]


def test_refusals_are_one_line(trained, tmp_path, capsys):
    """Bad values and outputs that would destroy something: exit 2, one line naming the flag, nothing written."""
    base, out, corpus, _ = trained
    script = load_script("train_dflash")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    small = [str(a) for a in SMALL]
    for args, message in [(["--block", "1"], "argument --block: must be an integer in [2, 64], got '1'"),
                          (["--layers", "0"], "argument --layers: must be an integer in [1, 64], got '0'"),
                          (["--minutes", "nan"], "argument --minutes: must be a finite number > 0, got 'nan'"),
                          (["--anchors", "0"], "argument --anchors: must be an integer in [1, "),
                          (["--anchors", "29"],
                           "argument --anchors: must be at most the 28 places a block fits, got 29"),
                          (["--taps", "99"], "--taps: 99 must be layers of the target (0 .. 3)"),
                          (["--taps", "1,x"], "argument --taps: must be distinct integers >= 0"),
                          (["--out", str(tmp_path / "mine")], "is not an output of train_dflash.py"),
                          (["--out", str(base)], "must not be the base directory"),
                          (["--out", str(base.parent)], "must not hold the base directory")]:
        argv = ["--base", str(base), "--out", str(tmp_path / "new"), "--corpus", str(corpus)] + small + args
        try:
            rc = script.main(argv)  # values the model decides are refused by main, the others by the parser
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and message in err, (args, rc, err)
        assert len(err.strip().splitlines()) == 1, (args, err)
    assert not (tmp_path / "new").exists() and sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    rc = train_dflash("--base", base, "--out", base / "dflash", "--minutes", "nan")  # as a user runs it
    assert rc.returncode == 2 and rc.stderr == "error: argument --minutes: must be a finite number > 0, got 'nan'\n"


def files(d: Path) -> dict:
    return {f.name: f.read_bytes() for f in d.iterdir()}


def test_diverged_run_fails_and_keeps_the_earlier_output(trained, tmp_path, capsys):
    """--lr 1e30 blows the drafter up: exit 1 with one line saying so, and the earlier output is left byte for byte."""
    base, out, corpus, _ = trained
    earlier = Path(shutil.copytree(out, tmp_path / "out"))
    before = files(earlier)
    argv = ["--base", base, "--out", earlier, "--corpus", corpus, *SMALL, "--lr", "1e30"]
    assert load_script("train_dflash").main([str(a) for a in argv]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "non-finite" in last and "--lr" in last, last
    assert files(earlier) == before and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_out_symlink_is_refused_before_training(trained, tmp_path, capsys):
    """--out a symbolic link to an earlier output: exit 2 and one line naming --out before anything trains."""
    base, out, corpus, _ = trained
    before = files(out)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    argv = ["--base", base, "--out", link, "--corpus", corpus, *SMALL]
    assert load_script("train_dflash").main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out: ") and len(err.strip().splitlines()) == 1, err
    assert link.is_symlink() and files(out) == before


def test_eval_windows_0_trains_without_evaluating(trained, tmp_path, capsys):
    """--eval-windows 0: no held-out evaluation, said so in the output and the log, and the drafter is written."""
    base, _, corpus, _ = trained
    argv = ["--base", base, "--out", tmp_path / "out", "--corpus", corpus, *SMALL, "--eval-windows", "0"]
    assert load_script("train_dflash").main([str(a) for a in argv]) == 0
    assert "no held-out windows" in capsys.readouterr().err
    log = json.loads((tmp_path / "out" / "dflash_train_log.json").read_text())
    assert log["steps"] == 3 and log["evals"] == [] and log["held_out_before"] is None and log["held_out"] is None
    assert log["agree_by_position"] == [] and (tmp_path / "out" / "model.safetensors").is_file()
