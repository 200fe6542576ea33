"""The hybrid Mamba2/attention language model and its MTP draft head (docs/DESIGN.md §2).

Layout, weight names and math are those of transformers' GraniteMoeHybrid with
a dense MLP, so checkpoints travel both ways. Every op with a kernel goes
through `self.ops` (torch references or Triton kernels, see ops.py).

Shapes (docs/DESIGN.md §1):
    B  sequences in a batch          T  tokens of one prompt       K  verify rows (drafts + 1)
    D  hidden size                   V  vocabulary
    H, P, N, G  Mamba heads, head dim, state size, groups;  d_in = H*P;  C = d_in + 2*G*N
    W  conv width                    Hq, Hkv, Dh  attention query heads, KV heads, head dim
    S  cache slots                   R  rows of an MTP call

One token through a layer:
    y, h = RMSNorm_in(h)                         (fused with the previous residual add)
    h   += residual_multiplier * Mixer(y)        Mixer = Mamba2 or attention
    y    = RMSNorm_post(h)
    h   += residual_multiplier * MLP(y)
and after the last layer logits = lm_head(RMSNorm_final(h)) / logits_scaling.
"""
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nano_spec_kernels.common import apply_rope_ref
from nano_spec.model.cache import HybridCache
from nano_spec.model.config import ModelConfig
from nano_spec.model.cpu_rows import linear, on_huge_pages
from nano_spec.model.layers import Attention, Norm
from nano_spec.model.ops import Ops
from nano_spec.model.weights import FLOAT_DTYPES, CheckpointError, load_tensors


