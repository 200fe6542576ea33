"""python -m nano_spec.bench --vs-llama-cpp: the llama.cpp row, its identity check and its refusals, in process,
on a stand-in llama_cpp module that yields given tokens; the real llama-cpp-python when NANO_SPEC_GGUF names a GGUF."""
import json
import os
import sys
import time
import types

import pytest

from helpers import tiny_checkpoint

PROMPTS = ["def f(x):", "x = 1"]
TINY = ["--num-prompts", "2", "--max-new-tokens", "6", "--gammas", "1", "--batch", "1", "--no-ngram", "--no-auto",
        "--no-dflash", "--repeats", "1", "--backend", "torch", "--threads", "1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("llama-cpp") / "tiny", seed=2)
    (path / "eval_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def plain_tokens(path, **kw):
    """{prompt ids: plain decoding's 6 tokens}, as the bench's "plain" row decodes them (kw: e.g. its dtype)."""
    from nano_spec.engine.llm import LLM
    from nano_spec.model.sampling import SamplingParams

    llm = LLM(path, backend="torch", proposer="none", max_batch=1, threads=1, **kw)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    return {tuple(i): o.token_ids for i, o in zip(ids, outs)}


@pytest.fixture(scope="module")
def plain(ckpt):
    return plain_tokens(ckpt)


def fake_llama_cpp(answers, calls, file_type="0"):
    """A module standing in for llama_cpp: Llama.generate yields answers[prompt ids], then token 0 forever
    (llama.cpp does not stop at EOS), and clears the list it was given, as the real one does; its metadata holds
    the GGUF's file type as the real one's does, a string."""

    class Llama:
        def __init__(self, model_path, **kw):
            calls.append(dict(kw, model_path=model_path))
            self.metadata = {"general.type": "model", "general.file_type": file_type}

        def reset(self):
            calls.append("reset")

        def generate(self, tokens, **kw):
            assert (kw["temp"], kw["top_k"], kw["repeat_penalty"]) == (0.0, 1, 1.0), kw
            answer = answers[tuple(tokens)]
            tokens.clear()
            for t in answer:
                time.sleep(0.002)  # a decode time the row can divide by
                yield t
            while True:
                yield 0

    return types.SimpleNamespace(Llama=Llama)


def bench(ckpt, *flags):
    from nano_spec.bench import main

    return main(["--model", str(ckpt), *TINY, *map(str, flags)])


def test_llama_cpp_row_with_plain_decodings_tokens(ckpt, plain, tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp(plain, calls))
    rc = bench(ckpt, "--vs-llama-cpp", gguf)
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {r["config"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"plain", "mtp γ=1", "llama.cpp"}
    row = rows["llama.cpp"]
    assert row["tokens"] == 12 and row["decode_tokens_per_s"] > 0 and row["steps_s"] >= 2 * 5 * 0.002
    assert row["decode_tokens_per_s"] == pytest.approx((12 - 2) / row["steps_s"])
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    line = next(x for x in out.splitlines() if x.split()[2:3] == ["llama.cpp"])
    assert f"{row['decode_tokens_per_s']:.1f}" in line and "the same base weights in a GGUF of f32" in line
    assert "compiled auto vs llama.cpp plain, decode tokens/s, batch 1" in out
    made = calls[0]
    assert made["model_path"] == str(gguf) and made["n_threads"] == 1
    assert made["n_ctx"] >= max(map(len, plain)) + 6
    assert calls.count("reset") == 1 + 2  # the warm-up's prompt, then each prompt of the round


def test_bf16_engines_beside_a_bf16_gguf(ckpt, tmp_path, monkeypatch, capsys):
    """--dtype bfloat16: every nano_spec row runs in bf16 (its greedy tokens, compared with bf16 plain decoding's,
    are those of a bf16 engine), and the llama.cpp row names the GGUF's type."""
    bf16 = plain_tokens(ckpt, dtype="bfloat16")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp(bf16, [], file_type="32"))
    rc = bench(ckpt, "--vs-llama-cpp", gguf, "--dtype", "bfloat16")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["dtype"] == "bfloat16"
    line = next(x for x in out.splitlines() if x.split()[2:3] == ["llama.cpp"])
    assert "the same base weights in a GGUF of bf16" in line


def test_a_checkpoint_without_an_mtp_head_has_no_mtp_rows(tmp_path, monkeypatch, capsys):
    """A published checkpoint has no MTP head: the bench leaves its MTP rows out and times the rest."""
    path = tiny_checkpoint(tmp_path / "no-mtp", seed=2, num_nextn_predict_layers=0)
    (path / "eval_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp(plain_tokens(path), []))
    rc = bench(path, "--vs-llama-cpp", gguf)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert {r["config"] for r in json.loads(out.strip().splitlines()[-1])["rows"]} == {"plain", "llama.cpp"}
    assert "no-mtp has no MTP head: no MTP rows" in err


def test_llama_cpp_row_that_differs_names_prompt_and_token(ckpt, plain, tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    second, tokens = list(plain.items())[1]
    wrong = {**plain, second: tokens[:3] + [tokens[3] ^ 1] + tokens[4:]}
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp(wrong, []))
    rc = bench(ckpt, "--vs-llama-cpp", gguf)
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert err.strip().splitlines()[-1] == "error: greedy outputs differ from plain: llama.cpp at batch 1, prompt 1, " \
                                           "token 3"
    assert '"identical": true' not in out


def test_vs_llama_cpp_without_llama_cpp_python(ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    rc = bench(ckpt, "--vs-llama-cpp", "x.gguf")
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --vs-llama-cpp needs llama-cpp-python (") and "pip install" in err, err


def test_vs_llama_cpp_with_a_missing_gguf(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp({}, []))
    rc = bench(ckpt, "--vs-llama-cpp", tmp_path / "none.gguf")
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--vs-llama-cpp" in err and "none.gguf" in err and "Traceback" not in err, err


def test_vs_llama_cpp_for_real(capsys):
    """The shipped weights against their GGUF (scripts/export_gguf.py) through llama-cpp-python itself."""
    gguf = os.environ.get("NANO_SPEC_GGUF")
    if not gguf:
        pytest.skip("NANO_SPEC_GGUF names no GGUF of the shipped weights (docs/BENCHMARKS.md, 'Beside llama.cpp')")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from nano_spec.bench import main

    rc = main(["--vs-llama-cpp", gguf, *TINY])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    rows = {r["config"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert rows["llama.cpp"]["tokens"] == 12 and rows["llama.cpp"]["decode_tokens_per_s"] > 0


@pytest.fixture
def untimed(monkeypatch):
    """The bench's timing fails the test if a run gets that far: each refusal below must come first."""
    from nano_spec import bench

    def measure(engines, ids, args):
        pytest.fail(f"timed {[e.name for e in engines]} before the refusal")

    monkeypatch.setattr(bench, "measure", measure)


def test_vs_llama_cpp_without_batch_1_is_a_usage_error(ckpt, tmp_path, monkeypatch, untimed, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp({}, []))
    rc = bench(ckpt, "--vs-llama-cpp", gguf, "--batch", 2, 8)  # the last --batch wins over TINY's
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --vs-llama-cpp") and "--batch" in err and "Traceback" not in err, err


@pytest.mark.parametrize("content", [b"", b"GGU", b"gguf\x03\x00\x00\x00", b"\x00GGUF", b"PK\x03\x04 a zip"],
                         ids=["empty", "short", "lower-case", "magic-not-at-0", "zip"])
def test_vs_llama_cpp_refuses_a_file_without_the_gguf_magic_before_timing(ckpt, tmp_path, monkeypatch, untimed,
                                                                          capsys, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp({}, []))
    rc = bench(ckpt, "--vs-llama-cpp", bad, "--batch", 2, 1)  # batch 2 would be timed first
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --vs-llama-cpp") and "bad.gguf" in err and "GGUF" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_vs_llama_cpp_refuses_an_unreadable_file_before_timing(ckpt, tmp_path, monkeypatch, untimed, capsys):
    gguf = tmp_path / "locked.gguf"
    gguf.write_bytes(b"GGUF")
    gguf.chmod(0)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp({}, []))
    rc = bench(ckpt, "--vs-llama-cpp", gguf, "--batch", 2, 1)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --vs-llama-cpp") and "locked.gguf" in err, err


@pytest.mark.parametrize("fp32", [True, False], ids=["fp32", "bf16"])
def test_each_row_is_checked_against_plain_decoding_in_its_own_mode(fp32):
    """Compiled rows against compiled plain (lossless within the mode; under a schema, compiled plain under it);
    compiled plain, llama.cpp and transformers against eager plain only in fp32, where their other summation
    orders cannot move a bf16 rounding; everything else against eager."""
    from nano_spec.bench import identity_base

    other_engine = "plain" if fp32 else None
    want = {"plain": "plain", "mtp γ=3": "plain", "llama.cpp": other_engine, "transformers": other_engine,
            "mtp γ=3 +schema": "plain +schema", "mtp γ=auto +compiled": "plain +compiled",
            "ngram γ=3 +compiled": "plain +compiled", "plain +compiled": other_engine,
            "mtp γ=3 +schema +compiled": "plain +schema +compiled",
            "plain +schema +compiled": "plain +schema" if fp32 else None}
    assert {c: identity_base(c, fp32) for c in want} == want
