"""Speculative decoding of one sequence through real caches: the hybrid loop in one screen (docs/DESIGN.md §10).

reference.py re-runs the whole sequence every step; here each token enters the caches once, as in the engine.
An attention layer keeps a K/V row per position: rows written for rejected drafts are overwritten later. A Mamba
layer keeps one state that every row advances, and a rejected draft cannot be taken back out of it: so the verify
keeps the state after each of its K rows (the stash), and the commit keeps the one after row na, the last
accepted. The MTP head then catches up over rows 0..na; its output at row na (head_out) grows the next draft 1.
Greedy, MTP drafts; own state, stash and K/V tensors; the model's weights, and the kernels' torch references.
"""
import torch
import torch.nn.functional as F

from nano_spec_kernels.common import apply_rope_ref, conv_silu_ref, mamba_dt_ref, split_xbc, ssm_step_ref


def mamba_rows(model, m, u, conv, ssm):
    """K rows u (K, D) through Mamba mixer m from its state conv (C, W-1), ssm (H, P, N) -> (out (K, D), the
    stash: the state after each row, conv (K, C, W-1) and ssm (K, H, P, N))."""
    cfg, K, W1 = model.cfg, u.shape[0], conv.shape[1]
    z, xBC, dt = m.split(u)  # (K, d_in), (K, C), (K, H)
    window = torch.cat([conv, xBC.t()], dim=1)  # (C, W-1+K): the W-1 older inputs, then the K new
    x, B_g, C_g = split_xbc(conv_silu_ref(window, m.conv1d.weight[:, 0], m.conv1d.bias), cfg.mamba_n_heads,
                        cfg.mamba_d_head, cfg.mamba_n_groups)
    dt, A = mamba_dt_ref(dt, m.dt_bias, cfg.time_step_limit), -torch.exp(m.A_log.float())
    ys, ssms = [], []
    for j in range(K):  # the recurrence: row j's state is row j-1's, advanced by one token
        ssm, y = ssm_step_ref(ssm, x[j], B_g[j], C_g[j], dt[j], A, m.D)
        ys.append(y), ssms.append(ssm)
    y = torch.stack(ys).to(u.dtype).flatten(1)  # (K, d_in)
    out = m.out_proj(model.ops.gated_rmsnorm(y, z, m.norm.weight, cfg.d_inner // cfg.mamba_n_groups,
                                             cfg.rms_norm_eps))
    return out, (torch.stack([window[:, j + 1 : j + 1 + W1] for j in range(K)]), torch.stack(ssms))


def attention_rows(model, attn, y, k_cache, v_cache, pos: int):
    """K rows y (K, D) at positions pos..pos+K-1: their K/V into rows pos.. of k_cache, v_cache (L, Hkv, Dh), then
    row j attends to cache rows 0..pos+j -> (K, D)."""
    q, k, v = attn.qkv(y)  # (K, Hq, Dh), (K, Hkv, Dh), (K, Hkv, Dh)
    p = torch.arange(pos, pos + y.shape[0])
    k_cache[p], v_cache[p] = apply_rope_ref(k, p, model.cfg.rope), v
    q, n = apply_rope_ref(q, p, model.cfg.rope), pos + y.shape[0]
    visible = torch.arange(n)[None, :] <= p[:, None]  # (K, n)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k_cache[:n].transpose(0, 1), v_cache[:n].transpose(0, 1),
                                       attn_mask=visible, scale=model.cfg.attention_multiplier, enable_gqa=True)
    return attn.o_proj(o.transpose(0, 1).flatten(1))


def norm(model, x, w):
    return model.ops.rmsnorm(x, w.weight, model.cfg.rms_norm_eps)[0]


