"""A checkpoint shaped like the published Granite 4.0-H ones, made and saved by transformers.

The config.json has granite-4.0-h-350m's published field set and values (multipliers 12 / 0.015625 /
0.246 / 3, NoPE, attention at irregular layer positions, mamba_d_head 32, d_state 128, one group,
tied embeddings, vocab 100352, the hub's spelling "mamba"/"attention"); only hidden size, layer
count and widths are shrunk so that the test takes seconds. transformers builds the model with
random weights and saves it in bf16, as the hub stores it; the tokenizer.json has fewer tokens than
the vocabulary, as real checkpoints can. transformers is the oracle for logits and greedy output.
"""
import json

import pytest
import torch

from helpers import assert_close, load_script, train_tiny_tokenizer
from nano_spec.model.config import ModelConfig
from nano_spec.engine.capacity import fit, memory_parts, weight_bytes
from nano_spec.engine.llm import LLM
from nano_spec.model.sampling import SamplingParams
from nano_spec.engine.settings import EngineConfig
from nano_spec.model.weights import stored_dtype
from nano_spec.model.model import load_model

SHAPES = load_script("model_shapes")  # the published Granite 4.0-H configs
granite_350m, granite_1b = SHAPES.granite_350m, SHAPES.granite_1b

transformers = pytest.importorskip("transformers")


