"""The engine end to end on a small random-weight model (torch backend, CPU).

The first-class check: speculative greedy output == plain greedy output, token
for token, for every proposer and γ, in mixed batches with slot reuse.
"""
import random

import pytest
import torch

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.drafters.base import Drafts

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓ héllo", "x = 1\ny = 2\n" * 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", seed=5)


class OracleDrafter:
    """Drafts the known greedy continuation, each token corrupted with probability p_wrong: every accept
    count 0..γ happens, so every commit path is exercised with a known right answer."""

    def __init__(self, max_drafts, reference: dict, p_wrong=0.3, seed=0):
        self.max_drafts, self.ref, self.p_wrong = max_drafts, reference, p_wrong
        self.rng = random.Random(seed)

    def _drafts(self, seq, gamma):
        full = self.ref[tuple(seq.tokens[: seq.prompt_len])]
        cont = full[len(seq.tokens) : len(seq.tokens) + gamma]
        return [t if self.rng.random() > self.p_wrong else (t + 1) % 300 for t in cont]

    def admit(self, seq, hidden, first):
        pass

    def draft(self, seqs, gamma, uniforms):
        return Drafts.from_lists([self._drafts(s, gamma) for s in seqs], gamma, "cpu")

    def catch_up(self, seqs, rows, na):
        pass


def run(ckpt, proposer="none", gamma=0, max_batch=3, prompts=PROMPTS, params=None, oracle=None, **kw):
    if oracle is not None:
        proposer = OracleDrafter(gamma, oracle)
    llm = LLM(ckpt, proposer=proposer, num_drafts=gamma, max_batch=max_batch, **kw)
    params = params or SamplingParams(max_new_tokens=24, ignore_eos=True)
    return llm, llm.generate(prompts, params)


@pytest.fixture(scope="module")
def plain(ckpt):
    _, outs = run(ckpt)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("proposer, gamma", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4), ("ngram", 3)],
                         ids=lambda v: str(v))
def test_lossless_greedy(ckpt, plain, proposer, gamma):
    _, outs = run(ckpt, proposer, gamma)
    assert [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("gamma", [3, "auto"], ids=lambda g: f"gamma_{g}")
def test_lossless_in_bf16_on_the_shipped_weights(gamma):
    """bf16 on the CPU: a K-row verify must round each row as a 1-row step does, whatever GEMM bf16 takes."""
    prompts = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n", "class Stack:\n", "x = ["]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = [o.token_ids for o in LLM(proposer="none", dtype="bfloat16", max_batch=4).generate(prompts, params)]
    spec = LLM(proposer="mtp", num_drafts=gamma, dtype="bfloat16", max_batch=4)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    assert spec.stats["tau"] > 1.5  # drafts were accepted: the K-row verifies did the work


@pytest.mark.parametrize("gamma", [1, 3, 5], ids=lambda g: f"gamma{g}")
def test_lossless_with_every_accept_count(ckpt, plain, gamma):
    llm0 = LLM(ckpt, proposer="none", max_batch=3)
    reference = {tuple(llm0.tokenizer.encode(p)): llm0.tokenizer.encode(p) + toks for p, toks in zip(PROMPTS, plain)}
    llm, outs = run(ckpt, gamma=gamma, oracle=reference)
    assert [o.token_ids for o in outs] == plain
    tel = llm.stats
    assert tel["tau"] > 1.5, "the oracle should be accepted often"
    assert 0 < tel["accept_at"][gamma - 1] < 1, "full accepts and rejections both happen"


def test_batch_invariance_and_slot_reuse(ckpt, plain):
    alone = [run(ckpt, "mtp", 3, max_batch=1, prompts=[p])[1][0].token_ids for p in PROMPTS]
    assert alone == plain
    # one slot for five prompts: every request after the first reuses a slot
    _, outs = run(ckpt, "mtp", 3, max_batch=1)
    assert [o.token_ids for o in outs] == plain


def test_admission_mid_generation_changes_nothing(ckpt, plain):
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=4)
    enc = llm.tokenizer.encode
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    first = llm.scheduler.add(enc(PROMPTS[0]), params)
    for _ in range(3):
        llm.scheduler.step()
    later = [llm.scheduler.add(enc(p), params) for p in PROMPTS[1:]]
    while llm.scheduler.has_work():
        llm.scheduler.step()
    assert [s.generated for s in [first] + later] == plain


@torch.no_grad()
def test_mtp_drafts_equal_nocache_recomputation(ckpt):
    """After any step, the drafts the MTP proposer makes equal a from-scratch MTP over the full sequence."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    model, params = llm.model, SamplingParams(max_new_tokens=40, ignore_eos=True)
    seqs = [llm.scheduler.add(llm.tokenizer.encode(p), params) for p in PROMPTS[:2]]
    for _ in range(6):
        llm.scheduler.step()
        for s in seqs:
            if s.finished:
                continue
            x = torch.tensor(s.tokens, device=llm.runner.device)
            n = len(x)
            h = model.hidden(x[None, : n - 1])  # (1, n-1, D)
            H, NX, want = h, x[None, 1:], []
            for _ in range(3):
                o = model.mtp_hidden(NX, H)
                d = model.mtp_logits(o[:, -1]).argmax(-1)
                want.append(int(d))
                H, NX = torch.cat([H, o[:, -1:]], 1), torch.cat([NX, d[None]], 1)
            assert llm.drafter.draft([s], 3, None).tokens[0].tolist() == want


def test_stop_token_inside_accepted_run(ckpt, plain):
    llm0 = LLM(ckpt, proposer="none")
    reference = {tuple(llm0.tokenizer.encode(p)): llm0.tokenizer.encode(p) + t for p, t in zip(PROMPTS, plain)}
    stop_tok = plain[1][7]
    cut = plain[1].index(stop_tok)
    # every draft right: stops land mid-run
    llm = LLM(ckpt, proposer=OracleDrafter(4, reference, p_wrong=0.0), max_batch=2)
    out = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=24, stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == plain[1][: cut + 1] and out.finish_reason == "stop"
    # max_new_tokens is exact even when the accepted run is longer
    for n in (1, 2, 5, 11):
        out = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == plain[1][:n] and out.finish_reason == "length"


def test_stop_string_split_across_tokens(ckpt, plain):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3)
    dec = llm.tokenizer.decode
    toks = plain[0]
    # a stop string made of the end of token 5's text and the start of token 6's
    a, b = dec(toks[:6]), dec(toks[:7])
    stop = a[-2:] + b[len(a) : len(a) + 2]
    assert len(stop) >= 3
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    full = dec(toks)
    assert out.finish_reason == "stop" and out.text == full[: full.find(stop)]
    assert out.token_ids == toks[: len(out.token_ids)] and stop in dec(out.token_ids)
    assert stop not in dec(out.token_ids[:-1])


def test_stream_yields_the_generated_text(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=2)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    pieces = list(llm.stream(PROMPTS[3], params))
    assert "".join(pieces) == llm.generate(PROMPTS[3], params)[0].text
    assert len(pieces) > 1


def test_logprobs_match_the_target(ckpt, plain):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3)
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2))[0]
    ids = torch.tensor(llm.tokenizer.encode(PROMPTS[0]) + out.token_ids, device=llm.runner.device)
    with torch.no_grad():
        lp = torch.log_softmax(llm.model(ids[None])[0].float(), -1)  # (T, V)
    P = len(ids) - len(out.token_ids)
    for j, t in enumerate(out.token_ids):
        assert abs(out.logprobs[j] - lp[P - 1 + j, t].item()) < 1e-4
        top = lp[P - 1 + j].topk(2)
        assert list(out.top_logprobs[j]) == top.indices.tolist()


def test_sampling_is_reproducible_with_a_seed(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=4)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS[:3], params)
    b = llm.generate(PROMPTS[:3][::-1], params)[::-1]  # other batch order, other slots
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_seeded_request_draws_alike_beside_a_filtered_one(ckpt):
    """A request without top-k or top-p skips the sort over the vocabulary when its batch-mates do too, and
    draws the same tokens when a batch-mate filters (the batch then sorts)."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    plain = SamplingParams(max_new_tokens=16, temperature=1.2, seed=3, ignore_eos=True)
    mate = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=5, top_p=0.8, seed=4, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], plain)[0].token_ids
    beside = llm.generate(PROMPTS[:2], [plain, mate])
    assert beside[0].token_ids == alone
    assert beside[1].token_ids == llm.generate(PROMPTS[1:2], mate)[0].token_ids


