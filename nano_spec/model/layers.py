"""The weight holders both networks share, the target's (model.py) and the DFlash drafter's (dflash.py): an RMSNorm
weight and an attention layer's projections. The math they feed is the ops' (ops.py) and the callers'."""
import torch
import torch.nn as nn

from nano_spec.model.cpu_rows import linear


class Norm(nn.Module):
    """Holds an RMSNorm weight; the math is ops.rmsnorm / ops.gated_rmsnorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    """The q/k/v/o projections of an attention layer, the target's (ModelConfig) or the drafter's (DFlashConfig,
    with Qwen3's per-head q_norm and k_norm); the attention itself is the caller's."""
    packs = (("qkv_weight", "qkv_packed"),)  # a compiled CPU step's copy of the fused weight (cpu_rows.pack_linears)

    def __init__(self, cfg, bias: bool = False, qk_norm: bool = False):
        super().__init__()
        D, Dh = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(D, cfg.num_attention_heads * Dh, bias=bias)
        self.k_proj = nn.Linear(D, cfg.num_key_value_heads * Dh, bias=bias)
        self.v_proj = nn.Linear(D, cfg.num_key_value_heads * Dh, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * Dh, D, bias=bias)
        self.Dh = Dh
        self.sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        # [q | k | v] stacked for one GEMM per inference call by fuse_qkv(); never saved, training updates q/k/v_proj
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_packed", None, persistent=False)
        if qk_norm:
            self.q_norm, self.k_norm = Norm(Dh), Norm(Dh)

    def fuse_qkv(self):
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()

    def qkv(self, x):
        """(..., D) -> q (..., Hq, Dh), k and v (..., Hkv, Dh)."""
        lead = x.shape[:-1]
        if self.qkv_weight is not None:
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(*lead, -1, self.Dh), k.view(*lead, -1, self.Dh), v.view(*lead, -1, self.Dh)
