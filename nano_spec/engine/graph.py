"""How a step's device part, and a prompt's layers (PromptGraph), run (docs/DESIGN.md §12): nothing else knows.

    eager       the step function as Python calls it; the default, and the reference the other modes equal
    compiled    the function through torch.compile, one graph per bucket (the CPU's mode under LLM(compile=True))
    cuda_graph  the function captured as a torch.cuda.CUDAGraph per bucket around whatever the ops table holds
                (our Triton kernels) and the matmuls; replayed from static input buffers (CUDA's mode)

A bucket is (Bp, the step's static arguments, kv): the batch padded up to a power of two (at most the slot count),
γ and the other static arguments as the step asks, and the KV rows attention reads, the longest sequence after the
step rounded up to a power of two (at least KV_MIN, at most the cache's length). A compiled step's attention reads
the rows each sequence has whatever the graph's KV length (cpu_rows' attend), so there kv is the cache's length,
one bucket. Padding rows repeat row 0 (same slot, same inputs), so they compute and write exactly what row 0 does
and no other slot is touched.
A call whose bucket has no graph yet runs in a graph made for more rows or more KV rows, when one exists (the
smallest such): padding a few steps costs less than making a graph, which on the CPU takes seconds.

The step function, fn(*batched, kv=, **static) -> a tuple of tensors with the batch in dim 0, reads and writes
only buffers allocated once (static addresses), has no host sync, and takes its host-made inputs (random draws,
host drafts, grammar masks) as arguments: the conditions a CUDA graph needs, which the tests hold on the CPU.
"""
import dis
import inspect
import time
import types
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from nano_spec.model.cpu_rows import DRAFT_DTYPE, ROWS_MAX, pack_linears
from nano_spec.model.graph_ops import use_graph_ops

KV_MIN = 256  # the smallest KV bucket: each bucket is one more graph to make, and a short one saves little
RECOMPILE_LIMIT = 4096  # graphs of one function over all engines of a process
MODES = ("eager", "compiled", "cuda_graph")
TEMPLATE_FROM = 64 << 20  # weight bytes from which a compiled graph's matmuls use the C++ GEMM template


def mode_of(compile: bool, device) -> str:
    return "eager" if not compile else "cuda_graph" if torch.device(device).type == "cuda" else "compiled"


def bucket(n: int, least: int, most: int) -> int:
    """n rounded up to a power of two, within [least, most]."""
    return min(max(1 << (n - 1).bit_length(), least), most)


def buckets(least: int, most: int) -> set:
    return {bucket(n, least, most) for n in range(1, most + 1)}


def gemm_template(weight_bytes: int) -> bool:
    """Whether a compiled graph's matmuls by a weight run in inductor's C++ GEMM template, chosen once per engine
    by the weights' size. The template packs each weight at compile time and reads it once for any row count,
    where ATen's GEMM copies the blocks it reads on every call: at the 350m shape 4 rows cost ~1.2x one row
    against 2.3x (docs/BENCHMARKS.md, "K rows"). It pays at every size (the shipped weights' compiled verify:
    1.87 against 3.23 ms at K = 1), but a graph takes about twice as long to make; below TEMPLATE_FROM, where
    compile time outweighs the steps of a short run, ATen's GEMM stays."""
    return weight_bytes >= TEMPLATE_FROM


