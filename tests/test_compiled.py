"""LLM(compile=True): the verify through torch.compile gives the eager engine's tokens.

One compiled engine per proposer serves every case (its graphs are per bucket, not per request), so the
whole file compiles the buckets B in {1, 2, 4} x K <= γ_max + 1 of each proposer setting.
"""
import pytest
import torch

from helpers import load_script, tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.model.compiled import bucket

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓ héllo", "x = 1\ny = 2\n" * 3]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=11)
SCHEMA = SamplingParams(max_new_tokens=40, json_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"]})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "tiny", seed=5)


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("proposer, gamma", [("none", 0), ("mtp", 3), ("mtp", "auto"), ("ngram", 3)])
def test_compiled_tokens_equal_eager(ckpt, proposer, gamma):
    kw = dict(proposer=proposer, num_drafts=gamma, max_batch=3, backend="torch", device="cpu", max_seq_len=96)
    eager, compiled = LLM(ckpt, **kw), LLM(ckpt, compile=True, **kw)
    # batch 1; batch 3 with slot reuse; a JSON schema. Under auto each engine's planner picks γ from its own
    # clock, so their random draws differ: greedy only there (lossless whatever γ is picked)
    cases = [(PROMPTS[:1], GREEDY), (PROMPTS, GREEDY), (PROMPTS[:3], SCHEMA)]
    cases += [] if gamma == "auto" else [(PROMPTS, SAMPLED)]
    for prompts, params in cases:
        assert tokens(compiled, prompts, params) == tokens(eager, prompts, params), (proposer, len(prompts), params)
        if gamma == "auto" and params is GREEDY and len(prompts) == 1:
            # the planner learns every eager step's time, and no time of a step that compiled a graph
            assert sum(eager.planner.hist.values()) == eager.scheduler.steps
            assert 0 < sum(compiled.planner.hist.values()) < compiled.scheduler.steps
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    if proposer == "mtp":  # the draft step and the catch-up ran compiled
        assert all(b.seen for b in compiled.drafter.compiled.values()) and eager.drafter.compiled is None


def test_bf16_compiled_plain_equals_bf16_eager(ckpt):
    """Inductor keeps a fused chain of bf16 ops in fp32 unless told to round after each op as eager does
    (emulate_precision_casts): without it every one of these prompts parts from eager within 40 tokens."""
    kw = dict(proposer="none", num_drafts=0, max_batch=3, backend="torch", device="cpu", max_seq_len=96,
              dtype="bfloat16")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    assert tokens(LLM(ckpt, compile=True, **kw), PROMPTS, params) == tokens(LLM(ckpt, **kw), PROMPTS, params)


def test_dynamo_settings_of_the_process_are_left_as_they_were(ckpt):
    """The recompile limit and its fail switch hold inside the compiled calls only."""
    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    llm = LLM(ckpt, compile=True, proposer="mtp", num_drafts=3, max_batch=3, backend="torch", device="cpu",
              max_seq_len=96)
    seen = []
    llm.on_step = lambda report: seen.append((config.recompile_limit, config.fail_on_recompile_limit_hit))
    tokens(llm, PROMPTS[:2], GREEDY)
    assert set(seen) == {before} and (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


def test_buckets():
    assert [bucket(b, 1, 6) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [bucket(n, 128, 300) for n in (1, 128, 129, 257)] == [128, 128, 256, 300]


def test_compile_flag_checked(ckpt):
    with pytest.raises(ValueError, match="compile"):
        LLM(ckpt, compile="yes", backend="torch", device="cpu")


def test_verify_padded_batch_writes_like_row_0(ckpt):
    """A batch of 3 in a 4-slot engine runs padded to 4 rows: the padding repeats row 0, so the live states of
    the 3 slots equal the eager verify's and the free slot is untouched."""
    eager = LLM(ckpt, max_batch=4, backend="torch", device="cpu", max_seq_len=32)
    compiled = LLM(ckpt, max_batch=4, backend="torch", device="cpu", max_seq_len=32, compile=True)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8], [9, 10, 11]])
    slots, seq_lens = torch.tensor([2, 0, 1]), torch.tensor([0, 0, 0])
    with torch.no_grad():
        ref = eager.model.verify(ids, slots, seq_lens, eager.runner.cache, 3)
        out, Bp = compiled.runner.compiled(ids, slots, seq_lens, compiled.runner.cache, kv_len=3)
    assert Bp == 4
    torch.testing.assert_close(out, ref)
    e, c = eager.runner.cache, compiled.runner.cache
    torch.testing.assert_close(c.ssm_state, e.ssm_state)
    torch.testing.assert_close(c.conv_state, e.conv_state)
    torch.testing.assert_close(c.k[:, :, :3], e.k[:, :, :3])
    assert not c.ssm_state[:, 3].any() and not c.k[:, 3].any()
    torch.testing.assert_close(c.ssm_stash(4, 3)[:, :3], e.ssm_stash(3, 3))
    torch.testing.assert_close(c.conv_stash(4, 3)[:, :3], e.conv_stash(3, 3))
    torch.testing.assert_close(c.hidden_stash(3, 3), e.hidden_stash(3, 3))