def shrunk() -> dict:
    """The 350m with hidden 768 -> 192, 32 -> 12 layers (attention at 4, 5, 6, 10: 10/13/17/27 scaled and
    rounded), MLP 2048 -> 256 and Mamba heads 48 -> 12 of the same d_head 32; every other field as published."""
    attention = {4, 5, 6, 10}
    return dict(granite_350m(), hidden_size=192, num_hidden_layers=12, mamba_n_heads=12,
                layer_types=["attention" if i in attention else "mamba" for i in range(12)],
                intermediate_size=256, shared_intermediate_size=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint directory, transformers model in fp32 read back from it)."""
    path = tmp_path_factory.mktemp("granite") / "granite-4.0-h-350m-shrunk"
    hub = shrunk()
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**hub)).eval()
    with torch.no_grad():  # make every weight matter: no unit norms, D or zero conv biases
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name or name.endswith(".D"):
                p.add_(0.2 * torch.randn_like(p))
    hf.to(torch.bfloat16).save_pretrained(path)
    (path / "config.json").write_text(json.dumps(hub, indent=2))  # the hub's file, not transformers' rewrite
    assert train_tiny_tokenizer(path / "tokenizer.json") < hub["vocab_size"]
    ref = transformers.GraniteMoeHybridForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


# published fields about training or transformers' runtime, not the network: nano_spec does not write them
NOT_WRITTEN = {"attention_dropout", "init_method", "initializer_range", "normalization_function", "num_experts_per_tok",
               "output_router_logits", "router_aux_loss_coef", "rope_scaling", "torch_dtype", "use_cache"}
# written beyond the published fields: the dt clamp (transformers' default when absent) and the MTP head count
EXTRA = {"time_step_limit", "num_nextn_predict_layers"}


def test_saved_config_has_the_published_field_names_and_spelling(tmp_path):
    """save_model's config.json against granite-4.0-h-350m's: the same names for the same fields, and the
    values of a model built from the published config (shrunk; a small vocabulary, for a quick save) written back
    as published: layer_types "mamba"/"attention", intermediate_size beside shared_intermediate_size."""
    from nano_spec.model.model import HybridLM
    from nano_spec.model.ops import Ops
    from nano_spec.model.weights import init_weights, save_model

    hub = dict(shrunk(), vocab_size=512, bos_token_id=257, eos_token_id=257, pad_token_id=256)
    save_model(init_weights(HybridLM(ModelConfig.from_dict(hub), Ops("torch")), std=0.02, seed=0), tmp_path / "ck")
    saved = json.loads((tmp_path / "ck" / "config.json").read_text())
    published = granite_350m()
    assert set(saved) - set(published) == EXTRA
    assert set(published) - set(saved) == NOT_WRITTEN
    assert {k: saved[k] for k in set(saved) & set(hub)} == {k: hub[k] for k in set(saved) & set(hub)}
    assert set(saved["layer_types"]) == {"mamba", "attention"}


def test_bf16_checkpoint_loads_strictly_and_runs_fp32_on_cpu(ckpt):
    path, _ = ckpt
    assert stored_dtype(path) == torch.bfloat16
    cfg = ModelConfig.from_file(path / "config.json")
    assert cfg.attention_layers == [4, 5, 6, 10] and cfg.mamba_d_head == 32 and cfg.rope is None
    llm = LLM(path, backend="torch", device="cpu", max_batch=2, max_seq_len=512)
    assert llm.model.model.embed_tokens.weight.dtype == torch.float32  # CPU default, whatever is stored
    assert llm.drafter.__class__.__name__.lower().startswith("ngram")  # no MTP head: n-gram drafts


def test_logits_match_transformers_past_a_chunk(ckpt):
    path, ref = ckpt
    ours = load_model(path)
    ids = torch.randint(0, 100352, (1, 300))  # past mamba_chunk_size 256: transformers' chunked SSD path
    with torch.no_grad():
        err = assert_close("logits vs transformers", ref(ids).logits, ours(ids), atol=1e-4)
    print(f"max abs logits error vs transformers: {err:.2e}")


def prompts(path) -> list:
    from nano_spec.text.tokenizer import Tokenizer

    tok = Tokenizer(path, ModelConfig.from_file(path / "config.json"))
    texts = ["def f(x):\n    return x + 1\n" * 3, "for i in range(10):\n    print(i)\n" * 2, "héllo wörld ✓ " * 4]
    return [tok.encode(t) for t in texts]


def test_greedy_generation_equals_transformers_generate(ckpt):
    path, ref = ckpt
    ids = prompts(path)
    n = 24
    llm = LLM(path, backend="torch", device="cpu", max_batch=3, max_seq_len=256, proposer="none")
    outs = llm.generate(ids, SamplingParams(max_new_tokens=n))
    for p, out in zip(ids, outs):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert out.token_ids == gen, (out.token_ids, gen)


def test_ngram_speculation_is_lossless(ckpt):
    path, _ = ckpt
    ids = prompts(path)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    kw = dict(backend="torch", device="cpu", max_batch=3, max_seq_len=256)
    plain = LLM(path, proposer="none", **kw).generate(ids, params)
    outs = LLM(path, proposer="ngram", num_drafts=3, **kw).generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert any("draft" in o.origins for o in outs), "no draft was accepted: the test did not exercise speculation"


def test_two_shard_save_by_transformers(ckpt, tmp_path):
    path, ref = ckpt
    ref.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="30MB")
    ref.float()
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and not (tmp_path / "model.safetensors").exists()
    single, sharded = load_model(path).state_dict(), load_model(tmp_path).state_dict()
    assert single.keys() == sharded.keys()
    for n in single:
        assert torch.equal(single[n], sharded[n]), n


@pytest.mark.parametrize("hub, capped", [(granite_350m, True), (granite_1b, False)], ids=["350m", "1b"])
def test_default_max_seq_len_is_the_largest_that_fits(hub, capped):
    """At the published sizes (counted on the meta device): on a 24 GB machine the 350m gets its full
    max_position_embeddings and the 1b the largest length whose fp32 weights and caches fit."""
    cfg = ModelConfig.from_dict(hub())
    budget = int(0.9 * 24 * 10**9)
    n = fit(settings(cfg, 8, 3, budget))[0].max_seq_len  # fits
    if capped:
        assert n == cfg.max_position_embeddings
    else:
        assert 4096 < n < cfg.max_position_embeddings
        with pytest.raises(ValueError, match=r"memory: max_batch=8, max_seq_len=\d+, K=4 need .* but the budget"):
            fit(settings(cfg, 8, 3, budget, max_seq_len=n + 1))  # one more row does not


def settings(cfg, max_batch: int, max_drafts: int, budget: int, max_seq_len=None) -> EngineConfig:
    """fp32 on the CPU, n-gram drafts (no drafter state)."""
    return EngineConfig(None, cfg, torch.device("cpu"), torch.float32, "torch", False, max_batch, "ngram", max_drafts,
                        False, None, None, None, budget, max_seq_len)


def test_llm_default_fits_a_small_budget_and_an_explicit_request_is_refused(ckpt):
    path, _ = ckpt
    cfg = ModelConfig.from_file(path / "config.json")
    want = 1000
    budget = sum(memory_parts(settings(cfg, 2, 3, 0), want, weight_bytes(cfg, torch.float32)).values())
    llm = LLM(path, backend="torch", device="cpu", max_batch=2, num_drafts=3, memory_budget=budget)
    assert llm.max_seq_len == want and llm.stats["max_seq_len"] == want
    with pytest.raises(ValueError, match="memory: max_batch=2, max_seq_len=1001"):
        LLM(path, backend="torch", device="cpu", max_batch=2, num_drafts=3, memory_budget=budget,
            max_seq_len=want + 1)


def test_write_checkpoint_in_a_published_shape(tmp_path):
    """scripts/model_shapes.py writes a random-weight checkpoint anyone can measure with: the published fields, the
    shipped tokenizer and vocabulary; the engine loads it and speculates losslessly on it."""
    config = shrunk()
    out = SHAPES.write_checkpoint(config, tmp_path / "ckpt", seed=1)
    shipped = ModelConfig.from_file(SHAPES.SHIPPED)
    cfg = ModelConfig.from_file(out / "config.json")
    assert cfg.vocab_size == shipped.vocab_size and cfg.eos_ids == shipped.eos_ids
    for name in ("hidden_size", "layer_types", "mamba_d_head", "mamba_d_state", "attention_multiplier",
                 "embedding_multiplier", "residual_multiplier", "logits_scaling", "tie_word_embeddings"):
        assert getattr(cfg, name) == config[name], name
    assert (out / "tokenizer.json").read_bytes() == (SHAPES.SHIPPED.parent / "tokenizer.json").read_bytes()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec, plain = (LLM(out, proposer=p, num_drafts=3) for p in ("ngram", "none"))
    prompt = "def f(x):\n    return x"
    assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    with pytest.raises(SystemExit):  # a directory that is not a checkpoint is never replaced
        SHAPES.main(["--write", "350m", "--out", str(tmp_path)])
