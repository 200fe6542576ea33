"""Sampled speculative decoding is lossless: the emitted tokens have the target's distribution.

A tiny-vocabulary model (V = 8) makes the exact distribution of the first
generated tokens computable by enumeration; thousands of seeded requests with
MTP or DFlash drafts are compared against it with a chi-square test. A deliberately
broken verdict (accept every draft) must fail the same test.
"""
import itertools
import math

import pytest
import torch

from helpers import tiny_model
from nano_spec_kernels.verdict_sample import sampling_probs_ref
from nano_spec.model import sampling as sampling_mod
from nano_spec.model.dflash import DFlashConfig, DFlashModel
from nano_spec.drafters.base import NoDrafter
from nano_spec.drafters.dflash import DFlashDrafter
from nano_spec.drafters.mtp import MTPDrafter
from nano_spec.engine.runner import ModelRunner, cache_len
from nano_spec.model.sampling import SamplingParams
from nano_spec.model.weights import init_weights
from nano_spec.engine.scheduler import Scheduler

V, N_REQ, PROMPT = 8, 2400, [3, 1, 4, 1, 5]
PARAMS = dict(temperature=1.3, top_k=6, top_p=0.95)


class ByteTok:
    eos_ids = ()

    def decode(self, ids):
        return " ".join(map(str, ids))


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 0.999 (z = 3.09)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, vocab_size=V, eos_token_id=None)


@pytest.fixture(scope="module")
@torch.no_grad()
def joint(model, n: int = 3):
    """P(g_1..g_n) by enumeration over the target's filtered distributions: one batched forward."""
    p = SamplingParams(**PARAMS)
    seqs = list(itertools.product(range(V), repeat=n))
    ids = torch.tensor([PROMPT + list(s[:-1]) for s in seqs])  # (V^n, P + n - 1)
    logits = model(ids)[:, len(PROMPT) - 1 :]  # (V^n, n, V)
    B = len(seqs)
    probs = sampling_probs_ref(logits, torch.full((B,), p.temperature), torch.full((B,), p.top_k),
                               torch.full((B,), p.top_p))
    picked = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0].prod(-1)  # (V^n,)
    return dict(zip(seqs, picked.tolist()))


def sample(model, gamma: int, n_tokens: int, kind: str = "mtp"):
    if kind == "dflash":  # a random drafter: its q differs from the target's p, so the accept rule has work
        drafter = init_weights(DFlashModel(DFlashConfig.for_target(model.cfg, 1, gamma + 2), model.ops), 0.3, 4)
        proposer = DFlashDrafter(drafter, model, gamma, num_slots=64, max_len=cache_len(32, gamma))
    elif gamma:
        proposer = MTPDrafter(model, gamma, num_slots=64, max_len=cache_len(32, gamma))
    else:
        proposer = NoDrafter()
    runner = ModelRunner(model, proposer, num_slots=64, max_seq_len=32)
    sched = Scheduler(runner, ByteTok(), 32)
    seqs = [sched.add(PROMPT, SamplingParams(max_new_tokens=n_tokens, seed=i, **PARAMS)) for i in range(N_REQ)]
    while sched.has_work():
        sched.step()
    return [tuple(s.generated) for s in seqs], sched.tel


def chi2(counts: dict, probs: dict, n: int) -> tuple:
    cells = [k for k in probs if probs[k] * n >= 5]  # pool the rare cells
    stat = sum((counts.get(k, 0) - n * probs[k]) ** 2 / (n * probs[k]) for k in cells)
    rare_p = 1 - sum(probs[k] for k in cells)
    rare_c = n - sum(counts.get(k, 0) for k in cells)
    if rare_p * n >= 5:
        stat += (rare_c - n * rare_p) ** 2 / (n * rare_p)
        cells.append("rare")
    return stat, len(cells) - 1


def marginals(samples, joint):
    """Per position i: observed counts and exact probabilities of g_i."""
    out = []
    for i in range(len(next(iter(joint)))):
        probs, counts = {}, {}
        for seq, p in joint.items():
            probs[seq[i]] = probs.get(seq[i], 0) + p
        for s in samples:
            counts[s[i]] = counts.get(s[i], 0) + 1
        out.append((counts, probs))
    return out


@pytest.mark.parametrize("kind, gamma", [("none", 0), ("mtp", 3), ("dflash", 3)],
                         ids=["plain", "mtp-gamma3", "dflash-gamma3"])
def test_sampled_tokens_follow_the_target(model, joint, kind, gamma):
    samples, tel = sample(model, gamma, 3, kind)
    if gamma:
        assert 0 < tel.accept_at[0] < 1, "drafts are both accepted and rejected"
    pair = {k[:2]: 0.0 for k in joint}
    for k, p in joint.items():
        pair[k[:2]] += p
    pair_counts = {}
    for s in samples:
        pair_counts[s[:2]] = pair_counts.get(s[:2], 0) + 1
    tests = marginals(samples, joint) + [(pair_counts, pair)]
    for i, (counts, probs) in enumerate(tests):
        stat, df = chi2(counts, probs, len(samples))
        assert stat < chi2_critical(df), f"statistic {i}: chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"


def test_the_chi_square_test_catches_a_biased_verdict(model, joint, monkeypatch):
    """Negative control: accepting every draft gives the draft's distribution, which the test must reject."""
    real = sampling_mod.accept_rule

    def accept_all(ops, logits, drafts, nd, sampling, q=None, uniforms=None, bitmask=None):
        na, emitted = real(ops, logits, drafts, nd, sampling, q, uniforms, bitmask)
        K = logits.shape[1]
        na = nd.clone()
        padded = torch.cat([drafts, emitted[:, -1:]], 1)
        return na, torch.where(torch.arange(K) < na[:, None], padded, emitted.gather(1, na[:, None]))

    monkeypatch.setattr("nano_spec.engine.runner.accept_rule", accept_all)
    samples, _ = sample(model, 3, 3)
    worst = max(chi2(c, p, len(samples))[0] / chi2_critical(chi2(c, p, len(samples))[1])
                for c, p in marginals(samples, joint)[1:])
    assert worst > 1, "a biased verdict went undetected"