def test_compile_profile_script(ckpt, capsys):
    """scripts/compile_profile.py on the tiny model: the step's matmuls alone cost less than the whole eager verify
    that contains them, and the compiled call's profile lists its matmuls."""
    import json

    load_script("compile_profile").main(["--model", str(ckpt), "--k", "2", "--rounds", "3", "--calls", "3", "--top", "40"])
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < row["matmul floor ms"] < row["eager ms"] and row["compiled ms"] > 0 and row["K"] == 2
    assert any(op["op"] == "aten::mm" for op in row["compiled_ops"])


def test_step_profile_compiled_rows(ckpt, capsys):
    """scripts/step_profile.py --compile profiles each row eager and compiled: the same phases, and the compiled
    verify runs fewer ops (inductor's fused kernels counted one each) than the eager one."""
    import json

    (ckpt / "eval_prompts.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    load_script("step_profile").main(["--model", str(ckpt), "--batch", "1", "--gammas", "0", "--max-new-tokens", "4", "--runs", "1",
                       "--compile"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {(r["mode"], r["phase"]): r for r in rows}
    assert {p for m, p in by if m == "eager"} == {p for m, p in by if m == "compiled"} >= {"prefill", "verify"}
    assert 0 < by["compiled", "verify"]["ops_per_call"] < by["eager", "verify"]["ops_per_call"]


def test_compiled_step_writes_the_caches_where_they_lie(ckpt):
    """The conditions a CUDA graph needs, held on the CPU. Every compiled call is one graph (fullgraph: a graph
    break, which any host sync inside would be, is an error), and nothing copies a cache: no buffer that the
    generated code of a whole generate (verify, MTP drafting and catch-up, accept rule) allocates comes near
    one layer's KV cache, and every cache buffer keeps its address."""
    import math
    import re

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2, max_seq_len=2048, backend="torch", device="cpu",
              compile=True)
    c, mtp = llm.runner.cache, llm.drafter
    buffers = [c.k, c.v, c.conv_state, c.ssm_state, c._ssm_stash, c._conv_stash, c._hidden_stash, mtp.k, mtp.v]
    addresses = [t.data_ptr() for t in buffers]
    with inductor_config.patch(force_disable_caches=True):  # compiled here, so the code is seen
        _, code = run_and_get_code(tokens, llm, PROMPTS[:2], GREEDY)
    allocated = [math.prod(int(d) for d in dims.split(",") if d.strip()) for src in code
                 for dims in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", src)]
    assert len(code) >= 3 and allocated, len(code)  # the verify, the two MTP calls, the accept rule
    layer_kv = c.k[0].numel()  # (S, L, Hkv, Dh) elements
    assert max(allocated) < layer_kv / 8, (max(allocated), layer_kv)
    assert [t.data_ptr() for t in buffers] == addresses
    assert llm.stats["compile_seconds"] > 0


@pytest.mark.parametrize("case", ["greedy", "sampled", "masked-sampled"])
def test_compiled_accept_rule_equals_eager(case):
    """The accept rule as CUDA runs it (compiled; on the CPU the engine runs it eager, as it is cheaper there):
    the same na and tokens as the eager rule for greedy, sampled and grammar-masked rows, at two batch shapes."""
    from nano_spec.model.compiled import CompiledAcceptRule
    from nano_spec.model.ops import Ops
    from nano_spec.model.sampling import BatchSampling, accept_rule

    ops, rule, g = Ops("torch"), CompiledAcceptRule("cpu"), torch.Generator().manual_seed(3)
    for B, K, V in [(3, 4, 50), (5, 2, 50)]:
        logits = torch.randn(B, K, V, generator=g)
        drafts = torch.where(torch.rand(B, K - 1, generator=g) < 0.6, logits[:, :-1].argmax(-1),
                             torch.randint(0, V, (B, K - 1), generator=g))
        nd = torch.randint(0, K, (B,), generator=g)
        params = [SamplingParams(temperature=0.0 if case == "greedy" or b == 0 else 0.8, top_k=20) for b in range(B)]
        sampling = BatchSampling.of(params, "cpu")
        q = None if case == "greedy" else torch.softmax(torch.randn(B, K - 1, V, generator=g), -1)
        u = None if case == "greedy" else torch.rand(B, K, generator=g)
        bitmask = torch.randint(-2**31, 2**31 - 1, (B, K, (V + 31) // 32), dtype=torch.int32, generator=g) \
            if case.startswith("masked") else None
        want = accept_rule(ops, logits, drafts, nd, sampling, q, u, bitmask)
        got = rule(ops, logits, drafts, nd, sampling, q, u, bitmask)
        assert [t.tolist() for t in got] == [t.tolist() for t in want], (case, B, K)
    assert rule.seconds > 0


def test_each_graph_is_announced_before_it_compiles(ckpt):
    """watch_compile hears every graph once, before its first call, with the call's name, its count and the most
    its buckets allow; a warm engine compiles and says nothing."""
    llm = LLM(ckpt, compile=True, proposer="mtp", num_drafts=3, max_batch=3, backend="torch", device="cpu",
              max_seq_len=96)
    heard = []
    llm.watch_compile(lambda what, n, most, threads: heard.append((what, n, most, llm.runner.compile_seconds())))
    tokens(llm, PROMPTS[:2], GREEDY)
    calls = {c.label: c for c in llm.runner.compiled_calls()}
    assert {what for what, *_ in heard} == set(calls) == {"verify", "MTP catch-up", "MTP draft step"}
    for what, call in calls.items():
        ns = [n for w, n, *_ in heard if w == what]
        assert ns == list(range(1, len(call.seen) + 1)) and all(n <= call.most for n in ns), (what, ns)
    assert heard[0][3] == 0.0  # heard before the first graph's compile time was counted
    before = len(heard)
    tokens(llm, PROMPTS[:2], GREEDY)
    assert len(heard) == before


def test_stats_tokens_per_second_leave_compile_time_out(ckpt, capsys):
    from nano_spec.generate import print_stats

    llm = LLM(ckpt, proposer="none", num_drafts=0, max_batch=1, backend="torch", device="cpu", max_seq_len=96)
    outs = llm.generate(PROMPTS[:1], GREEDY)
    st = dict(llm.stats, compile_seconds=8.0)
    print_stats(st, outs, 10.0)  # 10 s in all, 8 of them compiling
    err = capsys.readouterr().err
    assert err.startswith(f"tokens/s {len(outs[0].token_ids) / 2.0:.1f} ") and "compile 8.0 s" in err, err


def test_another_thread_count_is_a_compile_the_engine_sees(ckpt):
    """Inductor's CPU graphs are made for one thread count: a step at another count compiles anew. The engine
    counts that as a compile (announced, timed, kept from the planner and the thread tuner), not as a slow step."""
    llm = LLM(ckpt, compile=True, proposer="none", num_drafts=0, max_batch=1, backend="torch", device="cpu",
              max_seq_len=96)
    tokens(llm, PROMPTS[:1], GREEDY)
    heard, before = [], llm.runner.compile_seconds()
    llm.watch_compile(lambda what, n, most, threads: heard.append((what, n, threads)))
    llm.threads.current = llm.threads.other = 2  # as the thread tuner would, for a probe
    try:
        assert tokens(llm, PROMPTS[:1], GREEDY) == tokens(LLM(ckpt, proposer="none", num_drafts=0, max_batch=1,
                                                             backend="torch", device="cpu", max_seq_len=96),
                                                         PROMPTS[:1], GREEDY)
    finally:
        torch.set_num_threads(1)
    assert heard and {t for *_, t in heard} == {2} and heard[0][1] == 1 and llm.runner.compile_seconds() > before

