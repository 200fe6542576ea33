"""Test helpers: one comparison (max abs and relative error), tiny models and checkpoints, launcher refusals,
the scripts as modules."""
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package), so a test calls its main(argv) in process."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float = 1e-4, rtol_scale: bool = True):
    """Fail unless max|out - ref| <= atol * max(1, max|ref|) (tolerance relative to the reference's scale)."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref_f, out_f = ref.detach().float(), out.detach().float()
    if ref_f.numel() == 0:
        return 0.0
    err = (out_f - ref_f).abs().max().item()
    scale = max(1.0, ref_f.abs().max().item()) if rtol_scale else 1.0
    rel = err / max(ref_f.abs().max().item(), 1e-12)
    assert err <= atol * scale, f"{name}: max abs err {err:.3e} (rel {rel:.3e}) > {atol * scale:.3e}"
    return err


def assert_idle(llm):
    """Nothing queued or running, and every slot free."""
    sched = llm.scheduler
    assert not sched.has_work() and sorted(sched.free_slots) == list(range(llm.runner.cache.num_slots))


def assert_unchanged(name: str, before: torch.Tensor, after: torch.Tensor):
    """Bit-for-bit equality (tolerance 0) for slots, rows and layers a kernel must not touch."""
    assert torch.equal(before, after), f"{name}: {int((before != after).sum())} elements changed"


def masked_graphs(graph) -> list:
    """The keys of a StepGraph's graphs made with a grammar's mask: runner.step hands the mask (B, K, Vw) as its
    4th batched input, and a key ends with the batched inputs' shapes (None for an absent one)."""
    return [key for key in graph.seen if key[-1][3] is not None]


def int8_rounded(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) as a drafter's int8 copy holds it: each row over 255 levels, max |w| at 127, rounded to nearest."""
    step = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.where(step > 0, (w / step).round() * step, w)


def tiny_config(**overrides):
    """A small hybrid config with awkward sizes (P, N not powers of two) and an MTP head."""
    from nano_spec.model.config import ModelConfig

    d = dict(vocab_size=67, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
             shared_intermediate_size=40, layer_types=["mamba", "attention", "mamba", "mamba"],
             mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=10, mamba_d_conv=4, mamba_expand=1,
             embedding_multiplier=1.7, attention_multiplier=0.3, residual_multiplier=0.6, logits_scaling=1.9,
             rms_norm_eps=1e-5, num_nextn_predict_layers=1, eos_token_id=0, max_position_embeddings=256)
    d.update(overrides)
    return ModelConfig.from_dict(d)


def mtp_kv(cfg, num_slots: int, max_len: int, device="cpu"):
    """The MTP head's KV rows (k, v), each (S, L, Hkv, Dh), as MTPDrafter keeps them."""
    k = torch.zeros(num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, device=device)
    return k, torch.zeros_like(k)


def tiny_model(seed: int = 0, backend: str = "torch", **overrides):
    from nano_spec.model.model import HybridLM
    from nano_spec.model.ops import Ops
    from nano_spec.model.weights import init_weights

    model = init_weights(HybridLM(tiny_config(**overrides), Ops(backend)), std=0.2, seed=seed)
    with torch.no_grad():  # non-trivial norm weights and skip, so a wrong weight shows
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".D"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def train_tiny_tokenizer(path, vocab_size: int = 300):
    """A byte-level BPE tokenizer.json with '<|endoftext|>' as id 0, trained on a few lines of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n", "héllo wörld ✓ " * 3] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok.get_vocab_size()


def tiny_checkpoint(path, seed: int = 0, **overrides):
    """A random-weight checkpoint directory with a tokenizer; returns the path."""
    from pathlib import Path

    from nano_spec.model.weights import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_file = path.parent / f"{path.name}.tokenizer.json"
    V = train_tiny_tokenizer(tok_file)
    save_model(tiny_model(seed=seed, vocab_size=max(V, 300), eos_token_id=0, **overrides), path,
               extra_files={"tokenizer.json": tok_file})
    return path


def _spoil(t, fault: str):
    """t wrong in one way: a row short, another dtype, a view with last-dim stride 2, or on the meta device."""
    if fault == "shape":
        return t[:-1]
    if fault == "dtype":
        return t.to(torch.int64 if t.is_floating_point() else torch.float32)
    return torch.stack([t, t], -1)[..., 0] if fault in ("noncontig", "stride") else t.to("meta")


SAYS = {"shape": "got shape", "dtype": "got dtype", "noncontig": "must be contiguous", "stride": "unit stride",
        "device": "must be on"}


def assert_refuses(kernel: str, launcher, inputs: dict, arg: str, fault: str):
    """inputs[arg] spoiled one way (shape, dtype, noncontig, stride, device): the launcher raises a ValueError
    naming the kernel, the argument and what is wrong."""
    inputs = dict(inputs, **{arg: _spoil(inputs[arg], fault)})
    with pytest.raises(ValueError, match=rf"^{kernel}: .*\b{arg}\b.*{SAYS[fault]}"):
        launcher(**inputs)
