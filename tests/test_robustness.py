"""Robustness, second round: streams keep their tail, failures are not reported as success,
settings fail early, slots never leak, metrics agree, and faults that do not matter do not end a
sequence. Each test is named after the defect it holds fixed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_idle, tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.text.tokenizer import IncrementalDecoder

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓", "x = 1\ny = 2\n" * 3]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("robust") / "tiny", seed=4)


@pytest.fixture(scope="module")
def alone(ckpt):
    """Each prompt's text generated alone."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    return [llm.generate(p, PARAMS)[0].text for p in PROMPTS]


# ---- 1. a stream yields its whole text however the request finished ------------------------------
@pytest.mark.parametrize("max_batch", [1, 2, 3], ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("n_streams", [2, 3], ids=lambda n: f"{n}streams")
def test_interleaved_streams_keep_their_tail(ckpt, alone, max_batch, n_streams):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=max_batch)
    streams = [llm.stream(PROMPTS[i], PARAMS) for i in range(n_streams)]
    got = [[next(s)] for s in streams]  # one piece each, then the last stream is drained first
    for i in reversed(range(n_streams)):
        got[i] += list(streams[i])
    assert ["".join(g) for g in got] == alone[:n_streams]
    assert_idle(llm)


@pytest.mark.parametrize("max_batch", [1, 2, 3], ids=lambda b: f"batch{b}")
def test_stream_keeps_its_tail_across_generate(ckpt, alone, max_batch):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=max_batch)
    stream = llm.stream(PROMPTS[3], PARAMS)
    first = next(stream)
    llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=30, ignore_eos=True))  # finishes PROMPTS[3] too
    assert first + "".join(stream) == alone[3]
    assert stream.output.text == alone[3]


def test_stream_keeps_text_held_back_for_a_stop_string(ckpt, alone):
    stop = alone[1][4:9]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop, "never appears in the text"))
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    want = llm.generate(PROMPTS[1], params)[0].text
    stream = llm.stream(PROMPTS[1], params)
    first = next(stream, "")
    llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert first + "".join(stream) == want == alone[1][: alone[1].find(stop)]


# ---- 2. the CLI reports a failed request as a failure --------------------------------------------
@pytest.fixture(scope="module")
def broken_ckpt(tmp_path_factory):
    """A checkpoint whose weights make every logit NaN: each request ends with finish_reason 'error'."""
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint(tmp_path_factory.mktemp("broken") / "tiny", seed=4)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "nano_spec.generate", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stdout, r.stderr


def test_cli_reports_an_engine_failure(broken_ckpt):
    rc, out, err = cli("--model", broken_ckpt, "--prompt", "def f", "--max-new-tokens", 4, "--stats")
    assert rc == 1 and "non-finite logits" in err and "tokens/s -" in err, (rc, err)
    rc, out, err = cli("--model", broken_ckpt, "--prompt", "def f", "--prompt", "x", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and [r["error"] for r in rows] == ["non-finite logits"] * 2
    assert all(r["finish_reason"] == "error" and r["token_ids"] == [] for r in rows)


# ---- 3, 7. settings and inputs that are refused up front, naming the field -----------------------
def write_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


BAD_PARAMS = {
    "seed-2**64": ("seed", dict(seed=2**64)),
    "seed-negative": ("seed", dict(seed=-1)),
    "stop-None": ("stop", dict(stop=None)),
    "stop-5": ("stop", dict(stop=5)),
    "stop_token_ids-5": ("stop_token_ids", dict(stop_token_ids=5)),
    "stop_token_ids-None": ("stop_token_ids", dict(stop_token_ids=None)),
    "stop_token_ids-bool": ("stop_token_ids", dict(stop_token_ids=(True,))),
    "ignore_eos-str": ("ignore_eos", dict(ignore_eos="no")),
    "temperature-bool": ("temperature", dict(temperature=True)),
    "top_p-bool": ("top_p", dict(top_p=True)),
}


@pytest.mark.parametrize("field, kw", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_sampling_params_are_value_errors(field, kw):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


BAD_ENGINE = {
    "model-123": ("model", dict(model=123)),
    "memory_budget-str": ("memory_budget", dict(memory_budget="x")),
    "dtype-123": ("dtype", dict(dtype=123)),
    "dtype-int8": ("dtype", dict(dtype=torch.int8)),
    "device-meta": ("device", dict(device="meta")),
}


@pytest.mark.parametrize("field, kw", BAD_ENGINE.values(), ids=BAD_ENGINE.keys())
def test_bad_engine_settings_are_value_errors(ckpt, field, kw):
    with pytest.raises(ValueError, match=field):
        LLM(**{"model": ckpt, **kw})


def test_triton_backend_without_cuda_or_interpreter_is_refused(ckpt, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the triton backend is valid")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend"):
        LLM(ckpt, backend="triton", device="cpu")


@pytest.mark.parametrize("prompts", [None, 5, 3.5], ids=["None", "int", "float"])
def test_bad_prompts_are_value_errors(ckpt, prompts):
    llm = LLM(ckpt, proposer="none")
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, PARAMS)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, True, 2]], PARAMS)  # a bool is not a token id
    assert_idle(llm)


