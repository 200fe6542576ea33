"""The command-line tools in a subprocess: python -m nano_spec.generate and python -m nano_spec.bench."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", seed=2)


def cli(*args, module="nano_spec.generate", timeout=300):
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("flags", [["--no-spec"], ["--proposer", "mtp"], ["--proposer", "ngram", "--num-drafts", "2"]],
                         ids=["plain", "mtp", "ngram"])
def test_generate_json_runs_end_to_end(ckpt, flags):
    rc, out, err = cli("--model", ckpt, "--prompt", "def f(x):", "--prompt", "x = 1", "--max-new-tokens", 6,
                       "--json", "--backend", "torch", *flags)
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "x = 1"]
    assert all(len(r["token_ids"]) <= 6 and r["finish_reason"] in ("stop", "length") for r in rows)


def test_generate_streams_one_prompt_with_stats(ckpt):
    rc, out, err = cli("--model", ckpt, "--prompt", "for i in", "--max-new-tokens", 5, "--stats")
    assert rc == 0, err
    assert out.startswith("for i in") and "tau" in err and "verify" in err


def test_generate_with_no_arguments_is_the_demo():
    """The shipped weights write a class a method body at a time: the printed file is Python, no line loops, and what
    the model wrote compresses like code (zlib ratio >= 0.45; a loop of one phrase gives about 0.3). Then the report:
    speculation's steps and tau, and plain decoding of the same prompts, which gave the same tokens."""
    import ast
    import collections
    import zlib

    from nano_spec.generate import DEMO_CLASS, DEMO_METHODS

    rc, out, err = cli()
    assert rc == 0, err
    ast.parse(out)
    assert out.startswith(DEMO_CLASS) and all(m in out for m in DEMO_METHODS)
    lines = collections.Counter(line for line in out.splitlines() if line.strip())
    assert max(lines.values()) <= 2, lines.most_common(3)
    written = out[len(DEMO_CLASS):]
    for method in DEMO_METHODS:
        written = written.replace(method, "", 1)
    assert len(zlib.compress(written.encode(), 9)) / len(written.encode()) >= 0.45, written
    assert "verify steps (tau" in err and "plain decoding of the same prompts" in err and "the same tokens" in err


def test_show_drafts_leaves_out_a_stop_string():
    """A stop string's tokens are generated but not part of the text: the marked completion ends where the text does."""
    from nano_spec import LLM, SamplingParams
    from nano_spec.generate import show_drafts

    llm = LLM(max_batch=1)
    o = llm.generate("def push(self, item):\n    self.items.", SamplingParams(max_new_tokens=16, stop=("(",)))[0]
    assert o.finish_reason == "stop" and len(o.token_ids) >= 2
    marked = show_drafts(llm.tokenizer, o, colour=False)
    assert "".join(c for c in marked if c not in "[]{}<>|") == o.text


def test_user_errors_exit_2_without_traceback(ckpt, tmp_path, capsys):
    """In this process (main(argv) is what the module runs), as a dozen interpreter starts cost half a minute:
    an exception that escaped would fail the test as a traceback would."""
    from nano_spec.generate import main

    bad_utf8 = tmp_path / "bad.txt"
    bad_utf8.write_bytes(b"\xff\xfe\x00 prompt\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "x = 1"}\n\n{"prompt": oops}\n')  # line 3, after a blank line
    cases = {
        ("--model", tmp_path / "missing"): "not a checkpoint directory",
        ("--model", ckpt, "--temperature", "-1"): "SamplingParams.temperature",
        ("--model", ckpt, "--top-p", "0"): "SamplingParams.top_p",
        ("--model", ckpt, "--max-new-tokens", "0"): "SamplingParams.max_new_tokens",
        ("--model", ckpt, "--num-drafts", "-2"): "num_drafts",
        ("--model", ckpt, "--prompts-file", tmp_path / "none.txt"): "cannot read",
        ("--model", ckpt, "--prompts-file", bad_utf8): "not UTF-8",
        ("--model", ckpt, "--prompts-file", bad_json): "line 3 is not JSON",
        ("--model", ckpt, "--max-seq-len", "8", "--prompt", "x " * 30): "max_seq_len 8",
        ("--model", ckpt, "--prompt", ""): "empty prompt",
        ("--model", ckpt, "--dtype", "int8"): "dtype",
        ("--model", ckpt, "--device", "cuda:7") if not __import__("torch").cuda.is_available() else
        ("--model", ckpt, "--device", "nope"): "device",
    }
    for args, message in cases.items():
        rc = main([str(a) for a in args])
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert message in err and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def test_bench_tiny_setting_json(ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "x = 1", "for"]))
    rc, out, err = cli("--model", ckpt, "--prompts-file", prompts, "--max-new-tokens", 5, "--gammas", 1, 2,
                       "--batch", 1, 2, "--backend", "torch", module="nano_spec.bench")
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical"] is True
    assert {(r["proposer"], r["gamma"], r["batch"]) for r in result["rows"]} == {
        (p, g, b) for b in (1, 2) for p, g in [("none", 0), ("mtp", 1), ("mtp", 2), ("mtp", "auto"), ("ngram", 3)]}
    assert "targets" in out and all(r["cpu_s"] > 0 for r in result["rows"])


