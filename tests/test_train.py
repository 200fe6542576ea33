"""The chunked SSD scan used for training equals the recurrent reference, and the training script runs end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_spec_kernels.mamba_scan import mamba_scan_ref
from nano_spec.ssd import mamba_scan_chunked
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[1]


def scan_inputs(T, H, P, N, G, W=4, seed=0, bias=True):
    """xBC (T, C), dt (T, H) and the layer weights, with A, dt spread so decays matter inside a chunk."""
    g = torch.Generator().manual_seed(seed)
    C = H * P + 2 * G * N
    return dict(xBC=torch.randn(T, C, generator=g), dt=torch.randn(T, H, generator=g),
                conv_weight=torch.randn(C, W, generator=g) / W ** 0.5,
                conv_bias=torch.randn(C, generator=g) if bias else None,
                dt_bias=torch.randn(H, generator=g) - 1, A_log=torch.rand(H, generator=g) * 2.5,
                D=torch.randn(H, generator=g), n_groups=G, head_dim=P)


@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_ssd_equals_recurrent_reference(T, G, dt_limit):
    kw = scan_inputs(T, H=4, P=5, N=7, G=G)
    y_ref, s_ref, w_ref = mamba_scan_ref(**kw, dt_limit=dt_limit)
    for chunk in (16, 64):  # T = 63, 200: a partial last chunk; T = 1: one padded chunk
        y, s, w = mamba_scan_chunked(**kw, dt_limit=dt_limit, chunk_size=chunk)
        assert s.dtype == torch.float32
        assert_close(f"y T={T} G={G} l={chunk}", y_ref, y)
        assert_close(f"ssm state T={T} G={G} l={chunk}", s_ref, s)
        assert_close(f"conv window T={T} G={G} l={chunk}", w_ref, w, atol=0)


def test_ssd_without_conv_bias_and_short_prompt():
    kw = scan_inputs(2, H=2, P=3, N=5, G=1, bias=False)  # T < W-1: the window is zero-padded
    for ref, out in zip(mamba_scan_ref(**kw), mamba_scan_chunked(**kw, chunk_size=8)):
        assert_close("T=2", ref, out)


def test_ssd_gradients_flow():
    kw = scan_inputs(70, H=4, P=5, N=7, G=2)
    names = ("xBC", "dt", "conv_weight", "conv_bias", "dt_bias", "A_log", "D")
    for n in names:
        kw[n] = kw[n].double().requires_grad_()
    y, s, _ = mamba_scan_chunked(**kw, dt_limit=(0.0, float("inf")), chunk_size=16)
    (y.square().sum() + s.square().sum()).backward()
    for n in names:
        assert kw[n].grad is not None and torch.isfinite(kw[n].grad).all() and kw[n].grad.abs().sum() > 0, n
    # and they are the reference's gradients
    ref_kw = {n: (v.detach().clone().requires_grad_() if n in names else v) for n, v in kw.items()}
    y_r, s_r, _ = mamba_scan_ref(**ref_kw)
    (y_r.square().sum() + s_r.square().sum()).backward()
    for n in names:
        assert_close(f"grad {n}", ref_kw[n].grad, kw[n].grad, atol=1e-6)


def test_train_smoke(tmp_path):
    """A tiny run of scripts/train.py writes a checkpoint that loads, with a tokenizer and benchmark prompts."""
    from nano_spec.tokenizer import Tokenizer
    from nano_spec.weights import load_model

    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.json", "eval_prompts.jsonl"):
        assert (out / name).is_file(), name
    model = load_model(out)
    assert model.cfg.has_mtp and model.cfg.eos_ids
    tok = Tokenizer(out, model.cfg)
    log = json.loads((out / "train_log.json").read_text())
    assert log["finished"] and log["steps"] == 5 and log["held_out"]["loss"] > 0
    prompts = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert prompts and all(p["prompt"].endswith("\n") for p in prompts)
    ids = tok.encode(prompts[0]["prompt"])
    assert tok.decode(ids) == prompts[0]["prompt"]  # byte-level BPE round-trips source exactly
    with torch.no_grad():
        logits = model(torch.tensor([ids[:20]]))
    assert logits.shape == (1, min(20, len(ids)), model.cfg.vocab_size) and torch.isfinite(logits).all()
