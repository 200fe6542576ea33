"""Reliability: bad input refused with one clear error and no state change, faults contained to
their sequence, cancelled requests free their slot, and a load of 256 requests with nothing lost."""
import json
import random
import re
from pathlib import Path

import pytest

from helpers import assert_idle, tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.drafters.base import Checked

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓", "x = 1\ny = 2\n" * 3]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rel") / "tiny", seed=9)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Each prompt alone on a fresh engine."""
    return [LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1).generate(p, PARAMS)[0].token_ids for p in PROMPTS]


def copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


BAD_REQUESTS = {
    "empty-prompt": (lambda: ("", PARAMS), "empty prompt"),
    "too-long": (lambda: ("x " * 200, PARAMS), "max_seq_len 64"),
    "token-out-of-range": (lambda: ([1, 2, 10**6], PARAMS), "token ids must lie in"),
    "not-a-prompt": (lambda: (3.5, PARAMS), "expected a string or a list of token ids"),
    "params-type": (lambda: ("x", {"temperature": 1}), "expected SamplingParams"),
    "temperature": (lambda: ("x", SamplingParams(temperature=-0.1)), "SamplingParams.temperature"),
    "top-p-zero": (lambda: ("x", SamplingParams(top_p=0.0)), "SamplingParams.top_p"),
    "top-p-above-one": (lambda: ("x", SamplingParams(top_p=1.01)), "SamplingParams.top_p"),
    "top-k": (lambda: ("x", SamplingParams(top_k=-3)), "SamplingParams.top_k"),
    "max-new-tokens": (lambda: ("x", SamplingParams(max_new_tokens=0)), "SamplingParams.max_new_tokens"),
}


@pytest.mark.parametrize("make, message", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_refused_without_state_change(ckpt, reference, make, message):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2, max_seq_len=64)
    with pytest.raises(ValueError, match=re.escape(message)):
        prompt, params = make()
        llm.generate([PROMPTS[0], prompt], params)  # the good prompt is not queued either
    assert_idle(llm)
    assert llm.generate(PROMPTS[0], PARAMS)[0].token_ids == reference[0]


BAD_ENGINES = {
    "num-drafts-negative": (dict(num_drafts=-1), "num_drafts"),
    "num-drafts-too-many": (dict(num_drafts=17), "num_drafts"),
    "max-batch": (dict(max_batch=0), "max_batch"),
    "threads-zero": (dict(threads=0), "threads"),
    "threads-float": (dict(threads=1.5), "threads"),
    "threads-absurd": (dict(threads=100_000), "threads: 100000 must be None or an integer in [1, "),
    "num-drafts-word": (dict(num_drafts="many"), "num_drafts"),
    "max-seq-len": (dict(max_seq_len=1), "max_seq_len"),
    "backend": (dict(backend="cuda-magic"), "backend"),
    "dtype": (dict(dtype="int8"), "dtype"),
    "memory": (dict(max_seq_len=10**6, max_batch=512), "memory: max_batch=512, max_seq_len=1000000, K=5 need"),
    "memory-budget": (dict(memory_budget=1000), "but the budget is 1000 B"),
}


@pytest.mark.parametrize("kw, message", BAD_ENGINES.values(), ids=BAD_ENGINES.keys())
def test_bad_engine_settings(ckpt, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(ckpt, **kw)


def test_bad_checkpoints(ckpt, tmp_path):
    cases = []
    cases.append((tmp_path / "missing", "not a checkpoint directory"))
    d = copy_ckpt(ckpt, tmp_path / "notjson")
    (d / "config.json").write_text("{'single quotes': 1")
    cases.append((d, "not valid JSON"))
    d = copy_ckpt(ckpt, tmp_path / "absurd")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, vocab_size=10**9)))
    (d / "model.safetensors").write_bytes(b"garbage")  # never read: the config is refused first
    cases.append((d, "vocab_size: 1000000000 is not an integer"))
    d = copy_ckpt(ckpt, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 100])
    cases.append((d, "truncated or corrupt"))
    d = copy_ckpt(ckpt, tmp_path / "header")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:24] = b"\x00{not json here!"
    (d / "model.safetensors").write_bytes(bytes(data))
    cases.append((d, "not a readable safetensors file"))
    d = copy_ckpt(ckpt, tmp_path / "mismatch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, shared_intermediate_size=44)))
    cases.append((d, "wrong shape: model.layers.0.shared_mlp.input_linear.weight"))
    d = copy_ckpt(ckpt, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    cases.append((d, "no tokenizer.json"))
    d = copy_ckpt(ckpt, tmp_path / "badtok")
    (d / "tokenizer.json").write_text("{}")
    cases.append((d, "cannot be read as a tokenizers file"))
    for path, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(path)


def test_no_unpickling_anywhere_in_the_engine():
    """Weights are read only through safetensors: no pickle, torch.load, eval or exec in the code."""
    root = Path(__file__).resolve().parent.parent
    for f in list((root / "nano_spec").rglob("*.py")) + list((root / "kernels" / "nano_spec_kernels").glob("*.py")):
        src = f.read_text()
        for banned in (r"torch\.load\(", r"import pickle", r"pickle\.loads?\(", r"(?<![\w.])eval\(", r"(?<![\w.])exec\(",
                       r"trust_remote_code"):
            assert not re.search(banned, src), f"{f.name} matches {banned}"


def test_non_finite_logits_end_only_that_sequence(ckpt, reference, monkeypatch):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=4)
    real, calls = llm.model.verify, []

    def poisoned(ids, slot_ids, *a, **kw):
        logits = real(ids, slot_ids, *a, **kw)
        calls.append(1)
        if len(calls) == 2:
            logits[slot_ids.tolist().index(1)] = float("nan")  # the sequence in slot 1
        return logits

    monkeypatch.setattr(llm.model, "verify", poisoned)
    outs = llm.generate(PROMPTS[:4], PARAMS)
    assert outs[1].finish_reason == "error" and outs[1].error == "non-finite logits"
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [r for i, r in enumerate(reference[:4]) if i != 1]
    assert_idle(llm)


@pytest.mark.parametrize("where, bad_id", [("proposer", -1), ("proposer", "V"), ("proposer", 10**9), ("prefill", None)],
                         ids=["draft-id-minus-1", "draft-id-V", "draft-id-1e9", "prefill-raises"])
def test_fault_in_one_sequence_ends_only_it(ckpt, reference, monkeypatch, where, bad_id):
    """A fault that belongs to one row: a draft id outside the vocabulary, or an exception in its admission."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=4)
    victim = {"seq": None}
    if where == "proposer":  # an object of the caller's, checked at the boundary as LLM(proposer=obj) wraps it:
        # it corrupts the victim's row
        inner, bad = llm.drafter, llm.model.cfg.vocab_size if bad_id == "V" else bad_id

        class Corrupting:
            max_drafts = inner.max_drafts
            admit, catch_up = inner.admit, inner.catch_up

            def draft(self, seqs, gamma, uniforms):
                d = inner.draft(seqs, gamma, uniforms)
                if victim["seq"] in seqs and len(victim["seq"].generated) > 3:
                    d.tokens[seqs.index(victim["seq"]), gamma - 1] = bad
                return d

        llm.runner.drafter = Checked(Corrupting(), llm.model.cfg.vocab_size, "cpu")
    else:
        real_prefill = llm.model.prefill

        def prefill(ids, slot, cache, *tapped_out):
            if slot == victim["seq"].slot:
                raise RuntimeError("injected prefill fault")
            return real_prefill(ids, slot, cache, *tapped_out)

        monkeypatch.setattr(llm.model, "prefill", prefill)
    enc = llm.tokenizer.encode
    seqs = [llm.scheduler.add(enc(p), PARAMS) for p in PROMPTS[:4]]
    victim["seq"] = seqs[2]
    while llm.scheduler.has_work():
        llm.scheduler.step()
    want = "proposer: draft ids outside" if where == "proposer" else "injected prefill fault"
    assert seqs[2].finish_reason == "error" and want in seqs[2].error, seqs[2].error
    assert seqs[2].generated == reference[2][: len(seqs[2].generated)]  # what it emitted before is right
    if where == "proposer":
        assert llm.stats["propose_failures"] == 1
    assert [s.generated for i, s in enumerate(seqs) if i != 2] == [r for i, r in enumerate(reference[:4]) if i != 2]
    assert_idle(llm)
    # the slot the failed request used serves the next request as a fresh engine would
    assert llm.generate(PROMPTS[4], PARAMS)[0].token_ids == reference[4]


