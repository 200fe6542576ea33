"""The DFlash block drafter: one forward drafts a whole block (docs/DESIGN.md §13).

The drafter is a few Qwen3-style decoder layers with no embedding or head of its own: it reads the
target's embedding and head, frozen. Its context is the target's residual stream after a few layers
(the taps, `target_layer_ids`), concatenated and projected: c = hidden_norm(fc([h_l1 | h_l2 | ...])).

Shapes:
    B   sequences        Bk  block size (rows of one draft forward)     Ld  drafter layers
    D   hidden size      nT  taps (target layers read)                  Tc  context rows
    Hq, Hkv, Dh          the drafter's attention heads and head dim     V   the target's vocabulary

One draft forward, for a sequence whose context holds positions 0 .. Tc-1:
    1. block  x = embed([last token, MASK x (Bk-1)]) * input_embedding_scale     at positions Tc .. Tc+Bk-1
    2. every layer:  y = RMSNorm_in(x)
                     q = RoPE(q_norm(q_proj(y)))                                   queries: block rows only
                     k = RoPE(k_norm(k_proj([c ; y]))),  v = v_proj([c ; y])       keys: context, then block
                     x += o_proj(softmax(q kᵀ / sqrt(Dh)) v)                       non-causal: the block sees itself
                     x += MLP(RMSNorm_post(x))                                     SwiGLU
    3. logits = head(RMSNorm_final(x)) * output_multiplier; rows 1 .. Bk-1 are the drafts

The context's keys and values depend only on the committed rows, so the engine stores them once per
row (drafters.dflash.DFlashDrafter); the block's are recomputed by every draft and never stored.

Stored as the reference implementation stores it (its `DFlashDraftModel`): a Qwen3 config.json whose
`dflash_config` holds target_layer_ids, block_size and mask_token_id (and the two scales), plus
model.safetensors with the reference's weight names.
"""
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nano_spec.model.config import LIMITS, ModelConfig, check_fields, check_rules, is_int
from nano_spec.model.layers import Attention, Norm  # weights; the math is ops.rmsnorm, in fp32 as the target's
from nano_spec.model.weights import load_tensors
from nano_spec_kernels.common import apply_rope_ref


