"""The step's modes (nano_spec/engine/graph.py): LLM(compile=True) runs the device step as one torch.compile graph
per bucket and gives the eager engine's tokens; the step function holds, on the CPU, the conditions a CUDA graph
capture needs.

One compiled engine per proposer serves every case (its graphs are per bucket, not per request).
"""
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import int8_rounded, load_script, masked_graphs, tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.engine.graph import Compiled, bucket

PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓ héllo", "x = 1\ny = 2\n" * 3]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=11)
FILTERED = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, top_k=5, top_p=0.9, seed=12)
SCHEMA = SamplingParams(max_new_tokens=40, json_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"]})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "tiny", seed=5)


@pytest.fixture(scope="module")
def dflash_ckpt(tmp_path_factory):
    from test_dflash import tiny_drafter

    from nano_spec.model.config import ModelConfig
    from nano_spec.model.weights import save_model

    path = tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "tiny", seed=5)
    save_model(tiny_drafter(ModelConfig.from_file(path / "config.json"), layers=1, block=4), path / "dflash")
    return path


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@torch.no_grad()
def drafts_at_int8(llm):
    """An eager engine whose drafter reads its weights as a compiled CPU step's does: every weight its products
    read (its networks', the output layer its drafts use) rounded to int8 levels, in place or in a rounded copy."""
    for net in llm.drafter.nets:
        for t in [*net.parameters(), *(m.qkv_weight for m in net.modules() if getattr(m, "qkv_weight", None) is not None)]:
            if t.dim() == 2:
                t.copy_(int8_rounded(t))
    weight, scale = int8_rounded(llm.drafter.head.weight), llm.model.cfg.logits_scaling
    llm.drafter.head = lambda y: F.linear(y, weight) / scale
    return llm


def packed_dtypes(llm) -> set:
    """(dtype, whether the drafter's) of every packed copy a compiled engine holds."""
    draft = {id(t) for net in llm.drafter.nets for t in net.buffers()}
    return {(t.dtype, id(t) in draft) for name, t in llm.model.named_buffers() if "packed" in name} | {
        (t.dtype, True) for net in llm.drafter.nets for name, t in net.named_buffers() if "packed" in name}


@pytest.mark.parametrize("proposer, gamma", [("none", 0), ("mtp", 3), ("mtp", "auto"), ("ngram", 3)])
def test_compiled_tokens_equal_eager(ckpt, proposer, gamma):
    kw = dict(proposer=proposer, num_drafts=gamma, max_batch=3, backend="torch", device="cpu", max_seq_len=96)
    eager, compiled = LLM(ckpt, **kw), LLM(ckpt, compile=True, **kw)
    compiled.runner.graph.compiled.check_guards = True  # every bucket's key names the graph its inputs need
    if proposer == "mtp":  # the drafts read int8 copies, the target fp32 ones: the sampled draws as eager ones at int8
        assert packed_dtypes(compiled) == {(torch.float32, False), (torch.int8, True)}
        drafts_at_int8(eager)
    # batch 1; batch 3 with slot reuse; a JSON schema. Under auto each engine's planner picks γ from its own
    # clock, so their random draws differ: greedy only there (lossless whatever γ is picked)
    cases = [(PROMPTS[:1], GREEDY), (PROMPTS, GREEDY), (PROMPTS[:3], SCHEMA)]
    cases += [] if gamma == "auto" else [(PROMPTS, SAMPLED), (PROMPTS, [SAMPLED, FILTERED] * 2 + [FILTERED])]
    for prompts, params in cases:
        assert tokens(compiled, prompts, params) == tokens(eager, prompts, params), (proposer, len(prompts), params)
        # every graph called again ran bound (its inputs gathered once), checked against what dynamo gathers
        graph = compiled.runner.graph
        bound = [b.inputs is not None for k, b in graph.compiled.graphs.items() if graph.calls[k] > 1]
        assert bound and all(bound), bound
        if gamma == "auto" and params is GREEDY and len(prompts) == 1:
            # the planner learns every eager step's time, and no time of a step that compiled a graph
            assert sum(eager.planner.hist.values()) == eager.scheduler.steps
            assert 0 < sum(compiled.planner.hist.values()) < compiled.scheduler.steps
    assert compiled.runner.graph.seen and not eager.runner.graph.seen
    # the greedy, the sampled and the filtered steps each made their graphs, and so did the steps with a grammar,
    # its mask (B, K, Vw) an input (their drafts were picked before, eager)
    kinds = {(dict(key[3])["all_greedy"], dict(key[3])["filtered"]) for key in compiled.runner.graph.seen}
    assert kinds == ({(True, False)} if gamma == "auto" else {(True, False), (False, False), (False, True)})
    masked = masked_graphs(compiled.runner.graph)
    assert masked and all(compiled.runner.graph.calls[k] > 0 for k in masked)


