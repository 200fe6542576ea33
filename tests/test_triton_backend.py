"""The model and the engine on the triton backend (the interpreter on CPU) against the torch backend."""
import pytest
import torch

from helpers import assert_close, mtp_kv, tiny_checkpoint, tiny_model
from nano_spec import LLM, SamplingParams
from nano_spec.model.cache import HybridCache
from nano_spec.model.ops import Ops

pytest.importorskip("triton")


@pytest.mark.parametrize("overrides", [{}, {"position_embedding_type": "rope", "mamba_n_groups": 1}],
                         ids=["nope-g2", "rope-g1"])
@torch.no_grad()
def test_model_triton_equals_torch(overrides, device):
    model = tiny_model(seed=4, **overrides).to(device)
    ids = torch.randint(0, 67, (2, 13), device=device)
    results = []
    for backend in ("torch", "triton"):
        model.ops = Ops(backend)
        cache = HybridCache(model.cfg, 4, 32, 4, device=device)
        hidden = [model.prefill(ids[b, :9], slot, cache) for b, slot in enumerate([3, 1])]
        slots, lens = torch.tensor([3, 1], device=device), torch.tensor([9, 9], device=device)
        lg = model.verify(ids[:, 9:13], slots, lens, cache, kv_len=16)
        kv = mtp_kv(model.cfg, 4, 32, device)
        o = model.mtp_forward(ids[:, 9:13], cache.hidden_stash(2, 4), slots, lens, *kv)
        r = model.mtp_prefill(ids[0, 1:10], hidden[0], 3, *kv)
        a = model.mtp_attention(ids[:, 9:13], cache.hidden_stash(2, 4), slots, lens, *kv)
        results.append(dict(forward=model(ids), prefill=model.logits(hidden[1]), verify=lg, mtp_forward=o,
                            mtp_prefill=r, mtp_attention=a, mtp_mlp=model.mtp_mlp(a), mtp_k=kv[0],
                            ssm=cache.ssm_state, conv=cache.conv_state, k=cache.k))
    for name in results[0]:
        assert_close(f"triton vs torch: {name}", results[0][name], results[1][name])


def test_engine_lossless_on_triton(tmp_path, device):
    ckpt = tiny_checkpoint(tmp_path / "tiny", seed=6)
    prompts = ["def f(x):", "for i in range(3):\n", "h"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = LLM(ckpt, backend="torch", device=device, proposer="none", max_batch=2).generate(prompts, params)
    spec = LLM(ckpt, backend="triton", device=device, proposer="mtp", num_drafts=3, max_batch=2).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_constrained_engine_lossless_on_triton(tmp_path, device):
    """The grammar bitmask through the Triton greedy verdict: same tokens as plain constrained decoding on torch."""
    ckpt = tiny_checkpoint(tmp_path / "tiny", seed=6)
    prompts = ["def f(x):", "h"]
    params = [SamplingParams(max_new_tokens=8, regex="(def|class) [a-z_]{1,4}"),
              SamplingParams(max_new_tokens=4, ignore_eos=True)]
    plain = LLM(ckpt, backend="torch", device=device, proposer="none", max_batch=2).generate(prompts, params)
    spec = LLM(ckpt, backend="triton", device=device, proposer="mtp", num_drafts=3, max_batch=2)
    spec = spec.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert plain[0].finish_reason == "stop" and plain[0].text.startswith(("def ", "class "))