def test_exception_in_a_step_ends_that_steps_sequences(ckpt, reference, monkeypatch):
    """An exception no row owns (here, in the commit) ends every sequence of that step with an error and frees
    their slots; generate returns instead of raising, and the engine then serves requests as a fresh one would."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    real, calls = llm.model.ops.commit_state, []

    def commit_state(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected commit fault")
        return real(*args)

    monkeypatch.setattr(llm.model.ops, "commit_state", commit_state)
    outs = llm.generate(PROMPTS[:3], PARAMS)
    assert [o.finish_reason for o in outs[:2]] == ["error"] * 2
    assert all(o.error == "step: RuntimeError: injected commit fault" for o in outs[:2])
    assert outs[2].token_ids == reference[2]  # waiting when the step failed: admitted after, unharmed
    assert_idle(llm)
    assert llm.generate(PROMPTS[4], PARAMS)[0].token_ids == reference[4]


def test_cancel_mid_flight_frees_the_slot(ckpt, reference):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    stream = llm.stream(PROMPTS[1], SamplingParams(max_new_tokens=50, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert_idle(llm)
    assert llm.generate(PROMPTS[3], PARAMS)[0].token_ids == reference[3]


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_load_256_requests_nothing_lost(ckpt):
    rng = random.Random(0)
    words = ["def", "x", "(", ")", ":", "\n", "    ", "return", "for", "i", "in", "range", "1", "+", "héllo"]
    distinct = ["".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(32)]
    lengths = [rng.randint(1, 14) for _ in distinct]
    alone = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    want = [alone.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids
            for p, n in zip(distinct, lengths)]
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=8)
    rss = []
    for round_ in range(3):
        order = [rng.randrange(32) for _ in range(256)]
        outs = llm.generate([distinct[i] for i in order],
                            [SamplingParams(max_new_tokens=lengths[i], ignore_eos=True) for i in order])
        assert len(outs) == 256 and all(o.finish_reason == "length" for o in outs)
        assert [o.token_ids for o in outs] == [want[i] for i in order]
        assert_idle(llm)
        rss.append(rss_bytes())
    print(f"resident memory after each round of 256 requests: {[round(r / 2**20, 1) for r in rss]} MiB")
    assert rss[2] <= 1.05 * rss[0], f"resident memory grew: {[r >> 20 for r in rss]} MiB"
