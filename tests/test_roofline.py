"""The roofline's bytes (tests/bench/roofline.py, `<op>_bytes` beside each kernel, which the kernel bench uses too)
against the tensors the launchers move, and `python -m nano_spec_kernels.bench --predict`.

Each formula is compared, entry by entry, with the nbytes of the tensors (or the parts of them) its launcher's
launches load or store at a small shape; and every tensor a plan hands its kernels must be one of those, so a
launcher that starts moving another tensor fails here until its formula counts it. Plans launch nothing.
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import roofline
from bench.roofline import models
from nano_spec.engine.capacity import weight_bytes
from nano_spec_kernels import (attention_prefill, attention_verify, commit_state, gated_rmsnorm, gather_rows,
                               mamba_scan, mamba_verify, rmsnorm, verdict_greedy, verdict_sample)

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
PLAN = dict(cuda=True, n_sm=132)


def nb(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check(formula: dict, want: dict, launches, *tensors):
    assert formula == want
    moved = {t.untyped_storage().data_ptr() for launch in launches for t in launch.args if isinstance(t, torch.Tensor)}
    assert moved <= {t.untyped_storage().data_ptr() for t in tensors}, "a launch moves a tensor the formula omits"


def test_mamba_verify_bytes():
    B, K, H, P, N, G, W, S = 2, 3, 4, 8, 16, 2, 4, 5
    C = H * P + 2 * G * N
    xBC, dt = torch.zeros(B, K, C, dtype=BF16), torch.zeros(B, K, H, dtype=BF16)
    conv_state, ssm_state = torch.zeros(S, C, W - 1, dtype=BF16), torch.zeros(S, H, P, N)
    conv_w, conv_b = torch.zeros(C, W, dtype=BF16), torch.zeros(C, dtype=BF16)
    dt_bias, A_log, D = (torch.zeros(H, dtype=BF16) for _ in range(3))
    ssm_stash, conv_stash = torch.zeros(B, K, H, P, N), torch.zeros(B, C, W - 1 + K, dtype=BF16)
    slots = torch.tensor([3, 1])
    launches, y = mamba_verify.mamba_verify_plan(xBC, dt, conv_state, ssm_state, slots, conv_w, conv_b, dt_bias, A_log,
                                                 D, ssm_stash, conv_stash, G, **PLAN)
    want = {"xBC": nb(xBC), "dt": nb(dt), "conv_state read": nb(conv_state[slots]),
            "ssm_state read": nb(ssm_state[slots]), "weights": nb(conv_w, conv_b, dt_bias, A_log, D),
            "slot_ids": 2 * nb(slots), "ssm_stash": nb(ssm_stash),
            "ssm_state written": nb(ssm_state[slots]), "conv_stash": nb(conv_stash), "y": nb(y),
            "conv_stash read": nb(conv_stash[..., K:]), "conv_state written": nb(conv_state[slots])}
    check(mamba_verify.mamba_verify_bytes(B, K, H, P, N, G, W, 2), want, launches, xBC, dt, conv_state, ssm_state,
          conv_w, conv_b, dt_bias, A_log, D, ssm_stash, conv_stash, slots, y)


def test_attention_verify_bytes():
    B, K, Hq, Hkv, Dh, S, L, ctx = 2, 3, 4, 2, 16, 3, 200, 100
    q, k, v = torch.zeros(B, K, Hq, Dh, dtype=BF16), torch.zeros(B, K, Hkv, Dh, dtype=BF16), torch.zeros(B, K, Hkv, Dh,
                                                                                                         dtype=BF16)
    kc, vc = torch.zeros(S, L, Hkv, Dh, dtype=BF16), torch.zeros(S, L, Hkv, Dh, dtype=BF16)
    slots, lens = torch.tensor([2, 0]), torch.full((B,), ctx)
    for splits, theta in ((1, None), (2, 10000.0)):
        launches, o = attention_verify.attention_verify_plan(q, k, v, kc, vc, slots, lens, 0.1, theta, splits, **PLAN)
        assert launches[0].meta["SPLITS"] == splits
        inv_freq, parts = launches[0].args[11], launches[0].args[8:11] if splits > 1 else ()
        want = {"q": nb(q), "k, v": nb(k, v), "cache rows read": nb(kc[slots, :ctx], vc[slots, :ctx]),
                "slot_ids, seq_lens": nb(slots, lens), "inv_freq": nb(inv_freq) if theta else 0,
                "cache rows written": nb(kc[slots, ctx:ctx + K], vc[slots, ctx:ctx + K]), "o": nb(o)}
        if parts:
            want["partials written"] = want["partials read"] = nb(*parts)
        check(attention_verify.attention_verify_bytes(B, K, Hq, Hkv, Dh, ctx, 2, splits, theta is not None), want,
              launches, q, k, v, kc, vc, slots, lens, o, inv_freq, *parts)


def test_commit_state_bytes():
    L, S, B, K, H, P, N, C, W = 2, 4, 3, 3, 2, 4, 8, 24, 4
    ssm_state, conv_state = torch.zeros(L, S, H, P, N), torch.zeros(L, S, C, W - 1, dtype=BF16)
    ssm_stash, conv_stash = torch.zeros(L, B, K, H, P, N), torch.zeros(L, B, C, W - 1 + K, dtype=BF16)
    slots, na, active = torch.tensor([1, 3, 0]), torch.tensor([0, 2, 1]), torch.ones(B, dtype=torch.bool)
    rows = (active & (na < K - 1)).nonzero()[:, 0]  # the rows that commit
    launches, _ = commit_state.commit_state_plan(ssm_state, conv_state, ssm_stash, conv_stash, slots, na, active,
                                                 **PLAN)
    want = {"slot_ids, na, active": nb(slots, na, active), "ssm_stash read": nb(ssm_stash[:, rows, na[rows]]),
            "ssm_state written": nb(ssm_state[:, slots[rows]]), "conv_stash read": nb(conv_stash[:, rows, :, :W - 1]),
            "conv_state written": nb(conv_state[:, slots[rows]])}
    check(commit_state.commit_state_bytes(L, B, K, H, P, N, C, W, 2, len(rows)), want, launches, ssm_state, conv_state,
          ssm_stash, conv_stash, slots, na, active)


def test_verdict_greedy_bytes():
    B, K, V, splits = 2, 3, 1000, 2
    logits, drafts = torch.zeros(B, K, V, dtype=BF16), torch.zeros(B, K - 1, dtype=torch.long)
    nd = torch.ones(B, dtype=torch.long)
    mask = torch.zeros(B, K, (V + 31) // 32, dtype=torch.int32)
    launches, (picks, na) = verdict_greedy.verdict_greedy_plan(logits, drafts, nd, mask, 128, splits, **PLAN)
    assert launches[0].meta["SPLITS"] == splits
    pm, pa = launches[0].args[2:4]
    want = {"logits": nb(logits), "bitmask": nb(mask), "partials written": nb(pm, pa), "partials read": nb(pm, pa),
            "drafts, nd": nb(drafts, nd), "picks, na": nb(picks, na)}
    check(verdict_greedy.verdict_greedy_bytes(B, K, V, 2, splits, mask=True), want, launches, logits, mask, pm, pa,
          drafts, nd, picks, na)


def test_verdict_sample_bytes():
    B, K, V = 2, 3, 50
    logits, q = torch.randn(B, K, V).to(BF16), torch.full((B, K - 1, V), 1.0 / V)
    drafts, nd, u = torch.zeros(B, K - 1, dtype=torch.long), torch.full((B,), K - 1), torch.rand(B, K)
    temp, top_k, top_p = torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B)
    launches, (na, token) = verdict_sample.verdict_sample_plan(logits, q, drafts, nd, u, temp, top_k, top_p, **PLAN)
    p = launches[0].args[0]
    want = {"logits": nb(logits), "temperature, top_k, top_p": nb(temp, top_k, top_p), "p written": nb(p),
            "p row": nb(p[:, 0]), "q row": nb(q[:, 0]), "p, q at drafts": nb(p[:, :K - 1, 0], q[:, :, 0]),
            "drafts, nd, uniforms": nb(drafts, nd, u), "na, token": nb(na, token)}
    check(verdict_sample.verdict_sample_bytes(B, K, V, 2), want, launches, p, q, drafts, nd, u, na, token)


def test_gather_rows_and_norms_bytes():
    src, idx = torch.zeros(3, 2, 40, dtype=BF16), torch.tensor([1, 0, 1])
    launches, out = gather_rows.gather_rows_plan(src, idx, **PLAN)
    check(gather_rows.gather_rows_bytes(3, 40, 2), {"src rows": nb(src[:, 0]), "idx": nb(idx), "out": nb(out)},
          launches, src, idx, out)

    x, res, w = torch.zeros(3, 5, 64, dtype=BF16), torch.zeros(3, 5, 64, dtype=BF16), torch.zeros(64, dtype=BF16)
    launches, (y, h) = rmsnorm.rmsnorm_plan(x, w, 1e-5, res, 0.5, **PLAN)
    check(rmsnorm.rmsnorm_bytes(15, 64, 2, True), {"x": nb(x), "residual": nb(res), "weight": nb(w), "y": nb(y),
                                                   "h": nb(h)}, launches, x, res, w, y, h)
    launches, (y, _) = rmsnorm.rmsnorm_plan(x, w, 1e-5, **PLAN)
    check(rmsnorm.rmsnorm_bytes(15, 64, 2, False), {"x": nb(x), "residual": 0, "weight": nb(w), "y": nb(y), "h": 0},
          launches, x, w, y)

    yz, gw = torch.zeros(6, 2, 64, dtype=BF16), torch.zeros(64, dtype=BF16)
    launches, out = gated_rmsnorm.gated_rmsnorm_plan(yz[:, 0], yz[:, 1], gw, 32, 1e-5, **PLAN)
    check(gated_rmsnorm.gated_rmsnorm_bytes(6, 64, 2), {"y, z": nb(yz), "weight": nb(gw), "out": nb(out)},
          launches, yz, gw, out)


def test_mamba_scan_bytes():
    T, H, P, N, G, W = 37, 4, 8, 16, 2, 4  # T not a multiple of the chunk
    C = H * P + 2 * G * N
    xBC, dt = torch.zeros(T, C, dtype=BF16), torch.zeros(T, H, dtype=BF16)
    conv_w, conv_b = torch.zeros(C, W, dtype=BF16), torch.zeros(C, dtype=BF16)
    dt_bias, A_log, D = (torch.zeros(H, dtype=BF16) for _ in range(3))
    for method in ("chunked", "recurrent"):
        for bias in (conv_b, None):
            launches, (y, state, window) = mamba_scan.mamba_scan_plan(xBC, dt, conv_w, bias, dt_bias, A_log, D, G, P,
                                                                      method=method, **PLAN)
            assert launches[0].meta["Q"] == (1 if method == "recurrent" else mamba_scan.CHUNK)
            weights = nb(conv_w, dt_bias, A_log, D) + (nb(bias) if bias is not None else 0)
            want = {"xBC": nb(xBC), "dt": nb(dt), "weights": weights, "y": nb(y), "ssm_state written": nb(state),
                    "conv window written": nb(window)}
            check(mamba_scan.mamba_scan_bytes(T, H, P, N, G, W, 2, bias=bias is not None), want, launches, xBC, dt,
                  conv_w, conv_b, dt_bias, A_log, D, y, state, window)


def test_attention_prefill_bytes():
    T, Hq, Hkv, Dh, S, L, slot = 40, 4, 2, 16, 3, 64, 1
    q, k, v = torch.zeros(T, Hq, Dh, dtype=BF16), torch.zeros(T, Hkv, Dh, dtype=BF16), torch.zeros(T, Hkv, Dh,
                                                                                                   dtype=BF16)
    kc, vc = torch.zeros(S, L, Hkv, Dh, dtype=BF16), torch.zeros(S, L, Hkv, Dh, dtype=BF16)
    for theta in (None, 10000.0):
        launches, o = attention_prefill.attention_prefill_plan(q, k, v, kc, vc, slot, 0.1, theta, **PLAN)
        inv_freq = launches[0].args[4]
        rows = nb(kc[slot, :T], vc[slot, :T])  # the slot's first T rows: written by one launch, read by the other
        want = {"q": nb(q), "k, v": nb(k, v), "inv_freq": 2 * nb(inv_freq) if theta else 0,
                "cache rows written": rows, "cache rows read": rows, "o": nb(o)}
        check(attention_prefill.attention_prefill_bytes(T, Hq, Hkv, Dh, 2, theta is not None), want, launches,
              q, k, v, kc, vc, o, inv_freq)


def test_a_verify_step_reads_every_weight_once():
    """Granite 350m (tied embeddings, no MTP head): the linears and lm_head, the norms and the Mamba layers'
    conv and head parameters are every parameter the model has."""
    cfg = models(["350m"])["350m"]
    items = roofline.verify_items(cfg, 1, 1, 16)
    Lm, L, D = len(cfg.mamba_layers), cfg.num_hidden_layers, cfg.hidden_size
    linears = sum(i.calls * i.bytes for i in items if i.kind == "weights")
    norms = (2 * L + 1) * rmsnorm.rmsnorm_bytes(1, D, 2, True)["weight"]
    norms += Lm * gated_rmsnorm.gated_rmsnorm_bytes(1, cfg.d_inner, 2)["weight"]
    conv = Lm * mamba_verify.mamba_verify_bytes(1, 1, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state,
                                                cfg.mamba_n_groups, cfg.mamba_d_conv, 2)["weights"]
    assert linears + norms + conv == weight_bytes(cfg, BF16)


def test_predict_prints_the_roofline_table():
    path = [str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    run = subprocess.run([sys.executable, "-m", "nano_spec_kernels.bench", "--predict", "--model", "350m", "--tau",
                          "3.07"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for line in ("predicted us per call", "mamba_verify", "plain, us", "γ=3, us", "speedup at tau 3.07"):
        assert line in run.stdout, run.stdout
    plain = roofline.summarize(roofline.verify_items(models(["350m"])["350m"], 1, 1, 1024), roofline.TBS)
    assert plain["us"] > roofline.us(plain["weights"], roofline.TBS) > 0  # a step costs at least its weights