class Compiled:
    """fn, a bound method, through torch.compile with nano_spec's settings: `compiled(key, *args, **kwargs)` runs key's
    graph, made (compiled, or loaded from inductor's cache) on key's first call. Later calls skip dynamo's entry
    (frame evaluation, the search of fn's graphs, their guards: ~0.4 ms of a plain step of the shipped weights)
    and, once the graph is bound (Bound), dynamo's code for it too. So the key must name all the graph was made for
    (StepGraph's bucket); `check_guards` (the tests) runs the guards and raises where they fail, and checks what a
    bound graph's call would hand the graph and return against dynamo's code.
      - fn runs over its own code object (own_code), where dynamo keeps its graphs: an engine's graphs are its own.
      - The weights are fixed for an engine's life, so the guards skip the modules' attributes (checking every
        parameter cost ~0.3 ms a call), and the graph's code does not assert its inputs' sizes and strides
        (`size_asserts`: 126 checks in a compiled verify of the shipped weights cost ~0.13 ms of its 1.2).
      - The graph's calls (its fused kernels, the ops of model/graph_ops.py, its buffers) are made from C++
        (`cpp_wrapper`), not from a generated Python function: the shipped weights' compiled steps run 1.13x as
        fast, and their graphs are made faster too (DESIGN §12).
      - Inductor keeps a fused chain of bf16 ops in fp32 unless told to round after each op as eager does; without
        that, bf16 compiled logits drift from eager's and greedy tokens part within a few dozen (fp32 is unaffected).
      - template: the weights are frozen into the graph (`freezing`: read under no_grad, they become constants)
        and every matmul by a weight is inductor's C++ GEMM template (`max_autotune` with the CPP backend alone, so
        nothing is benchmarked; gemm_template says why). A graph holds its own packed copy of the weights.
      - Dynamo's settings are the making calls', not the process's: every bucket is one more graph of fn's code
        object, and a hit limit is an error rather than a silent fall back to eager."""

    def __init__(self, fn, template: bool = False):
        self.fn, self.template, self.check_guards = own_code(fn), template, False
        self.traced = torch.compile(self.fn, fullgraph=True, dynamic=False, options=OPTIONS)
        self.graphs = {}  # key -> (dynamo's code for the graph as a method of fn's instance, the graph's guards)

    def __call__(self, key, *args, **kwargs):
        made = self.graphs.get(key)
        if made is None:
            with making(), frozen_gemm() if self.template else nullcontext():
                out = self.traced(*args, **kwargs)
            self.graphs[key] = self._made(args, kwargs)
            return out
        if self.check_guards and not made.guards.check(f_locals := call_locals(self.fn, args, kwargs)):
            raise RuntimeError(f"compiled: key {key} names a graph made for other inputs: "
                               f"{made.guards.check_verbose(f_locals).verbose_code_parts}")
        return made(args, kwargs, check=self.check_guards)

    def _made(self, args, kwargs) -> "Bound":
        """The graph dynamo runs for these arguments (the one whose guards pass), bound on its next call."""
        f = self.fn.__func__
        entry = graph_for(self.fn, args, kwargs)
        if entry is None:  # the call changed what its own graph's guards read
            raise RuntimeError(f"compiled: no graph of {f.__name__} takes the arguments it was just made for")
        return Bound(f, entry.code, self.fn.__self__, entry.guard_manager)


# torch.compile's options for nano_spec's graphs (Compiled says why each)
OPTIONS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "emulate_precision_casts": True,
           "size_asserts": False, "cpp_wrapper": True}