def target_rows(model, ids, pos: int, state: dict, kv: dict):
    """The target over rows ids (K,) at positions pos.. -> (final-normed hidden (K, D), the Mamba stashes by layer).
    Attention layers write their K/V rows; Mamba states are left for the commit to set."""
    rm, h, stash = model.cfg.residual_multiplier, model.embed(ids), {}
    for i, layer in enumerate(model.model.layers):
        y = norm(model, h, layer.input_layernorm)
        if layer.kind == "mamba":
            out, stash[i] = mamba_rows(model, layer.mamba, y, *state[i])
        else:
            out = attention_rows(model, layer.self_attn, y, *kv[i], pos)
        h = h + rm * out
        h = h + rm * layer.shared_mlp(norm(model, h, layer.post_attention_layernorm))
    return norm(model, h, model.model.norm), stash


def mtp_rows(model, next_ids, h, pos: int, kv: tuple):
    """The MTP head over rows at positions pos..: next_ids (R,) the token after each, h (R, D) the hidden rows it
    reads -> o (R, D), the head's output before its norm."""
    mtp, rm = model.mtp, model.cfg.residual_multiplier
    m = mtp.eh_proj(torch.cat([norm(model, model.model.embed_tokens(next_ids), mtp.enorm), norm(model, h, mtp.hnorm)],
                              dim=-1))
    m = m + rm * attention_rows(model, mtp.layer.self_attn, norm(model, m, mtp.layer.input_layernorm), *kv, pos)
    return m + rm * mtp.layer.shared_mlp(norm(model, m, mtp.layer.post_attention_layernorm))


@torch.no_grad()
def hybrid_generate(model, prompt: list, max_new_tokens: int, gamma: int = 3, eos_ids=()) -> tuple:
    """-> (generated tokens, origin of each), as reference.speculative_generate(..., "mtp") greedy."""
    cfg, p = model.cfg, next(model.parameters())
    L, zeros = len(prompt) + max_new_tokens + gamma + 1, lambda *s: torch.zeros(*s, dtype=p.dtype)  # noqa: E731
    state = {i: (zeros(cfg.conv_dim, cfg.mamba_d_conv - 1),
                 torch.zeros(cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state)) for i in cfg.mamba_layers}
    kv = {i: (zeros(L, cfg.num_key_value_heads, cfg.head_dim), zeros(L, cfg.num_key_value_heads, cfg.head_dim))
          for i in cfg.attention_layers + ["mtp"]}
    tokens, out, origins = list(prompt), [], []

    def commit(stash, row):  # every Mamba layer's state: the one after `row`
        for i, (conv, ssm) in stash.items():
            state[i] = (conv[row], ssm[row])

    def emit(token, origin) -> bool:  # True when the sequence is finished
        tokens.append(token), out.append(token), origins.append(origin)
        return token in eos_ids or len(out) >= max_new_tokens

    # prefill: the prompt's rows, the first token, and the MTP head's catch-up over the prompt
    hidden, stash = target_rows(model, torch.tensor(prompt), 0, state, kv)
    commit(stash, -1)
    if emit(int(model.logits(hidden[-1]).argmax()), "prefill"):
        return out, origins
    head_out = mtp_rows(model, torch.tensor(tokens[1:]), hidden, 0, kv["mtp"])[-1]
    while True:
        seq_len, drafts, o = len(tokens) - 1, [], head_out  # seq_len: the tokens whose effect is in the caches
        for i in range(gamma):  # draft 1 from head_out; draft i + 1 from the head's output after draft i
            if i:
                o = mtp_rows(model, torch.tensor(drafts[-1:]), o[None], seq_len + i - 1, kv["mtp"])[0]
            drafts.append(int(model.mtp_logits(o).argmax()))
        hidden, stash = target_rows(model, torch.tensor(tokens[-1:] + drafts), seq_len, state, kv)  # the verify
        v = model.logits(hidden).argmax(-1).tolist()  # (K,) the target's pick after each row
        na = next((j for j, d in enumerate(drafts) if d != v[j]), gamma)
        commit(stash, na)
        emitted = drafts[:na] + [v[na]]
        head_out = mtp_rows(model, torch.tensor(emitted), hidden[: na + 1], seq_len, kv["mtp"])[na]  # catch-up
        for j, t in enumerate(emitted):
            if emit(t, "draft" if j < na else "bonus" if na == gamma else "correction"):
                return out, origins
