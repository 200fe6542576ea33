"""scripts/train_mtp.py --unroll: one unrolled training forward equals the engine's recursive drafting."""
import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import mtp_kv, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("train_mtp", ROOT / "scripts" / "train_mtp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def engine_chain(model, ids, h, p, depth):
    """What MTPDrafter computes for a sequence whose last accepted row is p, with drafts forced to the
    true tokens: catch-up rows 0..p, then depth-1 mtp_forward calls at positions p+1.. -> [o_1 .. o_depth] (D,)."""
    kv = mtp_kv(model.cfg, num_slots=2, max_len=64)
    slot = 1
    slots = torch.tensor([slot])
    r = model.mtp_prefill(ids[1:p + 2], h[:p + 1], slot, *kv)  # (p + 1, D): the catch-up's attention half
    o = model.mtp_mlp(r[-1:])  # (1, D): the output at p
    outs = [o[0]]
    for d in range(2, depth + 1):
        pos = torch.tensor([p + d - 1])
        o = model.mtp_forward(ids[p + d].view(1, 1), o[:, None], slots, pos, *kv, kv_len=p + depth + 1)[:, 0]
        outs.append(o[0])
    return outs


@pytest.mark.parametrize("pos_emb", ["nope", "rope"])
def test_unrolled_forward_equals_recursive_drafting(pos_emb):
    torch.manual_seed(0)
    model = tiny_model(seed=5, position_embedding_type=pos_emb)
    script = load_script()
    B, T, depth = 2, 14, 3
    A = T - depth
    ids = torch.randint(1, model.cfg.vocab_size, (B, T + 1))
    with torch.no_grad():
        h = model.hidden(ids[:, :T])
        outs = script.mtp_unroll(model, ids[:, 1:A + depth], h[:, :A], depth)  # [(B, A, D)] * depth
        for b in range(B):
            for p in (0, 1, 5, A - 1):
                ref = engine_chain(model, ids[b], h[b], p, depth)
                for d in range(depth):
                    err = (outs[d][b, p] - ref[d]).abs().max().item()
                    assert err <= 1e-5, f"{pos_emb} b={b} anchor={p} depth={d + 1}: max abs err {err:.2e}"
        # depth 1 is the plain catch-up the head was trained on before: mtp_hidden over the same rows
        assert torch.allclose(outs[0], model.mtp_hidden(ids[:, 1:A + 1], h[:, :A]), atol=1e-5)


def test_a_plain_causal_mask_would_differ():
    """The check above can fail: with attention causal over each depth's own rows, deeper outputs move."""
    model = tiny_model(seed=5)
    script = load_script()
    ids = torch.randint(1, model.cfg.vocab_size, (1, 13))
    with torch.no_grad():
        h = model.hidden(ids[:, :12])
        outs = script.mtp_unroll(model, ids[:, 1:12], h[:, :9], 3)
        causal = model.mtp_hidden(ids[:, 2:11], outs[0])  # depth 2 as a causal pass over the depth-2 rows
        ref = engine_chain(model, ids[0], h[0], 5, 3)
    assert (causal[0, 5] - ref[1]).abs().max().item() > 1e-3
    assert (outs[1][0, 5] - ref[1]).abs().max().item() <= 1e-5


def test_depth_weights():
    script = load_script()
    args = script.parse_args(["--base", "b", "--out", "o"])
    assert args.unroll == 3
    w = script.depth_weights(args)
    assert abs(sum(w) - 1) < 1e-9 and w[0] > w[1] > w[2] and abs(w[1] / w[0] - 0.8) < 1e-9
