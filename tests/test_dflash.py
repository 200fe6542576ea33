"""The DFlash block drafter (nano_spec/model/dflash.py): equal to the reference implementation on the same weights,
stored in its format, and lossless in the engine (greedy == plain decoding, seeded sampling follows the target)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_close, masked_graphs, tiny_config
from nano_spec.model.dflash import DFlashConfig, DFlashModel, default_taps, load_drafter
from nano_spec.model.ops import Ops
from nano_spec.model.weights import init_weights, save_model


def tiny_drafter(cfg=None, layers: int = 2, block: int = 4, seed: int = 0, **kw) -> DFlashModel:
    cfg = cfg or tiny_config()
    d = DFlashModel(DFlashConfig.for_target(cfg, num_layers=layers, block_size=block, **kw), Ops("torch"))
    init_weights(d, std=0.2, seed=seed)
    with torch.no_grad():  # non-trivial norm weights, so a norm applied in the wrong place shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return d.eval()


def reference_drafter(ours: DFlashModel):
    """The reference's DFlashDraftModel built from our config.json, holding our weights (strict)."""
    transformers = pytest.importorskip("transformers")
    model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0 (README, Tests)")
    ref = model.DFlashDraftModel(transformers.Qwen3Config(**ours.cfg.to_dict()))
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref.eval()


@pytest.mark.parametrize("layers,block,ctx", [(1, 4, 5), (2, 4, 1), (3, 7, 13)],
                         ids=lambda v: str(v))
def test_drafter_equals_reference(layers, block, ctx):
    """The same weights and inputs through both: hidden states within 1e-5."""
    ours = tiny_drafter(layers=layers, block=block, seed=layers)
    ref = reference_drafter(ours)
    D, nT = ours.cfg.hidden_size, len(ours.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, block, D, generator=g)               # the embedded block (B, Bk, D)
    taps = torch.randn(2, ctx, nT * D, generator=g)         # the context (B, Tc, nT*D)
    positions = torch.arange(ctx + block)[None].expand(2, -1) + torch.tensor([[0], [3]])  # (B, Tc + Bk)
    with torch.no_grad():
        want = ref(position_ids=positions, noise_embedding=x, target_hidden=taps)
        got = ours(x, taps, positions)
    err = assert_close(f"dflash L{layers} Bk{block} Tc{ctx}", want, got, atol=1e-5)
    print(f"dflash vs DFlashDraftModel: max abs err {err:.2e}")


def test_engine_forward_equals_no_cache_forward():
    """draft_hidden (context K/V from a cache, block through ops.attention_block) == forward on the same rows."""
    ours = tiny_drafter(layers=2, block=5)
    cfg, S, L = ours.cfg, 3, 20
    D, nT = cfg.hidden_size, len(cfg.target_layer_ids)
    ctx_lens, slots = torch.tensor([6, 0, 11]), torch.tensor([2, 0, 1])
    taps = torch.randn(3, 11, nT * D)
    x = torch.randn(3, cfg.block_size, D)
    k = torch.zeros(cfg.num_hidden_layers, S, L, cfg.num_key_value_heads, cfg.head_dim)
    v = torch.zeros_like(k)
    with torch.no_grad():
        c = ours.context(taps)
        for i in range(cfg.num_hidden_layers):
            ki, vi = ours.context_kv(i, c, torch.arange(11)[None].expand(3, -1))
            k[i, slots], v[i, slots] = torch.zeros_like(k[i, slots]), torch.zeros_like(v[i, slots])
            k[i, slots, :11], v[i, slots, :11] = ki, vi
        got = ours.draft_hidden(x, slots, ctx_lens, k, v)
        for b in range(3):
            T = int(ctx_lens[b])
            want = ours(x[b : b + 1], taps[b : b + 1, :T], torch.arange(T + cfg.block_size)[None])
            assert_close(f"row {b} (context {T})", want[0], got[b], atol=1e-5)