def making():
    """Dynamo's settings around a call that may make a graph (Compiled's last point)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)


def call_locals(method, args, kwargs) -> dict:
    """A bound method's call as its frame's locals (what dynamo's guards read)."""
    bound = inspect.signature(method.__func__).bind(method.__self__, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def graph_for(method, args, kwargs):
    """The cache entry of dynamo's graph of the method's code that takes these arguments (its guards pass), or None."""
    f_locals = call_locals(method, args, kwargs)
    return next((e for e in _debug_get_cache_entry_list(method.__func__.__code__) if e.guard_manager.check(f_locals)),
                None)


# What dynamo's code may do after calling its graph for Bound to call the graph alone: pick and pack its outputs
# (Python 3.11 to 3.13's opcodes for it). A side effect replayed (an attribute written, a method called) is not here.
AFTER_THE_GRAPH = {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_AND_CLEAR", "STORE_FAST",
                   "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST", "DELETE_FAST", "LOAD_CONST", "BINARY_SUBSCR",
                   "BUILD_TUPLE", "BUILD_LIST", "LIST_EXTEND", "SWAP", "COPY", "POP_TOP", "NOP", "CACHE",
                   "RETURN_VALUE", "RETURN_CONST"}


class Bound:
    """A made graph, called with its inputs gathered once. Dynamo's code for a graph reads the graph's inputs out of
    the call's arguments and the instance's attributes on every call (the shipped weights' plain step: 100 tensors,
    ~45 us, 3 % of the step). A step function reads and writes only buffers allocated once (the condition a CUDA
    graph needs, which the tests hold), so between calls only its tensor arguments change. The first call runs
    dynamo's code and records what it hands the graph and what the graph returns; later calls hand the graph the
    recorded inputs with the call's tensor arguments in their places, and return the outputs dynamo's code did.
    A call whose other arguments are not the recorded ones (the same object, or an equal int, float, bool or str)
    runs dynamo's code, as does every call of a graph the recording cannot describe: dynamo's code calls more than
    one graph, does more after it than pick its outputs (a side effect replayed), returns what the graph did not,
    or hands it something other than tensors."""

    def __init__(self, f, code, instance, guards):
        self.run, self.guards = types.MethodType(with_code(f, code), instance), guards
        names = [n for n in code.co_names if n.startswith("__compiled_fn")]  # the globals dynamo keeps its graphs in
        ops = list(dis.get_instructions(code))  # dynamo's code keeps its graph's outputs in graph_out_0
        out = next((k for k, i in enumerate(ops) if i.opname == "STORE_FAST" and i.argval == "graph_out_0"), None)
        pure = out is not None and all(i.opname in AFTER_THE_GRAPH for i in ops[out + 1:])  # no side effect after it
        self.graph = f.__globals__.get(names[0]) if len(names) == 1 and pure else None
        self.probe = None if self.graph is None else \
            types.MethodType(with_code(f, code, {**f.__globals__, names[0]: self._record}), instance)
        # set by _bind: the recorded inputs, the places of the call's tensors among them, the other arguments, the
        # returned outputs' places among the graph's (and whether they came as a tuple), the arguments' shape
        self.inputs = self.places = self.others = self.picks = self.tuple = self.width = self.keys = None
        self.calls, self.outs = [], None

    def __call__(self, args, kwargs, check: bool = False):
        flat = (*args, *kwargs.values())
        if self.inputs is None or check:
            return self._bind(args, kwargs, flat)
        if tuple(kwargs) != self.keys or len(flat) != self.width:
            return self.run(*args, **kwargs)
        for j, b in self.others:
            a = flat[j]
            if a is not b and not (type(a) is type(b) and type(b) in (int, float, bool, str) and a == b):
                return self.run(*args, **kwargs)
        inputs = list(self.inputs)
        for i, j in self.places:
            if not isinstance(x := flat[j], torch.Tensor):
                return self.run(*args, **kwargs)
            inputs[i] = x
        return self._picked(self.graph(*inputs))

    def _picked(self, outs):
        """The graph's outputs as dynamo's code returned them: a tuple of some, or one."""
        picked = tuple(outs[k] for k in self.picks)
        return picked if self.tuple else picked[0]

    def _record(self, *inputs):
        self.calls.append(inputs)
        self.outs = self.graph(*inputs)
        return self.outs

    def _bind(self, args, kwargs, flat):
        """Dynamo's code, recorded: bound from the first time; then (check) what the bound call would hand the graph
        and return, checked against it."""
        if self.probe is None:
            return self.run(*args, **kwargs)
        self.calls = []
        result = self.probe(*args, **kwargs)
        inputs = self.calls[0] if len(self.calls) == 1 else None
        if inputs is not None and self.inputs is not None:  # check: what the bound call would hand and return
            places = dict(self.places)
            handed = [flat[places[i]] if i in places else x for i, x in enumerate(self.inputs)]
            if len(handed) != len(inputs) or any(x is not y for x, y in zip(handed, inputs)):
                raise RuntimeError("compiled: a bound graph's inputs are not those dynamo's code gathers")
            returned = result if self.tuple else (result,)
            if len(returned) != len(self.picks) or any(self.outs[k] is not r for k, r in zip(self.picks, returned)):
                raise RuntimeError("compiled: a bound graph's outputs are not those dynamo's code returns")
        elif inputs is not None and isinstance(result, (tuple, torch.Tensor)) and \
                all(isinstance(x, torch.Tensor) for x in inputs):
            picks = [next((k for k, o in enumerate(self.outs) if o is r), None)
                     for r in (result if isinstance(result, tuple) else (result,))]
            where = {id(a): j for j, a in enumerate(flat) if isinstance(a, torch.Tensor)}
            if None not in picks:  # the outputs dynamo's code returned, by their places among the graph's
                self.inputs, self.picks, self.tuple = tuple(inputs), picks, isinstance(result, tuple)
                self.places = [(i, where[id(x)]) for i, x in enumerate(inputs) if id(x) in where]
                self.others = [(j, a) for j, a in enumerate(flat) if not isinstance(a, torch.Tensor)]
                self.width, self.keys = len(flat), tuple(kwargs)
        if self.inputs is None:  # the recording could not describe the graph: dynamo's code from now on
            self.probe = None
        self.calls, self.outs = [], None
        return result


def own_code(method):
    """A bound method over a copy of its function's code object. Dynamo keeps its graphs on the code object and,
    with the modules' guards skipped (Compiled), would run a graph traced for one engine in another whose weights
    differ in layout (packed, frozen in the GEMM template, or neither): each compiled function's graphs are its own."""
    return types.MethodType(with_code(method.__func__, method.__func__.__code__.replace()), method.__self__)


def with_code(f, code, globals_: dict | None = None):
    """f's function (globals, closure, defaults) over another code object, and other globals if given."""
    g = types.FunctionType(code, f.__globals__ if globals_ is None else globals_, f.__name__, f.__defaults__,
                           f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


@contextmanager
def frozen_gemm():
    """The GEMM template's settings around a call. inductor's: read by dynamo while it traces (a frozen weight is
    not lifted to an input), so not a torch.compile option. oneDNN off while a graph may be made: with it on,
    freezing also packs each weight for MKL or oneDNN, a copy the template never reads and inductor's on-disk
    cache cannot store (every run would compile again); a graph's own code calls neither library."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        with torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP"):
            yield
    finally:
        torch.backends.mkldnn.enabled = before


def no_phase(name: str):
    """The step's parts inside a graph: not timed one by one."""
    return nullcontext()


def pad(t, Bp: int):
    """t (B, ...) padded to Bp rows by repeating row 0, contiguous (a graph is made for its inputs' strides); None
    stays None."""
    if t is None:
        return None
    return (t if t.shape[0] == Bp else torch.cat([t, t[:1].expand(Bp - t.shape[0], *t.shape[1:])])).contiguous()


class StepGraph:
    """fn run in one mode: step(*batched, kv_len=, **static) -> (fn's outputs cut to B rows, Bp).

    batched: tensors (or None) with the batch in dim 0, padded to Bp; kv_len: the longest sequence after the step,
    from host values, rounded up to its bucket. What fn writes into buffers is written at Bp rows.

    seconds: the time of the calls that made a graph (compiled it, or captured it); `listener(label, n, most,
    threads)`, if set, hears of each graph before it is made: its count at this thread count, the most the buckets
    allow, and the thread count (inductor's CPU code is made for one: another count compiles the graph again)."""

    label = "step"

    def __init__(self, fn, mode: str, ops, phase, num_slots: int, kv_max: int, per_bucket: int,
                 template: bool = False, nets=(), drafts=()):
        """ops: the Ops fn runs, switched here to the forms a graph of this mode needs (model/graph_ops.py);
        phase(name): a context that times a part of the step; fn gets it when eager, and a graph's call is
        timed whole as "step";
        per_bucket: the graphs one (batch, KV) bucket may take (its static arguments' combinations);
        template: compiled, the weights' matmuls in inductor's C++ GEMM template (gemm_template);
        nets, drafts: the networks fn runs, the target's and the drafter's; compiled without the template, their
        products of few rows run in C over packed copies of their weights (cpu_rows.pack_linears), held beside the
        weights: fp32 for the target, int8 for the drafter (a draft only proposes: a quarter of the bytes to read,
        and the verify's fp32 decides)."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        if mode != "eager":
            use_graph_ops(ops, compiled=mode == "compiled")
        self.fn, self.mode, self.phase, self.num_slots, self.kv_max = fn, mode, phase, num_slots, kv_max
        self.template = template and mode == "compiled"
        self.kv_least = kv_max if mode == "compiled" else min(KV_MIN, kv_max)  # the smallest KV bucket
        self.most = len(buckets(1, num_slots)) * len(buckets(self.kv_least, kv_max)) * per_bucket
        self.seconds, self.seen, self.listener = 0.0, set(), None
        self.calls = Counter()  # bucket key -> calls
        self.route = {}  # bucket key without a graph -> the key of the graph that serves it
        self.graphs, self.warmed = {}, set()  # cuda_graph: key -> (CUDAGraph, static inputs, outputs); keys run once
        if mode == "compiled":
            self.compiled = Compiled(fn, self.template)
            for net in () if self.template else nets:
                pack_linears(net, skip=drafts)
            for net in () if self.template else drafts:
                pack_linears(net, DRAFT_DTYPE)

    def __call__(self, *batched, kv_len: int, **static):
        B = batched[0].shape[0]
        if self.mode == "eager":
            return self.fn(*batched, kv=min(kv_len, self.kv_max), phase=self.phase, **static), B
        Bp, kv = bucket(B, 1, self.num_slots), bucket(kv_len, self.kv_least, self.kv_max)
        key = (torch.get_num_threads(), Bp, kv, tuple(sorted(static.items())),
               tuple(None if t is None else (tuple(t.shape[1:]), t.dtype) for t in batched))
        if key not in self.seen:  # a graph made for more rows or more KV rows serves: padding costs less than a graph
            if key not in self.route:  # looked up once per key while no graph is made
                cover = [k for k in self.seen if k[0] == key[0] and k[3:] == key[3:] and k[1] >= Bp and k[2] >= kv]
                self.route[key] = min(cover, key=lambda k: (k[1], k[2]), default=key)
            key = self.route[key]
            Bp, kv = key[1], key[2]
        batched = [pad(t, Bp) for t in batched]
        self.calls[key] += 1
        new = key not in self.seen
        if new and key not in self.warmed and self.listener is not None:
            self.listener(self.label, 1 + sum(k[0] == key[0] for k in self.seen), self.most, key[0])
        t0 = time.perf_counter()
        with self.phase("step"):
            if self.mode == "compiled":
                out = self.compiled(key, *batched, kv=kv, phase=no_phase, **static)  # a new key compiles (or loads)
            elif key not in self.warmed:
                # cuda_graph: a bucket's first call runs eager, so that every kernel it launches is compiled (and
                # cuBLAS has its workspace) before the capture; a warm-up inside the capture would run the step twice
                self.warmed.add(key)
                out = self.fn(*batched, kv=kv, phase=no_phase, **static)
            else:
                out = self._replay(key, batched, kv, static)
        if new:  # a graph in the making: its calls are not the step's cost
            if self.mode == "compiled" or key in self.graphs:
                self.seen.add(key)
                self.route.clear()  # a new graph may serve keys routed elsewhere
            self.seconds += time.perf_counter() - t0
        return (out if Bp == B else tuple(o[:B] for o in out)), Bp

    def _replay(self, key, batched, kv, static):
        """cuda_graph: the bucket's graph, captured on its second call, replayed from its static inputs. Its
        outputs live in the graph's memory until its next replay: the caller reads them within the step."""
        if key not in self.graphs:
            inputs = [None if t is None else t.clone() for t in batched]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records the launches; nothing runs until the replay
                out = self.fn(*inputs, kv=kv, phase=no_phase, **static)
            self.graphs[key] = (graph, inputs, out)
        graph, inputs, out = self.graphs[key]
        for buf, t in zip(inputs, batched):
            if t is not None:
                buf.copy_(t)
        graph.replay()
        return out


class PromptGraph:
    """fn(layer, *rows), one layer of a prompt (HybridLM.prompt_layer, a pure function), in the engine's mode: eager
    and cuda_graph call it as it is (a CUDA graph cannot take a varying row count); compiled, the Mamba layers run it
    through torch.compile with the row count dynamic, one graph for all (the modules' guards are skipped: it reads
    the weights of the layer handed in), where inductor fuses the gates, norms and SiLUs. The attention layers stay
    eager: a graph of theirs saved ~2 % more of the prefill for a second or more of compiling (docs/BENCHMARKS.md,
    "A compiled engine's prompts as graphs"). So do prompts of at most ROWS_MAX rows: little to fuse, and dynamo
    would make one row, and the rows a packed weight serves, graphs apart. seconds, listener: StepGraph's."""

    label = "prompt"

    def __init__(self, fn, mode: str):
        self.fn, self.mode, self.seconds, self.listener = fn, mode, 0.0, None
        self.traced = {}  # threads -> (fn over its own code, it through torch.compile)
        self.made = Counter()  # threads -> graphs made

    def __call__(self, layer, y, *args):
        if self.mode != "compiled" or layer.kind != "mamba" or y.shape[0] <= ROWS_MAX:
            return self.fn(layer, y, *args)
        threads, args = torch.get_num_threads(), (y, *args)
        if threads not in self.traced:
            fn = own_code(self.fn)
            self.traced[threads] = fn, torch.compile(fn, fullgraph=True, dynamic=True, options=OPTIONS)
        fn, traced = self.traced[threads]
        if graph_for(fn, (layer, *args), {}) is not None:
            return traced(layer, *args)
        self.made[threads] += 1
        if self.listener is not None:
            self.listener(self.label, self.made[threads], None, threads)
        t0 = time.perf_counter()
        with making():
            out = traced(layer, *args)
        self.seconds += time.perf_counter() - t0
        return out
