"""One drafter interface (nano_spec/drafters/base.py): the built-ins have every member of `Drafter`, and an outside
object is wrapped once, at LLM(proposer=...), in `Checked`, which hands its taps to the runner and checks its
drafts; the step calls nothing else."""
import inspect

import pytest
import torch

from helpers import tiny_checkpoint
from nano_spec.drafters.base import Checked, Drafter, Drafts, NoDrafter
from nano_spec.drafters.dflash import DFlashDrafter
from nano_spec.drafters.mtp import MTPDrafter
from nano_spec.drafters.ngram import NgramDrafter
from nano_spec.engine.llm import LLM
from nano_spec.model.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("drafters") / "tiny", seed=4)


@pytest.mark.parametrize("cls", [NoDrafter, NgramDrafter, MTPDrafter, DFlashDrafter, Checked],
                         ids=lambda c: c.__name__)
def test_every_drafter_has_the_members_of_the_protocol(cls):
    for name in ("admit", "draft", "catch_up"):
        want = list(inspect.signature(getattr(Drafter, name)).parameters)
        if cls is not NoDrafter:  # plain decoding: max_drafts 0, so the runner calls none of them
            assert list(inspect.signature(getattr(cls, name)).parameters)[: len(want)] == want, name
    if cls is not Checked:  # the outside drafter's state is its own
        assert cls.state_bytes(None if cls in (NoDrafter, NgramDrafter) else _cfg(cls), 2, 8, torch.float32) >= 0


def _cfg(cls):
    from helpers import tiny_config
    from nano_spec.model.dflash import DFlashConfig

    target = tiny_config()
    if cls is MTPDrafter:
        return target
    return DFlashConfig.for_target(target, num_layers=1, block_size=4, taps=[1, 3])

class Outside:
    """A drafter of the three methods only (admit without taps), or, with taps, one that reads target layers."""

    def __init__(self, taps=None):
        self.max_drafts, self.admitted, self.caught_up = 2, [], []
        if taps is not None:
            self.taps = taps

    def admit(self, seq, hidden, first, **kw):
        self.admitted.append(kw.get("tapped"))

    def draft(self, seqs, gamma, uniforms):
        return Drafts.from_lists([[3, 5][:gamma] for _ in seqs], gamma, "cpu")

    def catch_up(self, seqs, rows, na):
        self.caught_up.append(rows.tapped)


@pytest.mark.parametrize("taps", [None, (1, 3)], ids=["no-taps", "taps"])
def test_an_outside_drafter_is_wrapped_once_and_gets_what_it_asked_for(ckpt, taps):
    outside = Outside(taps)
    llm = LLM(ckpt, proposer=outside, num_drafts=2, max_batch=2)
    assert isinstance(llm.drafter, Checked) and llm.drafter.inner is outside and llm.runner.drafter is llm.drafter
    out = llm.generate(["def f(x):", "x = 1"], PARAMS)
    plain = LLM(ckpt, proposer="none", max_batch=2).generate(["def f(x):", "x = 1"], PARAMS)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]  # lossless whatever it drafts
    if taps is None:
        assert outside.admitted == [None, None] and set(outside.caught_up) == {None}
    else:  # the prompt rows' and each verify's tapped layers: nT * D wide
        assert all(t.shape[-1] == len(taps) * llm.model.cfg.hidden_size for t in outside.admitted + outside.caught_up)


def test_the_draft_vocabulary_probe_keeps_the_output(ckpt, tmp_path, capsys):
    """scripts/draft_vocab.py: the MTP head drafting over the N top-ranked tokens only. Its output equals plain
    decoding's at every N (the script fails if N changes it), and the share of emitted tokens it reports inside
    the N equals the share counted here from plain decoding's tokens and the ranking. A size past V, or a
    checkpoint without the prompts, is one line."""
    import json
    import shutil

    from safetensors.torch import save_file

    from helpers import load_script

    model = shutil.copytree(ckpt, tmp_path / "m")
    prompts = ["def f(x):", "for i in range(3):"]
    (model / "eval_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    plain = LLM(str(model), proposer="none", max_batch=1)
    V = plain.config.cfg.vocab_size
    corpus = torch.randint(0, V, (64, 16), generator=torch.Generator().manual_seed(0)).to(torch.int16)
    save_file({"train": corpus}, str(model / "distill_prompts.safetensors"))
    probe = load_script("draft_vocab")
    assert probe.main(["--model", str(model), "--sizes", "1", "16", "--prompts", "2", "--tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [f"N={V}", "N=16", "N=1"]
    assert all(float(line.split("tau ")[1].split()[0]) >= 1 for line in lines), lines  # every step verified
    outputs = plain.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    emitted = torch.tensor([t for o in outputs for t in o.token_ids])
    ranked = torch.bincount(corpus.long().flatten(), minlength=V).argsort(descending=True)
    for line, n in zip(lines, (V, 16, 1)):
        share = torch.isin(emitted, ranked[:n]).float().mean().item()
        assert f"emitted inside {share:6.1%}" in line, (line, share)
    with pytest.raises(SystemExit) as e:
        probe.main(["--model", str(model), "--sizes", str(V + 1)])
    assert e.value.code == 2 and f"at most the vocabulary size, {V}" in capsys.readouterr().err
    (model / "eval_prompts.jsonl").unlink()
    with pytest.raises(SystemExit) as e:
        probe.main(["--model", str(model)])
    assert e.value.code == 2 and "eval_prompts.jsonl not found" in capsys.readouterr().err