BAD_CONFIGS = {
    "time_step_limit-5": ("time_step_limit", dict(time_step_limit=5)),
    "time_step_limit-[1]": ("time_step_limit", dict(time_step_limit=[1])),
    "time_step_limit-[abc,1]": ("time_step_limit", dict(time_step_limit=["abc", 1])),
    "rope_theta-0": ("rope_theta", dict(rope_theta=0, position_embedding_type="rope")),
    "model_type-nemotron_h": ("model_type", dict(model_type="nemotron_h")),
    "architectures-bamba": ("architectures", dict(model_type=None, architectures=["BambaForCausalLM"])),
}


@pytest.mark.parametrize("field, changes", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_configs_are_value_errors_in_api_and_cli(ckpt, tmp_path, field, changes):
    bad = write_config(ckpt, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=field):
        LLM(bad)
    rc, _, err = cli("--model", bad, "--max-new-tokens", 2)
    assert rc == 2 and field in err and "Traceback" not in err


# ---- 4. a tiny temperature is (nearly) greedy, never NaN -----------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-300])
def test_tiny_temperature_is_greedy(ckpt, temperature):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    greedy = llm.generate(PROMPTS[:2], PARAMS)
    tiny = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature,
                                                    seed=1))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


# ---- 5. an interrupt never leaks a slot, and generate() never spins --------------------------------
@pytest.mark.parametrize("where", ["prefill", "catch_up", "draft", "verify"])
def test_interrupt_frees_slots_and_cancels_its_requests(ckpt, alone, monkeypatch, where):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    owner = {"prefill": llm.model, "catch_up": llm.drafter, "draft": llm.drafter, "verify": llm.model}[where]
    real = getattr(owner, {"catch_up": "admit", "draft": "draft_rows"}.get(where, where))

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, real.__name__, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:3], PARAMS)
    monkeypatch.setattr(owner, real.__name__, real)
    assert_idle(llm)  # nothing of the interrupted call is queued or running, every slot is free
    assert llm.generate(PROMPTS[3], PARAMS)[0].text == alone[3]