def test_bf16_compiled_plain_equals_bf16_eager(ckpt):
    """Inductor keeps a fused chain of bf16 ops in fp32 unless told to round after each op as eager does
    (emulate_precision_casts): without it three of these prompts part from eager within 20 tokens, all five within
    33. What is left is the order of attention's fp32 sums (cpu_rows' attend against eager's GEMM), which
    flips a bf16 rounding of its output now and then (here once in 200 tokens): the first 24 tokens agree."""
    kw = dict(proposer="none", num_drafts=0, max_batch=3, backend="torch", device="cpu", max_seq_len=96,
              dtype="bfloat16")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert tokens(LLM(ckpt, compile=True, **kw), PROMPTS, params) == tokens(LLM(ckpt, **kw), PROMPTS, params)


def test_dynamo_settings_of_the_process_are_left_as_they_were(ckpt):
    """The recompile limit and its fail switch hold only inside the calls that make a graph."""
    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    llm = LLM(ckpt, compile=True, proposer="mtp", num_drafts=3, max_batch=3, backend="torch", device="cpu",
              max_seq_len=96)
    seen = []
    llm.on_step = lambda report: seen.append((config.recompile_limit, config.fail_on_recompile_limit_hit))
    tokens(llm, PROMPTS[:2], GREEDY)
    assert set(seen) == {before} and (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x, *, double: bool):
        y = x * self.w
        return y * 2 if double else y


@torch.no_grad()
def test_a_made_graph_runs_by_its_key():
    """Compiled runs a made graph by the key it was made for, without dynamo's guards; with check_guards, a key
    that names a graph made for other inputs is an error."""
    m, x = Scale(), torch.randn(3, 4)
    compiled = Compiled(m.forward)
    for key, double in (("once", False), ("twice", True)):
        for _ in range(2):  # made, then run by its key
            assert torch.equal(compiled(key, x, double=double), m(x, double=double))
    assert set(compiled.graphs) == {"once", "twice"}
    compiled.check_guards = True
    assert torch.equal(compiled("twice", x, double=True), m(x, double=True))
    with pytest.raises(RuntimeError, match="names a graph made for other inputs"):
        compiled("once", x, double=True)
    with pytest.raises(RuntimeError, match="names a graph made for other inputs"):
        compiled("once", torch.randn(5, 4), double=False)


@torch.no_grad()
def test_a_bound_graph_takes_new_arguments_and_its_check_sees_a_moved_buffer():
    """From its second call a made graph runs bound (graph.Bound): a new tensor argument takes the recorded one's
    place. It reads the buffers it recorded, so a module attribute replaced by another tensor (a buffer that moved,
    which a step function never does) goes unseen by the bound graph; check_guards compares the bound inputs with
    those dynamo's code gathers, and raises."""
    m, x, y = Scale(), torch.randn(3, 4), torch.randn(3, 4)
    compiled = Compiled(m.forward)
    for _ in range(2):  # made, then bound
        assert torch.equal(compiled("k", x, double=False), m(x, double=False))
    assert compiled.graphs["k"].inputs is not None
    assert torch.equal(compiled("k", y, double=False), m(y, double=False))
    w = m.w
    m.w = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    assert torch.equal(compiled("k", y, double=False), y * w)  # the recorded w, not m's
    compiled.check_guards = True
    with pytest.raises(RuntimeError, match="not those dynamo's code gathers"):
        compiled("k", y, double=False)


class Writes:
    """A forward that keeps its output on the object: dynamo replays the write after its graph."""
    def forward(self, x):
        self.last = x * 2
        return self.last


class Keyed(torch.nn.Module):
    def forward(self, x):
        return {"y": x * 2}