def default_taps(num_target_layers: int, num_layers: int) -> list:
    """One tap per drafter layer, spread evenly over layers 1 .. L-3 (the middle one for a single layer):
    early layers carry the tokens, late ones the prediction. A target too shallow for that spreads them over
    every layer instead, and has at most one tap per layer."""
    L, n = num_target_layers, min(num_layers, num_target_layers)
    if n == 1:
        return [L // 2]
    spread = lambda lo, hi: [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]  # noqa: E731
    taps = spread(1, L - 3)
    return taps if len(set(taps)) == n and L > 3 else spread(0, L - 1)


SIZES = {  # field: (least, most) accepted; the target's caps (config.LIMITS) where a target size matches
    "hidden_size": (1, LIMITS["hidden_size"]), "num_hidden_layers": (1, LIMITS["num_hidden_layers"]),
    "num_attention_heads": (1, LIMITS["num_attention_heads"]),
    "num_key_value_heads": (1, LIMITS["num_key_value_heads"]),
    "head_dim": (2, LIMITS["hidden_size"]), "intermediate_size": (1, LIMITS["shared_intermediate_size"]),
    "vocab_size": (1, LIMITS["vocab_size"]), "num_target_layers": (1, LIMITS["num_hidden_layers"]),
    "block_size": (2, 64), "max_position_embeddings": (1, LIMITS["max_position_embeddings"]),
}
NUMBERS = ("input_embedding_scale", "output_multiplier", "rms_norm_eps", "rope_theta")


@dataclass
class DFlashConfig:
    hidden_size: int                  # D, the target's
    num_hidden_layers: int            # Ld
    num_attention_heads: int          # Hq
    num_key_value_heads: int          # Hkv
    head_dim: int                     # Dh
    intermediate_size: int            # SwiGLU width
    vocab_size: int                   # V, the target's: its embedding and head are used
    num_target_layers: int            # the target's layer count (taps index it)
    target_layer_ids: list = field(default_factory=list)  # the taps, in order
    block_size: int = 8               # Bk: one forward drafts Bk - 1 tokens
    mask_token_id: int = 0            # the id of the Bk - 1 placeholder rows
    input_embedding_scale: float = 1.0  # the target's embedding_multiplier
    output_multiplier: float = 1.0    # 1 / the target's logits_scaling
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 2048

    @classmethod
    def for_target(cls, cfg: ModelConfig, num_layers: int = 1, block_size: int = 8, taps=None,
                   mask_token_id: int | None = None) -> "DFlashConfig":
        """A drafter shaped like the target's attention and MLP. The mask token defaults to EOS: a vocabulary
        whose only special token is <|endoftext|> has no unused id, and EOS never sits inside a block (a
        sequence ends at it), so the placeholder cannot be mistaken for a real draft position's token."""
        eos = (cfg.eos_ids or [0])[0]  # a target with no EOS: id 0
        return cls(hidden_size=cfg.hidden_size, num_hidden_layers=num_layers,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.shared_intermediate_size, vocab_size=cfg.vocab_size,
                   num_target_layers=cfg.num_hidden_layers,
                   target_layer_ids=list(taps) if taps else default_taps(cfg.num_hidden_layers, num_layers),
                   block_size=block_size, mask_token_id=eos if mask_token_id is None else mask_token_id,
                   input_embedding_scale=cfg.embedding_multiplier, output_multiplier=1.0 / cfg.logits_scaling,
                   rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings)

    def __post_init__(self):
        """Every field checked whoever builds the config, so a drafter is only ever built from sizes in bounds."""
        check_fields(self, SIZES, NUMBERS, prefix="drafter: ")
        Hq, Hkv, V, L, taps = (self.num_attention_heads, self.num_key_value_heads, self.vocab_size,
                               self.num_target_layers, self.target_layer_ids)
        rules = (  # valid, the message naming the field
            (Hq % Hkv == 0, f"num_key_value_heads: {Hkv} does not divide num_attention_heads {Hq}"),
            (self.head_dim % 2 == 0, f"head_dim: {self.head_dim} must be even (RoPE rotates pairs)"),
            (is_int(self.mask_token_id, 0, V - 1), f"mask_token_id: {self.mask_token_id!r} is not a token id below "
                                                   f"vocab_size {V}"),
            (isinstance(taps, list) and len(taps) > 0 and all(is_int(i, 0, L - 1) for i in taps)
             and len(set(taps)) == len(taps),
             f"target_layer_ids: {taps!r} must be a non-empty list of distinct layer indices of the target "
             f"(0 .. {L - 1})"),
            (self.output_multiplier != 0, "output_multiplier: 0 would make every draft logit equal"),
            (self.rms_norm_eps > 0, f"rms_norm_eps: {self.rms_norm_eps!r} must be positive"),
            (self.rope_theta > 0, f"rope_theta: {self.rope_theta!r} must be positive"),
        )
        check_rules(rules, prefix="drafter: ")

    @property
    def num_parameters(self) -> int:
        """The drafter's parameter count from its sizes, without building it (capacity counts it first)."""
        D, Dh, I = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * Dh, self.num_key_value_heads * Dh
        attention = 2 * D * q + 2 * D * kv + 2 * Dh  # q_proj and o_proj, k_proj and v_proj, q_norm and k_norm
        layer = attention + 3 * D * I + 2 * D        # the SwiGLU's three projections, the two norms
        return self.num_hidden_layers * layer + len(self.target_layer_ids) * D * D + 2 * D  # fc, norm, hidden_norm

    DRAFT_FIELDS = ("target_layer_ids", "block_size", "mask_token_id", "input_embedding_scale", "output_multiplier")

    def to_dict(self) -> dict:
        """The reference's config.json: Qwen3 fields, and dflash_config."""
        d = asdict(self)
        draft = {k: d.pop(k) for k in self.DRAFT_FIELDS}
        return dict(architectures=["DFlashDraftModel"], model_type="qwen3", **d, attention_bias=False,
                    attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, dflash_config=draft)

    @classmethod
    def from_file(cls, path: Path) -> "DFlashConfig":
        """Read a drafter's config.json; every field is checked (__post_init__), naming the first that is wrong."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"drafter: cannot read {path}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"drafter: {path} is not a DFlash config (a JSON object of Qwen3 fields and "
                             "dflash_config)")
        draft, rope = d.get("dflash_config"), d.get("rope_parameters") or {}
        check_rules(((isinstance(v, dict), f"{n}: {v!r} is not a JSON object")
                     for n, v in (("dflash_config", draft), ("rope_parameters", rope))), prefix="drafter: ")
        kw = {f: d[f] for f in cls.__dataclass_fields__ if f in d and f not in cls.DRAFT_FIELDS}
        kw.update({f: draft[f] for f in cls.DRAFT_FIELDS if f in draft})
        if "rope_theta" in rope:  # the newer spelling
            kw["rope_theta"] = rope["rope_theta"]
        missing = [f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING and f.name not in kw]
        if missing:
            raise ValueError(f"drafter: {', '.join(missing)}: missing from {path}")
        cfg = cls(**kw)
        if "rope_theta" in rope and d.get("rope_theta", cfg.rope_theta) != cfg.rope_theta:  # refused, not guessed
            raise ValueError(f"drafter: rope_theta: {d['rope_theta']!r} but rope_parameters.rope_theta is "
                             f"{cfg.rope_theta!r}")
        return cfg

    def check(self, target: ModelConfig):
        """Refuse a drafter that does not fit the target, naming each field that does not."""
        L, taps = target.num_hidden_layers, self.target_layer_ids
        bad = [f"{n}: {getattr(self, n)} != the target's {getattr(target, n)}" for n in ("hidden_size", "vocab_size")
               if getattr(self, n) != getattr(target, n)]
        if self.num_target_layers != L:
            bad.append(f"num_target_layers: {self.num_target_layers} != the target's layer count {L}")
        if max(taps) >= L:
            bad.append(f"target_layer_ids: {taps!r} must be layer indices of the target (0 .. {L - 1})")
        if bad:
            raise ValueError("drafter: " + "; ".join(bad))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(cfg.hidden_size), Norm(cfg.hidden_size)
        self.self_attn, self.mlp = Attention(cfg, qk_norm=True), SwiGLU(cfg)


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, ops):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Norm(cfg.hidden_size)
        self.scale = cfg.head_dim ** -0.5

    def _norm(self, x, norm: Norm):
        return self.ops.rmsnorm(x, norm.weight, self.cfg.rms_norm_eps)[0]

    def context(self, tapped):
        """The tapped rows (..., nT*D) -> the context rows c (..., D)."""
        return self._norm(self.fc(tapped), self.hidden_norm)

    def _kv(self, a: Attention, x):
        """Rows x (B, T, D) -> k (normed, not rotated) and v, (B, T, Hkv, Dh) each."""
        shape = (*x.shape[:2], self.cfg.num_key_value_heads, self.cfg.head_dim)
        return self._norm(a.k_proj(x).view(shape), a.k_norm), a.v_proj(x).view(shape)

    def context_kv(self, i: int, c, positions):
        """Layer i's keys and values of context rows c (B, T, D) at positions (B, T) -> (B, T, Hkv, Dh) each."""
        k, v = self._kv(self.layers[i].self_attn, c)
        return apply_rope_ref(k, positions, self.cfg.rope_theta), v

    def _layers(self, x, attend):
        """x (B, Bk, D) through every layer -> final-normed (B, Bk, D); attend(i, q, k, v) is the attention of the
        block's q (B, Bk, Hq, Dh) and k, v (B, Bk, Hkv, Dh), q and k normed, not rotated."""
        for i, layer in enumerate(self.layers):
            a, y = layer.self_attn, self._norm(x, layer.input_layernorm)
            q = self._norm(a.q_proj(y).view(*y.shape[:2], -1, self.cfg.head_dim), a.q_norm)
            x = x + a.o_proj(attend(i, q, *self._kv(a, y)).flatten(-2))
            x = x + layer.mlp(self._norm(x, layer.post_attention_layernorm))
        return self._norm(x, self.norm)

    def forward(self, x, tapped, positions, mask=None):
        """No cache. x (B, Q, D) the embedded block rows, tapped (B, T, nT*D) the context, positions (B, T + Q)
        for [context | block]; mask (B or 1, Q, T + Q) bool, True = visible (None: every row sees every key).
        Training stacks several blocks into Q with a mask; a single block with no mask is one draft forward."""
        c, T = self.context(tapped), tapped.shape[1]
        ctx_kv = [self.context_kv(i, c, positions[:, :T]) for i in range(len(self.layers))]
        block_pos = positions[:, T:]
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads

        def attend(i, q, k, v):
            q, k = apply_rope_ref(q, block_pos, self.cfg.rope_theta), apply_rope_ref(k, block_pos, self.cfg.rope_theta)
            k, v = torch.cat([ctx_kv[i][0], k], 1), torch.cat([ctx_kv[i][1], v], 1)  # (B, T + Q, Hkv, Dh)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1),
                                               v.transpose(1, 2).repeat_interleave(rep, 1),
                                               attn_mask=None if mask is None else mask[:, None], scale=self.scale)
            return o.transpose(1, 2)  # (B, Q, Hq, Dh)

        return self._layers(x, attend)

    def draft_hidden(self, x, slot_ids, ctx_lens, k_cache, v_cache):
        """The engine's forward: x (B, Bk, D) at positions ctx_lens[b] + j; the context's K/V are rows
        [0, ctx_lens[b]) of slot slot_ids[b] in k_cache, v_cache (Ld, S, L, Hkv, Dh) -> final-normed (B, Bk, D)."""
        return self._layers(x, lambda i, q, k, v: self.ops.attention_block(q, k, v, k_cache[i], v_cache[i], slot_ids,
                                                                          ctx_lens, self.scale, self.cfg.rope_theta))


def load_drafter(path, cfg: DFlashConfig, ops, device, dtype) -> DFlashModel:
    """The weights of a drafter directory (model.safetensors) into the network of its config.json, which the caller
    has read and checked against the target (nano_spec/engine/settings.py)."""
    return load_tensors(lambda: DFlashModel(cfg, ops), path, device, dtype)