def in_major(w):
    """w (out, in) with its storage transposed: the same tensor values, the input dimension outermost."""
    return w.t().contiguous().t()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_linear = nn.Linear(cfg.hidden_size, 2 * cfg.shared_intermediate_size, bias=False)
        self.output_linear = nn.Linear(cfg.shared_intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # gate is the first half
        return self.output_linear(F.silu(gate) * up)


class Mamba(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, C = cfg.hidden_size, cfg.mamba_n_heads, cfg.conv_dim
        self.in_proj = nn.Linear(D, cfg.d_inner + C + H, bias=cfg.mamba_proj_bias)  # -> [z | xBC | dt]
        self.conv1d = nn.Conv1d(C, C, cfg.mamba_d_conv, groups=C, bias=cfg.mamba_conv_bias)  # weight (C, 1, W)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))  # A = -exp(A_log)
        self.D = nn.Parameter(torch.ones(H))  # skip connection
        self.norm = Norm(cfg.d_inner)
        self.out_proj = nn.Linear(cfg.d_inner, D, bias=cfg.mamba_proj_bias)
        self.sizes = (cfg.d_inner, C, H)

    def split(self, u):
        """(..., D) -> z (..., d_in), xBC (..., C), dt (..., H)."""
        return self.in_proj(u).split(self.sizes, dim=-1)

    def scan_args(self):
        """The per-layer weights mamba_scan / mamba_verify take, in their order."""
        return self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, self.A_log, self.D


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm, self.post_attention_layernorm = Norm(cfg.hidden_size), Norm(cfg.hidden_size)
        self.shared_mlp = MLP(cfg)
        if kind == "mamba":
            self.mamba = Mamba(cfg)
        else:
            self.self_attn = Attention(cfg, cfg.attention_bias)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = Norm(cfg.hidden_size)


class MTPHead(nn.Module):
    """DeepSeek-V3 style: m_p = eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)]), o_p = layer(m_p)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = Norm(D), Norm(D), Norm(D)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.layer = DecoderLayer(cfg, "attention")


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops | None = None):
        super().__init__()
        self.cfg = cfg
        self.ops = ops or Ops("torch")
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if cfg.has_mtp else None
        self.register_buffer("head_packed", None, persistent=False)  # a compiled CPU step's copy of the tied head

    def for_inference(self):
        """The layout inference runs fastest in; the weights on disk do not change.
          - one q/k/v GEMM per attention call;
          - on the CPU in fp32, every linear weight and a tied embedding stored transposed, (in, out) in memory: for the
            few rows of a decode step torch's CPU GEMM streams that layout about 1.5x faster than (out, in)
            (docs/BENCHMARKS.md, "The step as one graph"); bf16 keeps (out, in), which its GEMM (oneDNN) reads faster
            (at the 350m shapes the K=1 matmuls take 65 ms against 75 transposed). The tensors keep their shape;
          - on the CPU, every weight in one block of memory on 2 MB pages (cpu_rows.on_huge_pages): a decode step
            streams them all, and on 4 KB pages their pages overflow the TLB."""
        w = self.model.embed_tokens.weight
        cpu = w.device.type == "cpu" and w.dtype == torch.float32
        for m in self.modules():  # a tied embedding too, as the head (a compiled step turns it back: pack_linears)
            if isinstance(m, Attention):
                m.fuse_qkv()
                m.qkv_weight = in_major(m.qkv_weight) if cpu else m.qkv_weight
            elif cpu and (isinstance(m, nn.Linear) or m is self.model.embed_tokens and self.lm_head is None):
                m.weight.data = in_major(m.weight.data)
        if w.device.type == "cpu":  # each original dropped as its copy comes: the weights are never held twice
            params = [p for _, p in self.named_parameters()]  # a tied weight once
            fused = [m for m in self.modules() if isinstance(m, Attention) and m.qkv_weight is not None]
            tensors = [p.data for p in params] + [m.qkv_weight for m in fused]
            for i, (owner, t) in enumerate(zip(params + fused, on_huge_pages(tensors))):
                tensors[i] = None
                if isinstance(owner, Attention):
                    owner.qkv_weight = t
                else:
                    owner.data = t
        return self

    # ---- pieces shared by every entry point ----------------------------------------------
    def embed(self, ids):
        return self.model.embed_tokens(ids) * self.cfg.embedding_multiplier

    packs = (("tied_head", "head_packed"),)  # cpu_rows.pack_linears

    @property
    def tied_head(self):
        return self.model.embed_tokens.weight if self.lm_head is None else None

    def logits(self, y):
        """Final-normed hidden (..., D) -> logits (..., V)."""
        out = self.lm_head(y) if self.lm_head is not None else linear(y, self.tied_head, None, self.head_packed)
        return out / self.cfg.logits_scaling

    def _stack(self, h, layers, final_norm: Norm, run, taps=(), tapped_out=None):
        """Run decoder layers over the residual stream h (..., D); run(i, layer, y, h, w) runs layer i from its
        normed input y and returns (y, h) for the next, y normed by w (the next layer's input norm, or the final
        one): _mixed(mix) or a prompt's layers. taps maps a layer to a column block of tapped_out (..., nT*D), which
        receives the residual after that layer (a block drafter's context, DESIGN §13). Returns the final-normed y.
        """
        D = self.cfg.hidden_size
        y, h = self.ops.rmsnorm(h, layers[0].input_layernorm.weight, self.cfg.rms_norm_eps)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
            y, h = run(i, layer, y, h, nxt.weight)
            if i in taps:
                tapped_out[..., taps[i] * D : (taps[i] + 1) * D] = h
        return y

    def _mixed(self, mix):
        """A layer runner for _stack from mix(i, layer, y), the mixer's output."""
        return lambda i, layer, y, h, w: self._finish(layer, mix(i, layer, y), h, w)

    def _finish(self, layer, out, h, w):
        """A layer after its mixer's output out: h += rm * out, normed; the MLP; h += rm * MLP, normed by w -> (y, h).
        Each RMSNorm is fused with the residual add before it."""
        eps, rm = self.cfg.rms_norm_eps, self.cfg.residual_multiplier
        y, h = self.ops.rmsnorm(out, layer.post_attention_layernorm.weight, eps, residual=h, multiplier=rm)
        return self.ops.rmsnorm(layer.shared_mlp(y), w, eps, residual=h, multiplier=rm)

    def _mamba_out(self, m: Mamba, y, z):
        """y (..., H, P) from the scan, z (..., d_in) -> out_proj(norm(y * silu(z)))."""
        group = self.cfg.d_inner // self.cfg.mamba_n_groups  # channels per norm group, d_in / G
        return m.out_proj(self.ops.gated_rmsnorm(y.reshape(z.shape), z, m.norm.weight, group, self.cfg.rms_norm_eps))

    def _scan(self, m: Mamba, xBC, dt):
        """One prompt from zero state: xBC (T, C), dt (T, H) -> (y (T, H, P), ssm (H, P, N), window (C, W-1))."""
        return self.ops.mamba_scan(xBC, dt, *m.scan_args(), self.cfg.mamba_n_groups, self.cfg.mamba_d_head,
                                   self.cfg.time_step_limit)

    def _attend(self, attn: Attention, y, k_cache, v_cache, slot, seq_lens=None):
        """Attention through a KV cache: one prompt y (T, D) into slot `slot` (seq_lens None), or
        K rows y (B, K, D) per slot of slot ids (B,) at positions seq_lens[b] + j."""
        op, lens = (self.ops.attention_prefill, ()) if seq_lens is None else (self.ops.attention_verify, (seq_lens,))
        o = op(*attn.qkv(y), k_cache, v_cache, slot, *lens, self.cfg.attention_multiplier, self.cfg.rope)
        return attn.o_proj(o.flatten(-2))

    # ---- 1. the no-cache reference -----------------------------------------------------
    def forward(self, ids):
        """ids (B, T) -> logits (B, T, V)."""
        return self.logits(self.hidden(ids))

    def hidden(self, ids, taps=(), tapped_out=None):
        """ids (B, T) -> final-normed hidden (B, T, D), no cache (also the training forward).
        tapped_out (B, T, nT*D), if given, receives the residual after each layer in taps (a drafter's context)."""
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)

        def mix(i, layer, y):  # y (B, T, D)
            if layer.kind == "mamba":
                z, xBC, dt = layer.mamba.split(y)
                ys = torch.stack([self._scan(layer.mamba, xBC[b], dt[b])[0] for b in range(B)])  # (B, T, H, P)
                return self._mamba_out(layer.mamba, ys, z)
            return self._attend_nocache(layer.self_attn, y, pos)

        return self._stack(self.embed(ids), self.model.layers, self.model.norm, self._mixed(mix),
                           {layer: i for i, layer in enumerate(taps)}, tapped_out)

    def _attend_nocache(self, attn: Attention, y, pos):
        """Causal attention over y (B, T, D) with torch's SDPA: an oracle independent of the kernels."""
        q, k, v = attn.qkv(y)  # (B, T, Hq|Hkv, Dh)
        q, k = apply_rope_ref(q, pos, self.cfg.rope), apply_rope_ref(k, pos, self.cfg.rope)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=self.cfg.attention_multiplier,
                                           enable_gqa=q.shape[2] != k.shape[2])  # (B, Hq, T, Dh)
        return attn.o_proj(o.transpose(1, 2).flatten(2))

    # ---- 2. prefill of one prompt into a slot ------------------------------------------------
    def prefill(self, ids, slot: int, cache: HybridCache, tapped_out=None, run=None):
        """ids (T,) from zero state into cache slot `slot` -> final-normed hidden (T, D).
        tapped_out (T, nT*D), if given, receives the rows of the layers in cache.tap_index. run: prompt_layer, or
        the form the engine's mode runs it in (engine/graph.py: PromptGraph); each layer's state goes into the slot."""
        run, T = run or self.prompt_layer, ids.shape[0]

        def into_slot(i, layer, y, h, w):
            y, h, a, b = run(layer, y, h, w)
            if layer.kind == "mamba":
                m = cache.mamba_index[i]
                cache.ssm_state[m, slot], cache.conv_state[m, slot] = a, b
            else:
                j = cache.attn_index[i]
                cache.k[j, slot, :T], cache.v[j, slot, :T] = a, b
            return y, h

        taps = cache.tap_index if tapped_out is not None else ()
        return self._stack(self.embed(ids), self.model.layers, self.model.norm, into_slot, taps, tapped_out)

    def prompt_layer(self, layer: DecoderLayer, y, h, w):
        """One layer over a prompt's T rows from zero state, writing no cache: y (T, D) its normed input, h (T, D)
        the residual, w the next norm's weight -> (y, h) for the next layer (_stack's) and the layer's state, a Mamba
        layer's ssm (H, P, N) and conv window (C, W-1), an attention layer's K rows, rotated as cached, and V rows
        (T, Hkv, Dh). A pure function of its inputs: a compiled engine runs its Mamba layers as a graph."""
        if layer.kind == "mamba":
            z, xBC, dt = layer.mamba.split(y)
            ys, *state = self._scan(layer.mamba, xBC, dt)
            out = self._mamba_out(layer.mamba, ys, z)
        else:
            kv = y.new_empty(2, 1, y.shape[0], self.cfg.num_key_value_heads, self.cfg.head_dim)  # a T-row cache slot
            out = self._attend(layer.self_attn, y, kv[0], kv[1], 0)
            state = kv[:, 0]  # (2, T, Hkv, Dh)
        return (*self._finish(layer, out, h, w), *state)

    # ---- 3. verify: B slots x K rows -----------------------------------------------------------
    def verify(self, ids, slot_ids, seq_lens, cache: HybridCache, kv_len: int | None = None):
        """ids (B, K) at positions seq_lens[b] + j of slots slot_ids (B,) -> logits (B, K, V).

        Advances every Mamba layer's live state through all K rows and writes ssm_stash, conv_stash, hidden_stash
        and, for a block drafter, tap_stash (docs/DESIGN.md §3). kv_len, if given, bounds the KV rows read
        (>= max(seq_lens) + K).
        """
        B, K = ids.shape
        ssm_stash, conv_stash = cache.ssm_stash(B, K), cache.conv_stash(B, K)

        def mix(i, layer, y):  # y (B, K, D)
            if layer.kind == "mamba":
                m = cache.mamba_index[i]
                z, xBC, dt = layer.mamba.split(y)
                ys = self.ops.mamba_verify(xBC, dt, cache.conv_state[m], cache.ssm_state[m], slot_ids,
                                           *layer.mamba.scan_args(), ssm_stash[m], conv_stash[m],
                                           self.cfg.mamba_n_groups, self.cfg.time_step_limit)  # (B, K, H, P)
                return self._mamba_out(layer.mamba, ys, z)
            a = cache.attn_index[i]
            return self._attend(layer.self_attn, y, cache.k[a, :, :kv_len], cache.v[a, :, :kv_len], slot_ids, seq_lens)

        y = self._stack(self.embed(ids), self.model.layers, self.model.norm, self._mixed(mix), cache.tap_index,
                        cache.tap_stash(B, K))
        cache.hidden_stash(B, K).copy_(y)
        return self.logits(y)

    # ---- 4. the MTP draft head -----------------------------------------------------------------
    # A catch-up runs the head over every verified row for the K/V rows its attention writes, but a draft needs
    # the head's output at one row a sequence, the last accepted. So the layer runs in two halves: the catch-up
    # (mtp_prefill, mtp_attention) stops after the attention and keeps the residual; the MLP half (mtp_mlp), 2/3
    # of the layer's weights, runs at that one row when a draft grows from it. Where products cost by the row
    # (8 sequences on a CPU), that saves K - 1 rows of it a step (docs/BENCHMARKS.md, "The MTP head in two halves").
    def _mtp_in(self, next_ids, h):
        """The head's input: x = eh_proj([enorm(E next_ids), hnorm(h)]) (..., D), the residual its layer starts from."""
        eps, mtp = self.cfg.rms_norm_eps, self.mtp
        e = self.ops.rmsnorm(self.model.embed_tokens(next_ids), mtp.enorm.weight, eps)[0]
        hn = self.ops.rmsnorm(h, mtp.hnorm.weight, eps)[0]
        return mtp.eh_proj(torch.cat([e, hn], dim=-1))

    def _mtp_attention(self, next_ids, h, attend):
        """The layer's first half over next_ids (...), h (..., D), attend(attn, y) its attention -> (y, r): the
        residual r = x + rm * attention (..., D), and y its post-attention norm, the MLP's input."""
        eps, layer, x = self.cfg.rms_norm_eps, self.mtp.layer, self._mtp_in(next_ids, h)
        out = attend(layer.self_attn, self.ops.rmsnorm(x, layer.input_layernorm.weight, eps)[0])
        return self.ops.rmsnorm(out, layer.post_attention_layernorm.weight, eps, residual=x,
                                multiplier=self.cfg.residual_multiplier)

    def mtp_mlp(self, r, y=None):
        """The layer's second half: the residual r (..., D) after the attention (y: its norm, if at hand) -> the
        head's output o (..., D), before the head's final norm."""
        layer = self.mtp.layer
        y = self.ops.rmsnorm(r, layer.post_attention_layernorm.weight, self.cfg.rms_norm_eps)[0] if y is None else y
        return r + self.cfg.residual_multiplier * layer.shared_mlp(y)

    def _mtp(self, next_ids, h, attend):
        """The whole layer over next_ids (...), h (..., D), attend(attn, y) its attention -> o (..., D)."""
        y, r = self._mtp_attention(next_ids, h, attend)
        return self.mtp_mlp(r, y)

    def _mtp_cached(self, slot_ids, positions, k_cache, v_cache, kv_len):
        """The head's attention through its KV cache, rows at positions[b] + r of slots slot_ids (B,)."""
        return lambda attn, y: self._attend(attn, y, k_cache[:, :kv_len], v_cache[:, :kv_len], slot_ids, positions)

    def mtp_logits(self, o, head=None):
        """MTP layer output o (..., D) (before its norm) -> draft logits (..., V), through head (a DraftHead) if
        given, else the model's own logits."""
        y = self.ops.rmsnorm(o, self.mtp.norm.weight, self.cfg.rms_norm_eps)[0]
        return self.logits(y) if head is None else head(y)

    def mtp_hidden(self, next_ids, h):
        """No-cache reference over positions 0..T-1: next_ids (B, T), h (B, T, D) -> o (B, T, D)."""
        pos = torch.arange(next_ids.shape[1], device=next_ids.device)
        return self._mtp(next_ids, h, lambda attn, y: self._attend_nocache(attn, y, pos))

    def mtp_prefill(self, next_ids, h, slot: int, k_cache, v_cache):
        """Catch-up over a prompt's rows 0..T-1: next_ids (T,), h (T, D); writes the MTP KV rows 0..T-1 of slot
        `slot` in k_cache, v_cache (S, L, Hkv, Dh) -> the residual after the attention, r (T, D)."""
        return self._mtp_attention(next_ids, h, lambda attn, y: self._attend(attn, y, k_cache, v_cache, slot))[1]

    def mtp_attention(self, next_ids, h, slot_ids, positions, k_cache, v_cache, kv_len: int | None = None):
        """Catch-up after a verify, R = K rows per sequence at MTP positions positions[b] + r: next_ids (B, R),
        h (B, R, D); writes their MTP KV rows -> the residual after the attention, r (B, R, D)."""
        return self._mtp_attention(next_ids, h, self._mtp_cached(slot_ids, positions, k_cache, v_cache, kv_len))[1]

    def mtp_forward(self, next_ids, h, slot_ids, positions, k_cache, v_cache, kv_len: int | None = None):
        """The whole layer over R rows per sequence at MTP positions positions[b] + r: next_ids (B, R), h (B, R, D)
        -> o (B, R, D). Each recursive draft step (R = 1)."""
        return self._mtp(next_ids, h, self._mtp_cached(slot_ids, positions, k_cache, v_cache, kv_len))


class DraftHead(nn.Module):
    """The target's output layer as a drafter reads it: logits (..., V) = y W^T / logits_scaling, W the target's
    (tied embedding or lm_head). The module reads the weight but does not hold it, so that its packed copy is the
    drafts' own: a compiled CPU step packs it in int8 while the verify's stays fp32 (cpu_rows.pack_linears)."""
    packs = (("weight", "packed"),)

    def __init__(self, target: HybridLM):
        super().__init__()
        self.target = (target,)  # in a tuple: not a submodule, whose weights would be the drafter's to pack
        self.register_buffer("packed", None, persistent=False)

    @property
    def weight(self):
        target = self.target[0]
        return target.tied_head if target.lm_head is None else target.lm_head.weight

    def forward(self, y):
        return linear(y, self.weight, None, self.packed) / self.target[0].cfg.logits_scaling


def load_model(path, device="cpu", dtype=torch.float32, backend: str = "torch") -> HybridLM:
    """Build the model of path/config.json and fill it from its safetensors, converted to dtype on device."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of {FLOAT_DTYPES}")
    cfg = ModelConfig.from_file(path / "config.json")
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()  # some writers store the tied head too: the embedding
    return load_tensors(lambda: HybridLM(cfg, Ops(backend)), path, device, dtype, skip=tied)
