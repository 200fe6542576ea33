"""The model shapes the kernels are checked and predicted at: the shipped weights and Granite 4.0-H 350m and 1b.

The Granite configs are the published field sets (the 1b by its shapes: hidden 1536, 40 layers, Mamba head dim 64).
tests/test_real_shapes.py builds its checkpoint from them; scripts/compile_check.py and the roofline read only
the shapes, no weights.
"""
from pathlib import Path

from nano_spec.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "weights" / "stdlib-hybrid-8m" / "config.json"


def granite_350m() -> dict:
    """granite-4.0-h-350m's config.json as published (field set and values)."""
    attention = {10, 13, 17, 27}
    return dict(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", attention_bias=False,
        attention_dropout=0.0, attention_multiplier=0.015625, bos_token_id=100257, embedding_multiplier=12,
        eos_token_id=100257, hidden_act="silu", hidden_size=768, init_method="mup", initializer_range=0.1,
        intermediate_size=2048, layer_types=["attention" if i in attention else "mamba" for i in range(32)],
        logits_scaling=3, mamba_chunk_size=256, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=32,
        mamba_d_state=128, mamba_expand=2, mamba_n_groups=1, mamba_n_heads=48, mamba_proj_bias=False,
        max_position_embeddings=32768, normalization_function="rmsnorm", num_attention_heads=12,
        num_experts_per_tok=0, num_hidden_layers=32, num_key_value_heads=4, num_local_experts=0,
        output_router_logits=False, pad_token_id=100256, position_embedding_type="nope", residual_multiplier=0.246,
        rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000, router_aux_loss_coef=0.01,
        shared_intermediate_size=2048, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
        vocab_size=100352)


def granite_1b() -> dict:
    """granite-4.0-h-1b's shapes: hidden 1536, 40 layers with attention at 5/15/25/35, Mamba head dim 64."""
    attention = {5, 15, 25, 35}
    return dict(granite_350m(), hidden_size=1536, num_hidden_layers=40, mamba_d_head=64, mamba_n_heads=48,
                layer_types=["attention" if i in attention else "mamba" for i in range(40)],
                intermediate_size=4096, shared_intermediate_size=4096, max_position_embeddings=131072)


def models(names=("shipped", "350m", "1b")) -> dict:
    """name -> ModelConfig."""
    make = {"shipped": lambda: ModelConfig.from_file(SHIPPED), "350m": lambda: ModelConfig.from_dict(granite_350m()),
            "1b": lambda: ModelConfig.from_dict(granite_1b())}
    return {n: make[n]() for n in names}
