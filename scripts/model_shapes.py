"""The model shapes the kernels are checked and predicted at: the shipped weights and Granite 4.0-H 350m and 1b.

The Granite configs are the published field sets (the 1b by its shapes: hidden 1536, 40 layers, Mamba head dim 64).
tests/test_real_shapes.py builds its checkpoint from them; scripts/compile_check.py and the roofline read only
the shapes, no weights. Run as a script, it writes a random-weight checkpoint in one of these shapes, so that anyone
can measure the engine at the sizes users run without downloading a model:

    python scripts/model_shapes.py --write 350m --out /tmp/granite-350m-random [--vocab ours] [--dtype float32]

--vocab ours (the default) keeps the shipped 4,096-token tokenizer and vocabulary, so prompts tokenize as in every
other measurement; --vocab published keeps the published 100,352 rows (the output layer is then the largest matmul;
ids past the tokenizer's never come out of it as text).
"""
import argparse
from pathlib import Path

import torch

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


def write_checkpoint(config: dict, out, vocab: str = "ours", dtype=torch.float32, seed: int = 0) -> Path:
    """A published config dict -> a checkpoint directory at out with random weights (init_weights) in dtype and the
    shipped tokenizer.json; vocab "ours" takes the shipped vocabulary size and special ids."""
    from nano_spec.model.model import HybridLM
    from nano_spec.model.weights import init_weights, save_model

    if vocab == "ours":
        shipped = ModelConfig.from_file(SHIPPED)
        config = dict(config, vocab_size=shipped.vocab_size, bos_token_id=shipped.bos_token_id,
                      eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id)
    model = init_weights(HybridLM(ModelConfig.from_dict(config)), seed=seed).to(dtype)
    save_model(model, Path(out), extra_files={"tokenizer.json": SHIPPED.parent / "tokenizer.json"})
    return Path(out)


def main(argv=None):
    p = argparse.ArgumentParser(description="write a random-weight checkpoint in a published Granite 4.0-H shape")
    p.add_argument("--write", choices=["350m", "1b"], required=True, help="the published shape")
    p.add_argument("--out", required=True, help="the checkpoint directory to write (replaced whole if it exists)")
    p.add_argument("--vocab", choices=["ours", "published"], default="ours")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if Path(args.out).exists() and not (Path(args.out) / "config.json").is_file():
        p.error(f"--out: {args.out} exists and is not a checkpoint directory; nothing was written")
    config = {"350m": granite_350m, "1b": granite_1b}[args.write]()
    out = write_checkpoint(config, args.out, args.vocab, getattr(torch, args.dtype), args.seed)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: granite-4.0-h-{args.write} shapes, random weights, {args.dtype}, vocab {args.vocab} "
          f"({size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