def test_config_is_the_reference_format(tmp_path):
    """config.json holds the Qwen3 fields and dflash_config; it reloads, and a drafter that does not fit the
    target is refused naming the field."""
    cfg = tiny_config()
    d = tiny_drafter(cfg, layers=2, block=6)
    save_model(d, tmp_path / "dflash")
    stored = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert stored["architectures"] == ["DFlashDraftModel"] and stored["model_type"] == "qwen3"
    assert stored["dflash_config"]["block_size"] == 6
    assert stored["dflash_config"]["target_layer_ids"] == default_taps(cfg.num_hidden_layers, 2)
    assert stored["dflash_config"]["mask_token_id"] == cfg.eos_token_id
    dcfg = DFlashConfig.from_file(tmp_path / "dflash" / "config.json")
    dcfg.check(cfg)
    back = load_drafter(tmp_path / "dflash", dcfg, Ops("torch"), "cpu", torch.float32)
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    other = tiny_config(hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size: 48 != the target's 32"):
        dcfg.check(other)
    with pytest.raises(ValueError, match="target_layer_ids"):
        dcfg.check(tiny_config(layer_types=["mamba"]))
    with pytest.raises(ValueError, match="drafter: cannot read"):  # no config.json (the engine: "no DFlash drafter")
        DFlashConfig.from_file(tmp_path / "config.json")


def test_target_taps_are_the_layer_outputs(tmp_path):
    """The rows prefill and verify tap are the residual stream after those layers, as transformers reports it
    (hidden_states[i + 1] of GraniteMoeHybridForCausalLM on the same weights)."""
    from test_transformers_parity import hf_model

    from nano_spec.model.cache import HybridCache
    from nano_spec.model.model import load_model

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    ours, taps = load_model(tmp_path), [0, 3, 2]
    ids = torch.randint(0, 61, (1, 13))
    with torch.no_grad():
        want = torch.cat([hf(ids, output_hidden_states=True).hidden_states[i + 1] for i in taps], -1)[0]  # (T, nT*D)
        cache = HybridCache(ours.cfg, 2, 32, 4, taps=taps)
        got = torch.empty(9, len(taps) * ours.cfg.hidden_size)
        ours.prefill(ids[0, :9], 1, cache, got)
        assert_close("prefill taps", want[:9], got, atol=1e-4)
        ours.verify(ids[:, 9:], torch.tensor([1]), torch.tensor([9]), cache)
        assert_close("verify taps", want[9:], cache.tap_stash(1, 4)[0], atol=1e-4)
        nocache = torch.empty(1, 13, len(taps) * ours.cfg.hidden_size)
        ours.hidden(ids, taps, nocache)
        assert_close("no-cache taps", want, nocache[0], atol=1e-4)


# ---- in the engine ----------------------------------------------------------------------------------
PROMPTS = ["def f(x):", "for i in range(10):\n    print(i)\n", "h", "héllo wörld ✓ héllo", "x = 1\ny = 2\n" * 3]
BLOCK = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from helpers import tiny_checkpoint

    from nano_spec.model.config import ModelConfig

    path = tiny_checkpoint(tmp_path_factory.mktemp("dflash") / "tiny", seed=5)
    save_model(tiny_drafter(ModelConfig.from_file(path / "config.json"), layers=2, block=BLOCK, seed=3),
               path / "dflash")
    return path


def generate(ckpt, proposer="none", gamma=0, max_batch=2, params=None, prompts=PROMPTS, **kw):
    from nano_spec import LLM, SamplingParams

    llm = LLM(ckpt, proposer=proposer, num_drafts=gamma, max_batch=max_batch, **kw)
    outs = llm.generate(prompts, params or SamplingParams(max_new_tokens=24, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(ckpt):
    return generate(ckpt)[1]


@pytest.mark.parametrize("gamma", [1, 2, 3, BLOCK - 1, "auto"], ids=lambda g: f"budget-{g}")
def test_lossless_greedy_every_budget(ckpt, plain, gamma):
    """Five prompts through two slots (mixed batches, slot reuse): the tokens of plain decoding."""
    llm, out = generate(ckpt, "dflash", gamma)
    assert out == plain
    assert llm.stats["verify_steps"] > 0 and llm.drafter.max_drafts == (BLOCK - 1 if gamma == "auto" else gamma)


def test_lossless_triton_backend(ckpt):
    """The drafter's block attention through the Triton kernel (the interpreter on a CPU). Two prompts through one
    slot (reuse), short: every kernel of the target's verify and prefill runs in the interpreter too."""
    from nano_spec import SamplingParams

    short = dict(params=SamplingParams(max_new_tokens=6, ignore_eos=True), prompts=[PROMPTS[0], PROMPTS[3]],
                 max_batch=1)
    _, out = generate(ckpt, "dflash", 3, backend="triton", **short)
    assert out == generate(ckpt, backend="torch", **short)[1]


def test_lossless_compiled(ckpt):
    """compile=True: the block forward, the verify (its tap rows) and the catch-up (the context K/V writes) run in
    the step's one graph (docs/DESIGN.md §12). Compile takes the torch backend, so plain decoding is on the CPU's
    torch backend too (CUDA picks triton). Under a grammar the block is drafted first, eager, and the rest of the
    step runs in a graph of its own, the verify's mask an input."""
    from nano_spec import SamplingParams

    cpu = dict(backend="torch", device="cpu")
    llm, out = generate(ckpt, "dflash", 3, compile=True, **cpu)
    assert out == generate(ckpt, **cpu)[1]
    assert llm.runner.graph.seen and llm.runner.graph.seconds > 0
    regex = SamplingParams(max_new_tokens=12, regex=r"[a-z ]{3,30}\.", ignore_eos=True)
    out = [o.token_ids for o in llm.generate(PROMPTS, regex)]
    assert out == generate(ckpt, params=regex, **cpu)[1]
    assert masked_graphs(llm.runner.graph)


def test_lossless_under_a_grammar(ckpt):
    """A regex: every draft is picked under the grammar state after the drafts before it; the output equals
    plain decoding's under the same regex."""
    from nano_spec import SamplingParams

    params = SamplingParams(max_new_tokens=20, regex=r"[a-z ]{3,30}\.", ignore_eos=True)
    _, want = generate(ckpt, params=params)
    llm, got = generate(ckpt, "dflash", 3, params=params)
    assert got == want and llm.stats["constrained"]["verify_steps"] > 0


@torch.no_grad()
def test_drafts_equal_nocache_recomputation(ckpt):
    """After any step, the proposer's drafts (context K/V stored row by row as rows commit) equal the no-cache
    drafter over the whole sequence: taps of every token but the last, block [last token, MASK...]."""
    from nano_spec import LLM, SamplingParams

    llm = LLM(ckpt, proposer="dflash", num_drafts=3, max_batch=2)
    model, drafter = llm.model, llm.drafter.net
    cfg, taps, dev = drafter.cfg, drafter.cfg.target_layer_ids, llm.runner.device
    seqs = [llm.scheduler.add(llm.tokenizer.encode(p), SamplingParams(max_new_tokens=40, ignore_eos=True))
            for p in PROMPTS[:2]]
    for _ in range(6):
        llm.scheduler.step()
        for s in seqs:
            if s.finished:
                continue
            x = torch.tensor(s.tokens, device=dev)
            n = len(x)
            ctx = torch.empty(1, n - 1, len(taps) * cfg.hidden_size, device=dev)
            model.hidden(x[None, : n - 1], taps, ctx)
            block = torch.tensor([[s.tokens[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1)], device=dev)
            h = drafter(model.model.embed_tokens(block) * cfg.input_embedding_scale, ctx,
                        torch.arange(n - 1 + cfg.block_size, device=dev)[None])
            want = model.logits(h[0, 1:4]).argmax(-1).tolist()
            assert llm.drafter.draft([s], 3, None).tokens[0].tolist() == want


def test_settings_that_cannot_work_are_refused(ckpt, tmp_path):
    from nano_spec import LLM

    with pytest.raises(ValueError, match="at most 4"):
        LLM(ckpt, proposer="dflash", num_drafts=5)
    with pytest.raises(ValueError, match="no DFlash drafter at"):
        LLM(ckpt, proposer="dflash", drafter=tmp_path)
    with pytest.raises(ValueError, match="only with proposer='dflash'"):
        LLM(ckpt, proposer="mtp", drafter=ckpt / "dflash")


# ---- the drafter's config.json, every field checked at load ------------------------------------------------
DELETE = object()  # an edit that removes the key
BAD_DRAFTER_CONFIGS = {  # id: (keys into config.json, the value put there, the field the message names)
    "layers-10M": (("num_hidden_layers",), 10_000_000, "num_hidden_layers"),
    "intermediate-negative": (("intermediate_size",), -5, "intermediate_size"),
    "rope-theta-string": (("rope_theta",), "abc", "rope_theta"),
    "rope-parameters-theta-string": (("rope_parameters", "rope_theta"), "abc", "rope_theta"),
    "rope-theta-disagrees": (("rope_theta",), 5000.0, "rope_theta"),
    "embedding-scale-string": (("dflash_config", "input_embedding_scale"), "x", "input_embedding_scale"),
    "output-multiplier-nan": (("dflash_config", "output_multiplier"), float("nan"), "output_multiplier"),
    "output-multiplier-zero": (("dflash_config", "output_multiplier"), 0, "output_multiplier"),
    "rms-norm-eps-negative": (("rms_norm_eps",), -1e-5, "rms_norm_eps"),
    "num-target-layers-wrong": (("num_target_layers",), 7, "num_target_layers"),
    "hidden-size-string": (("hidden_size",), "256", "hidden_size"),
    "heads-zero": (("num_attention_heads",), 0, "num_attention_heads"),
    "kv-heads-not-dividing": (("num_key_value_heads",), 3, "num_key_value_heads"),
    "head-dim-odd": (("head_dim",), 63, "head_dim"),
    "head-dim-missing": (("head_dim",), DELETE, "head_dim"),
    "vocab-size-bool": (("vocab_size",), True, "vocab_size"),
    "max-position-negative": (("max_position_embeddings",), -1, "max_position_embeddings"),
    "block-size-1": (("dflash_config", "block_size"), 1, "block_size"),
    "mask-token-out-of-vocab": (("dflash_config", "mask_token_id"), 4096, "mask_token_id"),
    "taps-repeated": (("dflash_config", "target_layer_ids"), [1, 1], "target_layer_ids"),
    "taps-not-a-list": (("dflash_config", "target_layer_ids"), 3, "target_layer_ids"),
    "dflash-config-not-an-object": (("dflash_config",), "x", "dflash_config"),
    "rope-parameters-not-an-object": (("rope_parameters",), "x", "rope_parameters"),
}


def edited_drafter(tmp_path, keys=(), value=None):
    """A copy of the shipped drafter whose config.json holds value at keys (no keys: unedited)."""
    from nano_spec.engine.settings import shipped_weights

    path = Path(shutil.copytree(shipped_weights() / "dflash", tmp_path / "dflash"))
    cfg = json.loads((path / "config.json").read_text())
    if keys:
        *parents, last = keys
        node = cfg
        for k in parents:
            node = node[k]
        node.pop(last) if value is DELETE else node.__setitem__(last, value)
    (path / "config.json").write_text(json.dumps(cfg))  # NaN as JSON's NaN, which Python reads back
    return path


def test_an_unedited_copy_of_the_shipped_drafter_loads(tmp_path):
    """The control of the cases below: copying and rewriting config.json alone changes nothing."""
    from nano_spec import LLM

    llm = LLM(proposer="dflash", drafter=edited_drafter(tmp_path), max_batch=1, max_seq_len=64)
    assert llm.drafter.net.cfg.num_hidden_layers == 2


@pytest.mark.parametrize("keys, value, field", BAD_DRAFTER_CONFIGS.values(), ids=BAD_DRAFTER_CONFIGS.keys())
def test_bad_drafter_config_names_the_field(tmp_path, monkeypatch, keys, value, field):
    """Refused at load with one line naming the field, before any drafter module is built: a 10M-layer config
    cannot hang building its layers (capacity counts the drafter's weights from the sizes)."""
    from nano_spec import LLM

    def built(*args, **kw):
        raise AssertionError("a drafter was built from a config that should have been refused")

    monkeypatch.setattr(DFlashModel, "__init__", built)
    with pytest.raises(ValueError) as e:
        LLM(proposer="dflash", drafter=edited_drafter(tmp_path, keys, value), max_batch=1, max_seq_len=64)
    message = str(e.value)
    assert message.startswith(f"drafter: {field}: ") and "\n" not in message, message


@pytest.mark.parametrize("layers, kw", [(1, {}), (3, dict(taps=[0, 2], block_size=5))], ids=["1-layer", "3-layers"])
def test_weight_bytes_counts_the_drafter_without_building_it(monkeypatch, layers, kw):
    """capacity.weight_bytes adds the drafter's parameters as the built drafter has them, in the dtype's bytes,
    and builds no drafter to count them."""
    from nano_spec.engine.capacity import weight_bytes

    target = tiny_config(num_key_value_heads=1)
    cfg = DFlashConfig.for_target(target, num_layers=layers, **kw)
    built = sum(p.numel() for p in DFlashModel(cfg, Ops("torch")).parameters())
    monkeypatch.setattr(DFlashModel, "__init__", lambda *a, **k: pytest.fail("weight_bytes built the drafter"))
    assert weight_bytes(target, torch.bfloat16, cfg) - weight_bytes(target, torch.bfloat16) == 2 * built