def test_bench_floor_records_every_weight_a_step_reads(ckpt):
    """The matmul floor of a bench row replays the matmuls of the device steps: a plain step reads every linear
    weight of the target (the fused q/k/v one, the output layer, the MTP head never), an MTP γ=2 step the MTP
    head's too."""
    from nano_spec.bench import Engine
    from nano_spec.bench_floor import matmul_floor_ms, record

    class Args:
        backend, device, threads, dtype, temperature, top_k, top_p = "torch", "cpu", 1, None, 0.0, 0, 1.0

    for proposer, gamma in [("none", 0), ("mtp", 2)]:
        engine = Engine(ckpt, proposer, gamma, 1, Args)
        m = engine.llm.model
        linears = {n: mod.weight for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
        if m.lm_head is None:
            linears["embed_tokens"] = m.model.embed_tokens.weight  # the tied lm_head
        linears.update({f"{n}.qkv": mod.qkv_weight for n, mod in m.named_modules() if hasattr(mod, "qkv_weight")})
        want = {n for n in linears if proposer == "mtp" or not n.startswith("mtp")} - {
            n for n in linears if n.endswith(("q_proj", "k_proj", "v_proj"))}  # fused into qkv for inference
        ptrs = {w.data_ptr(): n for n, w in linears.items()}
        ids = [engine.llm.tokenizer.encode("def f(x):")]
        calls, drafted, steps = record(engine.llm, lambda: engine.generate(ids, 6))
        read = [{ptrs[a.data_ptr()] for a in args if isinstance(a, torch.Tensor) and a.data_ptr() in ptrs}
                for _, args, _ in calls]
        floors = matmul_floor_ms(engine.llm, lambda: engine.generate(ids, 6))
        assert steps == engine.llm.stats["verify_steps"] and floors["aten"] > 0 and floors["rows"] > 0
        assert set().union(*read) == want, (proposer, set().union(*read) ^ want)
        # the drafter's calls (replayed over int8 copies) read its head's weights and the output layer, no other
        by_drafts = set().union(*(r for i, r in enumerate(read) if i in drafted))
        head = {n for n in want if n.startswith("mtp")}
        assert by_drafts == (head | ({"embed_tokens"} if m.lm_head is None else {"lm_head"}) if head else set())
        assert not head & set().union(*(r for i, r in enumerate(read) if i not in drafted))


def test_bench_samples_requests(ckpt, tmp_path, capsys):
    """--temperature with --top-k 1 samples from one token: the rows equal greedy plain decoding, so the settings
    reach every request; the outputs are not compared across configurations; a greedy baseline is refused."""
    from nano_spec import LLM, SamplingParams
    from nano_spec.bench import main

    prompts = ["def f(x):", "x = 1"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    flags = ["--model", str(ckpt), "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "6", "--gammas",
             "2", "--batch", "2", "--no-ngram", "--no-dflash", "--repeats", "1", "--backend", "torch",
             "--temperature", "0.9", "--top-k", "1"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical"] is False and result["sampling"] == {"temperature": 0.9, "top_k": 1, "top_p": 1.0}
    assert "sampled at temperature 0.9, top-k 1, top-p 1, unseeded" in out
    assert {r["config"] for r in result["rows"]} == {"plain", "mtp γ=2", "mtp γ=auto"}

    from nano_spec.bench import Engine, parse_args
    llm = LLM(ckpt, backend="torch", proposer="none")
    ids = [llm.tokenizer.encode(p) for p in prompts]
    greedy = [o.token_ids for o in llm.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert Engine(ckpt, "mtp", 2, 2, parse_args(flags)).generate(ids, 6) == greedy
    assert main(flags + ["--vs-transformers"]) == 2
    err = capsys.readouterr().err
    assert "--temperature" in err and len(err.strip().splitlines()) == 1, err


def test_bench_ratios_pair_the_rounds():
    """A machine that slows down mid-run, between the two rows' second rounds: two of three rounds say the first row
    is twice as fast; the ratio of the rows' median rounds (3 s against 2.5 s) would call it the slower."""
    from nano_spec.bench import paired, ratio

    fast = {"tokens": 100, "rounds_s": [1.0, 3.0, 3.0]}
    slow = {"tokens": 100, "rounds_s": [2.0, 2.5, 6.0]}
    assert paired(fast, slow) == pytest.approx(2.0)  # per round 2.0, 0.83, 2.0
    assert ratio({1: {"a": fast, "c": slow}}, 1, "a", "c") == pytest.approx(2.0)
    assert ratio({1: {"a": fast}}, 1, "a", "c") is None and ratio({}, 8, "a", "c") is None
    short = {"tokens": 50, "rounds_s": [1.0, 1.0, 1.0]}  # half the tokens in the same time
    assert paired(short, {"tokens": 100, "rounds_s": [1.0, 1.0, 1.0]}) == pytest.approx(0.5)


def test_bench_plot_writes_a_png(ckpt, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from nano_spec.bench import main

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    assert main(["--model", str(ckpt), "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4",
                 "--gammas", "1", "2", "--batch", "1", "--no-ngram", "--no-auto", "--no-dflash", "--repeats", "1",
                 "--backend", "torch", "--plot", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dflash_ckpt(tmp_path_factory):
    """A tiny checkpoint with a random DFlash drafter in its dflash/ directory."""
    from test_dflash import tiny_drafter

    from nano_spec.model.config import ModelConfig
    from nano_spec.model.weights import save_model

    path = tiny_checkpoint(tmp_path_factory.mktemp("cli-dflash") / "tiny", seed=2)
    save_model(tiny_drafter(ModelConfig.from_file(path / "config.json"), layers=1, block=4), path / "dflash")
    return path


def test_generate_with_the_block_drafter_shows_its_drafts(dflash_ckpt):
    """--proposer dflash with --show-drafts, --trace and --stats: the drafts shown are the ones verified."""
    rc, out, err = cli("--model", dflash_ckpt, "--prompt", "def f(x):", "--prompt", "x = 1", "--max-new-tokens", 8,
                       "--proposer", "dflash", "--num-drafts", 3, "--show-drafts", "--trace", "--stats")
    assert rc == 0, err
    assert any(mark in out for mark in "[{<")  # origins marked: accepted draft, correction, bonus
    assert "drafts [" in err and "tau" in err and "propose" in err
    rc, _, err = cli("--model", dflash_ckpt, "--proposer", "dflash", "--num-drafts", 4, "--max-new-tokens", 2)
    assert rc == 2 and "at most 3" in err and "Traceback" not in err, err


def test_bench_has_the_drafter_rows(dflash_ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    rc, out, err = cli("--model", dflash_ckpt, "--prompts-file", prompts, "--max-new-tokens", 4, "--gammas", 1,
                       "--batch", 1, "--no-ngram", "--backend", "torch", "--repeats", 1, module="nano_spec.bench")
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical"] is True
    assert {(r["proposer"], r["gamma"]) for r in result["rows"]} == {
        ("none", 0), ("mtp", 1), ("mtp", "auto"), ("dflash", 1), ("dflash", 2), ("dflash", 3), ("dflash", "auto")}
    assert "dflash auto vs plain, batch 1" in out


def test_bench_compile_adds_compiled_rows_equal_to_plain(ckpt, tmp_path):
    """--compile: beside each configuration its "+compiled" copy, under a schema too, outputs checked against
    plain decoding in the same mode."""
    prompts, schema = tmp_path / "p.jsonl", tmp_path / "s.json"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "x = 1"]))
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    rc, out, err = cli("--model", ckpt, "--prompts-file", prompts, "--max-new-tokens", 6, "--gammas", 1, "--batch", 1,
                       "--no-auto", "--no-ngram", "--no-dflash", "--repeats", 1, "--backend", "torch", "--threads", 1,
                       "--compile", "--json-schema", schema, module="nano_spec.bench")
    assert rc == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    rows = {r["config"]: r for r in result["rows"]}
    assert result["identical"] is True and set(rows) == {
        f"{c}{mode}" for c in ("plain", "mtp γ=1") for mode in ("", " +compiled", " +schema", " +schema +compiled")}
    assert rows["mtp γ=1 +schema +compiled"]["mask_ms_per_step"] > 0  # its steps ran with the verify's masks
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert (rows["mtp γ=1 +compiled"]["proposer"], rows["mtp γ=1 +compiled"]["gamma"]) == ("mtp", 1)
    assert "compiled plain vs eager plain, decode tokens/s, batch 1" in out