def test_interrupt_ends_a_stream_sharing_the_batch(ckpt, alone, monkeypatch):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    reading, other = llm.stream(PROMPTS[0], PARAMS), llm.stream(PROMPTS[1], PARAMS)
    next(reading), next(other)  # both admitted: reading either steps both
    real = llm.model.ops.commit_state
    monkeypatch.setattr(llm.model.ops, "commit_state", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        list(reading)
    monkeypatch.setattr(llm.model.ops, "commit_state", real)
    list(other)  # its caches were mid-step: it ends with an error instead of continuing from a broken state
    assert other.output.finish_reason == "error" and "interrupted" in other.output.error
    assert_idle(llm)
    assert llm.generate(PROMPTS[2], PARAMS)[0].text == alone[2]


def test_interrupt_in_generate_leaves_a_paused_stream_intact(ckpt, alone, monkeypatch):
    """generate() steps only its own requests, so an interrupt inside it cannot touch a paused stream."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    stream = llm.stream(PROMPTS[0], PARAMS)
    text = next(stream)
    real = llm.model.ops.commit_state
    monkeypatch.setattr(llm.model.ops, "commit_state", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1], PARAMS)
    monkeypatch.setattr(llm.model.ops, "commit_state", real)
    text += "".join(stream)
    assert stream.output.finish_reason == "length" and text == alone[0]
    assert_idle(llm)


def test_generate_raises_instead_of_spinning(ckpt):
    llm = LLM(ckpt, proposer="none", max_batch=1)
    llm.scheduler.free_slots.clear()  # a lost slot: nothing can be admitted
    with pytest.raises(RuntimeError, match="no progress"):
        llm.generate(PROMPTS[0], PARAMS)


# ---- 6. tau = 1 + Σ accept_at on every report ------------------------------------------------------
@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_tau_equals_one_plus_sum_of_accept_at(ckpt, proposer):
    llm = LLM(ckpt, proposer=proposer, num_drafts=4, max_batch=3)
    for n in (1, 2, 3, 5, 13):  # short outputs: many sequences finish part-way through an accepted run
        llm.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
        st = llm.stats
        if n == 1:  # every request ended at its prefill: nothing was verified yet
            assert st["verify_steps"] == 0 and st["tau"] == 0
            continue
        assert st["tau"] == pytest.approx(1 + sum(st["accept_at"]), abs=1e-12)
        for bucket in st["accept_at_by_seq_len"].values():
            assert 0 <= min(bucket["accept_at"]) and max(bucket["accept_at"]) <= 1


# ---- 8. telemetry has a fixed size -----------------------------------------------------------------
def test_telemetry_does_not_grow(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2)

    def size():
        return len(json.dumps(llm.stats)), sum(len(v) for v in llm.telemetry.phase_counts.values())

    llm.generate(PROMPTS[:2], PARAMS)
    before = size()
    llm.generate(PROMPTS * 3, PARAMS)
    assert size()[1] == before[1] and size()[0] <= before[0] + 64  # counts grow in digits, not in entries


# ---- 9. a NaN in a row whose values are not used ends nothing ------------------------------------
def test_nan_in_unused_rows_is_ignored(ckpt, alone, monkeypatch):
    """Row K-1 is used only after a full accept; padding rows and rows past a rejection never are."""
    reports = []
    llm = LLM(ckpt, proposer="ngram", num_drafts=3, max_batch=2, on_step=reports.append)
    real = llm.model.verify

    def poisoned(ids, *a, **kw):
        logits = real(ids, *a, **kw)
        logits[:, -1] = float("nan")  # the last row is used only after a full accept of 3 drafts
        return logits

    monkeypatch.setattr(llm.model, "verify", poisoned)
    want = LLM(ckpt, proposer="ngram", num_drafts=3, max_batch=2).generate(PROMPTS[:2], PARAMS)
    outs = llm.generate(PROMPTS[:2], PARAMS)
    assert all(r.na < 3 for rep in reports for r in rep.rows)
    assert [(o.finish_reason, o.token_ids) for o in outs] == [(w.finish_reason, w.token_ids) for w in want]


# ---- 11. checkpoint checks in the cheap order, and a budget that counts the weights ----------------
def test_missing_tokenizer_is_reported_before_the_weights_are_read(ckpt, tmp_path, monkeypatch):
    bad = write_config(ckpt, tmp_path / "notok")
    (bad / "tokenizer.json").unlink()
    read = []
    monkeypatch.setattr("nano_spec.engine.llm.load_model", lambda *a, **kw: read.append(1))
    with pytest.raises(ValueError, match="tokenizer.json"):
        LLM(bad)
    assert not read


def test_memory_budget_counts_the_weights(ckpt):
    from nano_spec.model.cache import cache_bytes
    from nano_spec.model.config import ModelConfig
    from nano_spec.engine.capacity import weight_bytes
    from nano_spec.drafters.mtp import MTPDrafter

    cfg = ModelConfig.from_file(ckpt / "config.json")
    assert cfg.has_mtp  # the MTP proposer's KV rows count too
    caches = (sum(cache_bytes(cfg, 1, 64 + 8, 4, torch.float32).values()) + 3 * cfg.vocab_size * 4
              + MTPDrafter.state_bytes(cfg, 1, 64 + 8, torch.float32))
    weights = weight_bytes(cfg, torch.float32)
    assert weights == 4 * sum(p.numel() for p in LLM(ckpt, max_seq_len=64).model.parameters())
    with pytest.raises(ValueError, match="weights"):
        LLM(ckpt, max_batch=1, max_seq_len=64, num_drafts=3, memory_budget=caches + weights // 2)
    LLM(ckpt, max_batch=1, max_seq_len=64, num_drafts=3, memory_budget=caches + weights + 1)


# ---- 12. stop strings and streams decode incrementally --------------------------------------------
def test_incremental_decoding_equals_full_decoding(ckpt):
    import random

    llm = LLM(ckpt, proposer="none")
    tok, rng = llm.tokenizer, random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(llm.model.cfg.vocab_size) for _ in range(rng.randint(1, 40))]
        dec = IncrementalDecoder(tok)
        pieces = [dec.add(t) for t in ids]
        assert dec.full_text() == tok.decode(ids)
        assert "".join(pieces) == dec.text and tok.decode(ids).startswith(dec.text)
        pushed, read = IncrementalDecoder(tok), IncrementalDecoder(tok)  # read: every third token; pushed: at the end
        for i, t in enumerate(ids):
            pushed.push(t)
            read.push(t)
            if i % 3 == 2:  # read after every third: the text add() had made by then
                assert read.text == "".join(pieces[: i + 1])
        assert read.text == dec.text and pushed.full_text() == tok.decode(ids)


def test_a_request_no_one_reads_is_decoded_once(ckpt, monkeypatch):
    """Without a stop string or a stream, a step only appends a request's tokens: its text is decoded once, when
    the output is made (one window and its context), and equals the decode of all its tokens."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3)
    real, calls = llm.tokenizer.decode, []
    monkeypatch.setattr(llm.tokenizer, "decode", lambda ids: calls.append(1) or real(ids))
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 and len(calls) <= 2, len(calls)
    assert out.text == real(out.token_ids)


def test_stop_strings_do_not_redecode_the_whole_output(ckpt, monkeypatch):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3)
    decoded = []
    real = llm.tokenizer.decode
    monkeypatch.setattr(llm.tokenizer, "decode", lambda ids: decoded.append(len(list(ids))) or real(ids))
    n = 120
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=n, ignore_eos=True, stop=("never in the text",)))[0]
    assert len(out.token_ids) == n
    assert sum(decoded) < 12 * n, f"{sum(decoded)} token decodes for {n} tokens: quadratic"