def test_telemetry_with_a_fake_clock(ckpt):
    ticks = iter(range(0, 10**6, 2))  # every clock read advances 2 ms
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, clock=lambda: next(ticks) * 1e-3)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=9, ignore_eos=True))
    st = llm.stats
    steps = sum(len(o.token_ids) - 1 for o in outs)  # tokens after the prefill's one
    assert st["emitted"] == steps
    assert st["tau"] == pytest.approx(1 + sum(st["accept_at"]), abs=1e-12)
    for phase in ("prefill", "verify", "verdict", "commit", "propose"):
        hist = st["phase_histogram_ms"][phase]
        n = sum(hist)  # every phase took one clock tick: 2 ms, in the (1, 3] ms bucket
        assert n and hist[st["phase_histogram_ms"]["edges"].index(3)] == n
        assert st["phase_seconds"][phase] == pytest.approx(n * 2e-3)


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                          ("top_p", 1.5), ("top_k", -1), ("logprobs", -1), ("seed", "x")])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_bad_requests(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_seq_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate("")
    with pytest.raises(ValueError, match="max_seq_len 16"):
        llm.generate("x " * 40)
    with pytest.raises(ValueError, match="num_drafts"):
        LLM(ckpt, num_drafts=-1)
    with pytest.raises(ValueError, match="proposer"):
        LLM(ckpt, proposer="magic")
    assert not llm.scheduler.has_work()
    out = llm.generate("x", SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(llm.tokenizer.encode("x")) + len(out.token_ids) == 16


def test_a_step_reads_its_batch_not_every_request(ckpt, monkeypatch):
    """A step's host work follows the batch, not the requests of the call: a generate of 48 prompts at batch 2
    asks a sequence whether it has finished as often per step as one of 6 (the call learns of a finished request
    from the scheduler, rather than asking each of its requests after every step)."""
    from nano_spec.engine import scheduler

    asked, finished = [], scheduler.Sequence.finished
    monkeypatch.setattr(scheduler.Sequence, "finished", property(lambda s: asked.append(1) or finished.fget(s)))
    llm, per_step = LLM(ckpt, proposer="none", max_batch=2), []
    for n in (6, 48):
        asked[:], steps = [], llm.scheduler.steps
        outs = llm.generate(["a b"] * n, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [3] * n
        per_step.append(len(asked) / (llm.scheduler.steps - steps))
    assert per_step[1] < 1.5 * per_step[0], per_step