@torch.no_grad()
def test_a_graph_the_recording_cannot_describe_keeps_dynamos_code():
    """graph.Bound calls a graph alone only where dynamo's code does nothing else: a forward whose code writes an
    attribute after its graph keeps dynamo's code, so every call writes it; one that returns a dict is tried once,
    then left to dynamo's code."""
    m, keyed = Writes(), Compiled(Keyed().forward)
    compiled = Compiled(m.forward)
    for _ in range(4):
        x = torch.randn(3)
        assert torch.equal(compiled("k", x), x * 2) and torch.equal(m.last, x * 2)
        assert torch.equal(keyed("k", x)["y"], x * 2)
    assert compiled.graphs["k"].graph is None
    assert keyed.graphs["k"].inputs is None and keyed.graphs["k"].probe is None


def test_buckets():
    assert [bucket(b, 1, 6) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [bucket(n, 128, 300) for n in (1, 128, 129, 257)] == [128, 128, 256, 300]


def test_a_growing_sequence_makes_no_new_graph(ckpt):
    """A compiled step's attention reads each sequence's own rows (cpu_rows' attend), so its graphs are made for the
    cache's length alone: MTP decoding from 250 rows past 256 and 512 makes one graph, and gives the eager
    engine's tokens."""
    kw = dict(proposer="mtp", num_drafts=3, max_batch=1, backend="torch", device="cpu", max_seq_len=640)
    eager, compiled = drafts_at_int8(LLM(ckpt, **kw)), LLM(ckpt, compile=True, **kw)
    prompt, params = [list(range(1, 60)) * 4 + [7] * 14], SamplingParams(max_new_tokens=300, ignore_eos=True)
    assert tokens(compiled, prompt, params) == tokens(eager, prompt, params)
    assert [key[2] for key in compiled.runner.graph.seen] == [compiled.runner.graph.kv_max]  # kv: the cache's rows


@torch.no_grad()
def test_a_compiled_prompt_fills_its_slot_as_the_eager_one(ckpt):
    """A compiled engine's prompts of more than ROWS_MAX rows run their Mamba layers as one graph (PromptGraph), shorter
    ones eager: either way the slot's Mamba states and K/V rows and the hidden rows equal an eager engine's (torch
    references, chunked SSD) at awkward lengths, the other slots keep every value (tolerance 0), and the graph made
    at 17 rows serves 23 and 41."""
    from helpers import assert_close, assert_unchanged

    from nano_spec.model.cpu_rows import ROWS_MAX

    kw = dict(proposer="none", num_drafts=0, max_batch=3, backend="torch", device="cpu", max_seq_len=64)
    eager, compiled = LLM(ckpt, **kw).runner, LLM(ckpt, compile=True, **kw).runner
    c, e = compiled.cache, eager.cache
    names = ("ssm_state", "conv_state", "k", "v")
    for name in names:
        getattr(c, name).normal_()  # the other slots' values, to be kept bit for bit
    before = {name: getattr(c, name).clone() for name in names}
    ids = torch.randint(1, compiled.cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(3))
    for T in (1, 2, 5, 17, 23, 41):
        e.reset_slot(0)
        c.reset_slot(1)
        ref = eager.model.prefill(ids[:T], 0, e)
        out = compiled.model.prefill(ids[:T], 1, c, run=compiled.prompt)
        assert_close(f"T={T} hidden", ref, out)
        for name in ("ssm_state", "conv_state"):
            assert_close(f"T={T} {name}", getattr(e, name)[:, 0], getattr(c, name)[:, 1])
        for name in ("k", "v"):
            assert_close(f"T={T} {name}", getattr(e, name)[:, 0, :T], getattr(c, name)[:, 1, :T])
            assert_unchanged(f"T={T} {name} rows past the prompt", before[name][:, 1, T:], getattr(c, name)[:, 1, T:])
        for name in names:
            assert_unchanged(f"T={T} {name} slots 0 and 2", before[name][:, ::2], getattr(c, name)[:, ::2])
        made = compiled.prompt.made[torch.get_num_threads()]
        assert made == (0 if T <= ROWS_MAX else 1), (T, made)  # the Mamba layers share one; attention runs eager


def test_compile_flag_checked(ckpt):
    with pytest.raises(ValueError, match="compile"):
        LLM(ckpt, compile="yes", backend="torch", device="cpu")
    with pytest.raises(ValueError, match="compile: on the CPU needs backend='torch' or 'auto', not 'triton'"):
        LLM(ckpt, compile=True, backend="triton", device="cpu")  # torch.compile does not wrap our launchers


def test_padded_batch_writes_like_row_0(ckpt):
    """A batch of 3 in a 4-slot engine runs padded to 4 rows: the padding repeats row 0, so the live states of
    the 3 slots equal the eager engine's and the free slot is untouched; a later batch of 1 runs in the same
    graphs. The eager engine's drafter reads the compiled one's int8 weights (its head state is compared)."""
    kw = dict(proposer="mtp", num_drafts=2, max_batch=4, backend="torch", device="cpu", max_seq_len=32)
    eager, compiled = drafts_at_int8(LLM(ckpt, **kw)), LLM(ckpt, compile=True, **kw)
    for llm in (eager, compiled):  # 5 steps of 3 sequences, none finished: the 3 slots hold them
        llm.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert {key[1] for key in compiled.runner.graph.seen} == {4}  # Bp: every step padded
    e, c = eager.runner.cache, compiled.runner.cache
    for name in ("ssm_state", "conv_state", "k", "v"):
        torch.testing.assert_close(getattr(c, name)[:, :3], getattr(e, name)[:, :3], msg=name)
        assert not getattr(c, name)[:, 3].any(), name  # the free slot: never written
    torch.testing.assert_close(compiled.drafter.head_mid[:3], eager.drafter.head_mid[:3])
    assert not compiled.drafter.k[3].any() and not compiled.drafter.head_mid[3].any()
    # one sequence after them: the graphs made for 4 rows serve it (padded), rather than a new graph for 1
    made, one = compiled.runner.compile_seconds(), SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert tokens(compiled, PROMPTS[3:4], one) == tokens(eager, PROMPTS[3:4], one)
    assert compiled.runner.compile_seconds() == made


def test_gemm_template_tokens_equal_eager(ckpt, monkeypatch):
    """Weights past graph.TEMPLATE_FROM run their matmuls in inductor's C++ GEMM template over frozen weights (the
    tiny model's are set past it here): MTP γ = 3 tokens at batch 1 (greedy) and 3 with slot reuse (seeded
    sampling) equal eager's; and a threshold above the weights leaves the template out. The first case's graph is
    compiled afresh: one loaded from inductor's cache binds the frozen weights anew and hid a wrong freeze once."""
    from nano_spec.engine import graph

    kw = dict(proposer="mtp", num_drafts=3, max_batch=3, backend="torch", device="cpu", max_seq_len=96)
    eager = LLM(ckpt, **kw)
    assert not LLM(ckpt, compile=True, **kw).runner.graph.template  # the tiny model's weights fit in a cache
    monkeypatch.setattr(graph, "TEMPLATE_FROM", 0)
    compiled = LLM(ckpt, compile=True, **kw)
    assert compiled.runner.graph.template
    compiled.runner.graph.compiled.check_guards = True
    for i, (prompts, params) in enumerate([(PROMPTS[:1], GREEDY), (PROMPTS, SAMPLED)]):  # each bucket a template
        with torch._inductor.config.patch(force_disable_caches=i == 0):
            assert tokens(compiled, prompts, params) == tokens(eager, prompts, params), (len(prompts), params)


@pytest.mark.parametrize("gemm", ["template", "auto"])
def test_compile_profile_script(ckpt, capsys, gemm):
    """scripts/compile_profile.py on the tiny model: the step's matmuls alone cost less than the whole eager verify
    that contains them, and the compiled call runs no matmul by a weight through ATen: inside the graph (inductor's
    C++ GEMM over the frozen weights), or, as the engine chooses for small weights, in C over packed copies."""
    import json

    load_script("compile_profile").main(["--model", str(ckpt), "--k", "2", "--rounds", "3", "--calls", "3", "--top", "40",
                                         "--gemm", gemm])
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < row["matmul floor ms"] < row["eager ms"] and row["compiled ms"] > 0 and row["K"] == 2
    assert 0 < row["stash floor ms"] < row["eager ms"]
    ops = [op["op"] for op in row["compiled_ops"]]
    assert ops and not any(op in ("aten::mm", "aten::addmm") for op in ops)
    assert row["gemm"] == {"template": "template", "auto": "rows"}[gemm]
    assert ("nano_spec::rows_linear" in ops) == (gemm == "auto")


def test_step_profile_compiled_rows(ckpt, capsys):
    """scripts/step_profile.py --compile profiles each row eager and compiled: eager times the step's parts, compiled
    the step whole, and the compiled step runs fewer ops (inductor's fused kernels counted one each) than the eager
    verify alone."""
    import json

    (ckpt / "eval_prompts.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    load_script("step_profile").main(["--model", str(ckpt), "--batch", "1", "--gammas", "0", "--max-new-tokens", "4", "--runs", "1",
                       "--compile"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {(r["mode"], r["phase"]): r for r in rows}
    assert {p for m, p in by if m == "eager"} >= {"prefill", "verify", "verdict"}
    assert {p for m, p in by if m == "compiled"} >= {"prefill", "step"}
    assert 0 < by["compiled", "step"]["ops_per_call"] < by["eager", "verify"]["ops_per_call"]
    assert by["eager", "matmul floor"]["ms_per_call"] > 0 and ("compiled", "matmul floor") not in by


def test_graph_check_script(ckpt, capsys):
    """scripts/graph_check.py on the CPU: the graph engine (torch.compile here; a CUDA graph on a GPU) gives the
    eager engine's tokens, and a row says so; the replay and kernel columns are CUDA's."""
    import json

    (ckpt / "eval_prompts.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    rc = load_script("graph_check").main(["--model", str(ckpt), "--configs", "none:0", "--prompts", "1",
                                          "--max-new-tokens", "4", "--rounds", "1", "--device", "cpu"])
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and row["identical"] and row["mode"] == "compiled" and row["graphs"] >= 1
    assert row["step ms"] > 0 and row["kernels ms"] is None


def allocations(src: str) -> list:
    """The sizes of the buffers a graph's generated code allocates, as tuples: inductor's Python wrapper calls
    empty_strided_cpu((sizes), ...); its C++ wrapper (cpp_wrapper) names a constant array of the sizes in
    aoti_torch_empty_strided(ndim, sizes, strides, ...). A size with a symbol (s17: a prompt's rows, PromptGraph,
    whose graphs are handed no cache) is left out."""
    dims = lambda text: tuple(int(d.strip().rstrip("L")) for d in text.split(",") if d.strip())  # noqa: E731
    arrays = {name: dims(v) for name, v in re.findall(r"int64_t (\w+)\[\] = \{([\dL, ]*)\}", src)}
    return [dims(d) for d in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", src)] + \
        [arrays[name] for name in re.findall(r"aoti_torch_empty_strided\(\d+, (\w+),", src) if name in arrays]


def test_compiled_step_writes_the_caches_where_they_lie(ckpt):
    """The conditions a CUDA graph needs, held on the CPU. Every compiled call is one graph (fullgraph: a graph
    break, which any host sync inside would be, is an error), and nothing copies a cache: no buffer that the
    generated code of a whole generate (MTP drafting, verify, accept rule, commit, catch-up) allocates comes near
    one layer's KV cache, and every cache buffer keeps its address."""
    import math

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2, max_seq_len=2048, backend="torch", device="cpu",
              compile=True)
    c, mtp = llm.runner.cache, llm.drafter
    buffers = [c.k, c.v, c.conv_state, c.ssm_state, c._ssm_stash, c._conv_stash, c._hidden_stash, mtp.k, mtp.v]
    addresses = [t.data_ptr() for t in buffers]
    with inductor_config.patch(force_disable_caches=True):  # compiled here, so the code is seen
        _, code = run_and_get_code(tokens, llm, PROMPTS[:2] + PROMPTS[4:], GREEDY)  # 33 rows: a prompt graph
    allocated = [math.prod(dims) for src in code for dims in allocations(src)]
    assert code and allocated, len(code)
    layer_kv = c.k[0].numel()  # (S, L, Hkv, Dh) elements
    assert max(allocated) < layer_kv / 8, (max(allocated), layer_kv)
    assert [t.data_ptr() for t in buffers] == addresses
    assert llm.stats["compile_seconds"] > 0


def test_the_steps_ops_copy_none_of_their_inputs(ckpt):
    """The compiled step hands the C++ ops (cpu_rows) their inputs laid out as they read them: inside a graph's call,
    a step's or a prompt's, no op of ours copies an input first (a copy is ~10 us of dispatch and allocation, ~2 per
    Mamba layer of a K-row verify when the graph handed B and C column-major)."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2, backend="torch", device="cpu", compile=True)
    prompts = PROMPTS[:3] + PROMPTS[4:]  # the last, 33 rows, runs the prompts' graphs
    tokens(llm, prompts, GREEDY)  # compiled first: the profile sees only calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens(llm, prompts, GREEDY)
    in_graphs, copies = 0, []
    for e in prof.events():
        chain, a = [], e.cpu_parent
        while a is not None:
            chain.append(a.name)
            a = a.cpu_parent
        if any(n.startswith("## Call CompiledFxGraph") for n in chain):
            ours = [n for n in chain if n.startswith("nano_spec::")]
            in_graphs += bool(ours)
            if ours and e.name in ("aten::clone", "aten::copy_", "aten::contiguous"):
                copies.append((e.name, ours[0]))
    assert in_graphs > 0 and not copies, (in_graphs, copies[:5])


# ops that wait for the device (a host sync) or upload host data: a CUDA graph capture holds neither
NOT_IN_A_GRAPH = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "lift_fresh", "lift_fresh_copy"}


class HostTouches(TorchDispatchMode):
    """Records the ops of NOT_IN_A_GRAPH that run under it, and the tensors every op makes."""

    def __init__(self):
        super().__init__()
        self.touches = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in NOT_IN_A_GRAPH:
            self.touches.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def buffers(llm) -> dict:
    """Every tensor the runner, its cache and its drafter hold, by name, with its address."""
    owners = {"runner": llm.runner, "cache": llm.runner.cache, "drafter": llm.drafter}
    return {f"{o}.{n}": (t, t.data_ptr()) for o, obj in owners.items() for n, t in vars(obj).items()
            if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("proposer, gamma, params, backend", [
    ("mtp", 3, GREEDY, "torch"), ("mtp", 3, SAMPLED, "torch"), ("mtp", 3, FILTERED, "torch"),
    ("dflash", 3, GREEDY, "torch"), ("ngram", 3, SAMPLED, "torch"), ("none", 0, GREEDY, "torch"),
    ("mtp", 3, SCHEMA, "torch"), ("mtp", 3, FILTERED, "triton")],
    ids=["mtp-greedy", "mtp-sampled", "mtp-filtered", "dflash", "ngram-sampled", "plain", "mtp-schema",
         "mtp-filtered-triton"])
def test_the_step_function_holds_the_capture_conditions(ckpt, dflash_ckpt, proposer, gamma, params, backend):
    """The device step, the function a CUDA graph captures, run eager on the CPU with the ops as a graph binds them
    (the sync-free commit on the torch backend; the Triton kernels, interpreted, as the GPU runs them): no op syncs
    with the host or uploads host data, and every buffer of the runner, its cache and its drafter is the same tensor
    at the same address after the steps as before (what a graph keeps)."""
    from nano_spec.model.graph_ops import use_graph_ops

    kw = dict(proposer=proposer, num_drafts=gamma, max_batch=3, backend=backend, device="cpu", max_seq_len=96)
    llm = LLM(dflash_ckpt if proposer == "dflash" else ckpt, **kw)
    use_graph_ops(llm.model.ops, compiled=False)
    mode, step, steps = HostTouches(), llm.runner.graph.fn, []

    def watched(*args, **kw):
        steps.append(kw["gamma"])
        with mode:
            return step(*args, **kw)

    llm.runner.graph.fn = watched
    before = buffers(llm)
    # interpreted, a Triton step takes seconds: two requests of a few steps each (batch 2, γ = 3, rejections)
    prompts, params = (PROMPTS[:2], replace(params, max_new_tokens=8)) if backend == "triton" else (PROMPTS[:3], params)
    want = tokens(LLM(dflash_ckpt if proposer == "dflash" else ckpt, **kw), prompts, params)
    assert tokens(llm, prompts, params) == want  # the sync-free commit is the same commit
    assert steps and max(steps) == gamma and mode.touches == []
    after = buffers(llm)
    assert after.keys() == before.keys() and all(after[n][0] is t and after[n][1] == p for n, (t, p) in before.items())


class FakeCUDAGraph:
    """torch.cuda.CUDAGraph's contract on the CPU: what runs inside the capture is recorded, not repeated by the
    first replay; each later replay runs the recorded call again on the same (static) input tensors and leaves
    its results in the same output tensors."""

    def __init__(self):
        self.call, self.out, self.fresh = None, None, False

    def replay(self):
        if self.fresh:  # the capture itself ran the step once (a real capture runs nothing; its replay does)
            self.fresh = False
            return
        for o, n in zip(self.out, self.call()):
            o.copy_(n)


@pytest.mark.parametrize("proposer, params", [("mtp", GREEDY), ("mtp", SAMPLED), ("mtp", FILTERED), ("ngram", SAMPLED),
                                              ("mtp", SCHEMA)],
                         ids=["mtp-greedy", "mtp-sampled", "mtp-filtered", "ngram-sampled", "mtp-schema"])
def test_cuda_graph_mode_replays_the_eager_tokens(ckpt, monkeypatch, proposer, params):
    """The cuda_graph mode's bookkeeping, run on the CPU with a stand-in graph: a bucket's first call runs eager,
    its second captures, later calls copy their inputs into the captured buffers and replay; the tokens are the
    eager engine's (batch 3 with slot reuse, a bucket per batch size and γ)."""
    from contextlib import contextmanager

    from nano_spec.engine.graph import StepGraph

    kw = dict(proposer=proposer, num_drafts=3, max_batch=3, backend="torch", device="cpu", max_seq_len=96)
    llm, capturing = LLM(ckpt, **kw), []
    r = llm.runner
    r.graph = StepGraph(r._device_step, "cuda_graph", r.model.ops, lambda name: r.tel.phase(name), 3,
                        r.cache.k.shape[2], per_bucket=8)
    step = r.graph.fn

    def fn(*args, **kw):
        out = step(*args, **kw)
        if capturing:  # inside `with torch.cuda.graph(g)`: g records the call and its outputs
            g = capturing[-1]
            g.call, g.out, g.fresh = (lambda: step(*args, **kw)), out, True
        return out

    @contextmanager
    def capture(g):
        capturing.append(g)
        yield
        capturing.pop()

    r.graph.fn = fn
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    assert tokens(llm, PROMPTS, params) == tokens(LLM(ckpt, **kw), PROMPTS, params)
    replayed = [k for k in r.graph.graphs if r.graph.calls[k] > 2]
    assert replayed and set(r.graph.seen) == set(r.graph.graphs) <= r.graph.warmed
    assert r.graph.seconds > 0


def test_each_graph_is_announced_before_it_compiles(ckpt):
    """watch_compile hears every graph once, before its first call, with the call's name, its count and the most
    its buckets allow; a warm engine compiles and says nothing."""
    from nano_spec.generate import decode_seconds

    llm = LLM(ckpt, compile=True, proposer="mtp", num_drafts=3, max_batch=3, backend="torch", device="cpu",
              max_seq_len=96)
    heard = []
    llm.watch_compile(lambda what, n, most, threads: heard.append((what, n, most, llm.runner.compile_seconds())))
    prompts = [PROMPTS[0], PROMPTS[4]]  # 5 and 33 rows: the second runs the prompt graphs
    tokens(llm, prompts, GREEDY)
    calls = {c.label: c for c in llm.runner.compiled_calls()}
    assert {what for what, *_ in heard} == set(calls) == {"step", "prompt"}
    step = calls["step"]
    ns = [(n, most) for w, n, most, _ in heard if w == "step"]
    assert ns == [(n, step.most) for n in range(1, len(step.seen) + 1)], ns
    ns = [(n, most) for w, n, most, _ in heard if w == "prompt"]
    assert ns == [(1, None)], ns  # one graph for the Mamba layers
    assert heard[0][3] == 0.0  # heard before the first graph's compile time was counted
    # each graph is made inside its own phase, so the demo's decoding time leaves out the step's alone
    st = llm.stats
    phases, made = st["phase_seconds"], st["compile_seconds_by_call"]
    assert made.keys() == {"step", "prompt"} and sum(made.values()) == st["compile_seconds"]
    assert 0 < made["prompt"] < phases["prefill"] and 0 < made["step"] < phases["step"]
    assert 0 < decode_seconds(st) < sum(phases.values()) - phases["prefill"]
    before = len(heard)
    tokens(llm, prompts, GREEDY)
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

