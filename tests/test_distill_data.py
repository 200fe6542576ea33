"""scripts/distill_data.py: the target's own continuations of corpus prompts, cached in a file that a rerun extends;
scripts/train_dflash.py --data trains on them."""
import json

import torch
import pytest

from helpers import load_script, tiny_checkpoint
from nano_spec.model.model import load_model
from nano_spec.reference import speculative_generate

CORPUS = "def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 20
P, R = 6, 9  # prompt and continuation lengths: awkward on purpose


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    base = tiny_checkpoint(tmp / "base", seed=4)
    (tmp / "corpus.txt").write_text(CORPUS)
    args = ["--base", str(base), "--corpus", str(tmp / "corpus.txt"), "--prompt-len", str(P), "--new-tokens", str(R),
            "--held", "2", "--sampled", "0.5", "--batch", "2", "--threads", "1"]
    script = load_script("distill_data")
    assert script.main([*args, "--out", str(tmp / "d.pt"), "--windows", "5"]) == 0
    return script, base, tmp, args, torch.load(tmp / "d.pt", weights_only=True)


def test_windows_are_the_targets_continuations(made):
    """Every window is a prompt from the corpus followed by what the target writes after it: greedy windows equal
    the one-screen reference's greedy decoding, sampled ones its sampling with the window's seed."""
    script, base, _, _, d = made
    assert d["train"].shape == (5, P + R) and d["held"].shape == (2, P + R) and d["train"].dtype == torch.int32
    assert 0 < int(d["train_sampled"].sum()) < 5  # both kinds at --sampled 0.5 (the draw is fixed by the seed)
    model = load_model(base)
    for kind, windows in (("train", d["train"]), ("held", d["held"])):
        for i, w in enumerate(windows.tolist()):
            key = script.window_key(0, kind == "held", i)
            sampled = kind == "train" and bool(d["train_sampled"][i])
            want, _ = speculative_generate(model, w[:P], R, gamma=0, temperature=1.0 if sampled else 0.0, seed=key)
            assert w[P:] == want, (kind, i, sampled)


def test_a_rerun_extends_the_file_and_keeps_what_is_there(made, tmp_path):
    script, _, tmp, args, d = made
    out = tmp_path / "d.pt"
    (tmp_path / "d.pt").write_bytes((tmp / "d.pt").read_bytes())
    assert script.main([*args, "--out", str(out), "--windows", "7"]) == 0
    more = torch.load(out, weights_only=True)
    assert torch.equal(more["train"][:5], d["train"]) and torch.equal(more["held"], d["held"])
    assert more["train"].shape == (7, P + R) and len(more["train_sampled"]) == 7
    assert not list(tmp_path.glob("*.tmp"))  # nothing half-written left beside it


def test_a_file_made_with_other_settings_is_refused(made, capsys):
    script, _, tmp, args, d = made
    before = (tmp / "d.pt").read_bytes()
    assert script.main([*args, "--out", str(tmp / "d.pt"), "--windows", "6", "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out:") and "other settings" in err[0]
    assert (tmp / "d.pt").read_bytes() == before
    (tmp / "junk.pt").write_bytes(b"not a data file")
    assert script.main([*args, "--out", str(tmp / "junk.pt"), "--windows", "6"]) == 2
    assert "is not a data file of distill_data.py" in capsys.readouterr().err
    assert (tmp / "junk.pt").read_bytes() == b"not a data file"


def test_exported_prompts_give_the_same_windows(made, tmp_path, capsys):
    """--export-prompts then --prompts: the same prompts and, with the same seed, the same windows, no corpus read."""
    script, _, tmp, args, d = made
    assert script.main([*args, "--out", str(tmp / "d.pt"), "--export-prompts", str(tmp_path / "p.st")]) == 0
    no_corpus = [a for a in args if a not in ("--corpus", str(tmp / "corpus.txt"))]
    again = [*no_corpus, "--prompts", str(tmp_path / "p.st"), "--out", str(tmp_path / "again.pt")]
    assert script.main([*again, "--windows", "5"]) == 0
    assert all(torch.equal(torch.load(tmp_path / "again.pt")[k], d[k]) for k in ("train", "held", "train_sampled"))
    assert script.main([*again, "--windows", "6"]) == 2  # the list holds 5
    assert "holds 5 train prompts, fewer than the 6 asked" in capsys.readouterr().err


def test_train_dflash_trains_on_it(made, tmp_path):
    """--data: the windows' length is the sequence length, the anchors lie in the continuations, and the drafter it
    writes loads; --labels tokens trains on the windows' tokens."""
    _, base, tmp, _, _ = made
    train = load_script("train_dflash")
    small = ["--steps", "2", "--batch", "2", "--block", "3", "--layers", "1", "--anchors", "4", "--threads", "1",
             "--amp", "none", "--warmup", "1", "--eval-windows", "2"]
    for labels in ("target", "tokens"):
        out = tmp_path / labels
        assert train.main(["--base", str(base), "--out", str(out), "--data", str(tmp / "d.pt"), "--labels", labels,
                           *small]) == 0
        log = json.loads((out / "dflash_train_log.json").read_text())
        assert log["args"]["seq_len"] == P + R - 1 and log["args"]["first_anchor"] == P - 1
        assert "continuations" in log["corpus"] and log["held_out"]["step"] == 2
    args = train.parse_args(["--base", str(base), "--out", str(tmp_path / "x"), "--data", str(tmp / "d.pt"),
                             "--block", "3", "--anchors", "7"])  # every place a block fits: P-1 .. P+R-1-3
    a = train.sample_anchors(64, args.seq_len, 3, args.anchors, torch.Generator().manual_seed(0), args.first_anchor)
    assert sorted(set(a.flatten().tolist())) == list(range(P - 1, P + R - 3))


def test_train_dflash_refuses_bad_data(made, tmp_path, capsys):
    _, base, tmp, _, _ = made
    train = load_script("train_dflash")
    (tmp_path / "junk.pt").write_bytes(b"not a tensor file")
    common = ["--base", str(base), "--out", str(tmp_path / "o")]
    for extra, says in ((["--data", str(tmp_path / "junk.pt")], "is not a data file of distill_data.py"),
                        (["--data", str(tmp / "d.pt"), "--corpus", str(tmp / "corpus.txt")], "not both"),
                        (["--data", str(tmp / "d.pt"), "--block", "3", "--anchors", "8"], "at most the 7 places")):
        with pytest.raises(SystemExit) as e:
            train.main([*common, *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
