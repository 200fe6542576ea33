"""num_drafts="auto": the planner's arithmetic, and output that does not depend on the γ it picks."""
import itertools

import pytest

from nano_spec import LLM, SamplingParams
from nano_spec.engine.planner import MARGIN, PROBE, STALE, DraftPlanner, block_budgets
from tests.helpers import tiny_checkpoint

PROMPTS = ["def add(a, b):\n    return", "import os\nimport", "class Stack:\n", "x = [1, 2, 3]\nfor", "# sum\n"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("planner") / "tiny", seed=7)


class ScriptedPlanner(DraftPlanner):
    """Chooses γ from a fixed cycle, so every switch happens: between steps, mid-batch, at admission."""

    def __init__(self, max_drafts, script):
        super().__init__(max_drafts)
        self.script = itertools.cycle(script)

    def choose(self, B):
        return next(self.script)


def generate(ckpt, num_drafts, proposer, script=None, max_batch=2, params=None):
    llm = LLM(ckpt, proposer=proposer, num_drafts=num_drafts, max_batch=max_batch)
    if script is not None:
        llm.scheduler.planner = llm.planner = ScriptedPlanner(llm.drafter.max_drafts, script)
    params = params or SamplingParams(max_new_tokens=20, ignore_eos=True)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
@pytest.mark.parametrize("script", [(3, 0, 1, 4, 2), (0, 0, 4), (4,)], ids=["cycle", "mostly-plain", "max"])
def test_switching_gamma_is_lossless(ckpt, proposer, script):
    _, plain = generate(ckpt, 0, "none")
    llm, spec = generate(ckpt, "auto", proposer, script)
    assert spec == plain
    steps = llm.stats["gamma_hist"]  # engine steps by the γ they verified
    assert set(steps) == set(script) and sum(steps.values()) <= llm.stats["verify_steps"]


def test_auto_is_lossless_and_reports(ckpt):
    _, plain = generate(ckpt, 0, "none", max_batch=3)
    llm, auto = generate(ckpt, "auto", "mtp", max_batch=3)
    assert auto == plain
    st = llm.stats
    assert 0 < sum(st["gamma_hist"].values()) <= st["verify_steps"]  # engine steps <= (sequence, step) pairs
    assert set(st["gamma_hist"]) <= set(range(5)) and st["predicted_speedup"] > 0
    assert len(st["accept_cond"]) == 4


def brute_force_best(accept, cost, max_drafts):
    def e(g):
        return 1 + sum(_prod(accept[:i + 1]) for i in range(g))
    return max(range(max_drafts + 1), key=lambda g: e(g) / cost(g))


def _prod(xs):
    out = 1.0
    for x in xs:
        out *= x
    return out


def feed(planner, B, cost, accept, steps, gamma_of=lambda i: i % 5, seed=0):
    """Observe `steps` steps whose seconds follow cost(γ) exactly and whose acceptance is Bernoulli."""
    import random
    rng = random.Random(seed)
    for i in range(steps):
        g = gamma_of(i)
        results = []
        for _ in range(B):
            na = 0
            while na < g and rng.random() < accept[na]:
                na += 1
            results.append((na, g))
        planner.observe_step(B, g, cost(g), 0.0, results)


@pytest.mark.parametrize("accept, slope", [((0.9, 0.85, 0.8, 0.8), 0.15), ((0.8, 0.6, 0.5, 0.4), 0.4),
                                           ((0.3, 0.2, 0.1, 0.1), 0.5), ((0.95, 0.9, 0.9, 0.9), 0.02)],
                         ids=["strong-cheap", "cpu-like", "weak", "gpu-like"])
def test_choice_is_the_argmax_of_tokens_per_second(accept, slope):
    cost = lambda g: 0.02 * (1 + slope * g) + (0.004 if g else 0.0)  # noqa: E731 (drafting has a fixed part)
    p = DraftPlanner(4, keep_accept=0.999)
    feed(p, 4, cost, accept, 2000)
    for a, want, trials in zip(p.accept(), accept, p.trials):
        if trials > 100:  # rarely reached positions still lean on the prior
            assert a == pytest.approx(want, abs=0.05)
    assert p.step_cost(4, 0) == pytest.approx(cost(0), rel=1e-6)
    for g in range(1, 5):
        assert p.step_cost(4, g) == pytest.approx(cost(g), rel=1e-6)
    choices = [p.choose(4) for _ in range(PROBE)]
    assert choices.count(brute_force_best(accept, cost, 4)) >= PROBE - 1  # all but the probe


def run(planner, B, cost, accept, steps, seed=0):
    """`steps` steps as the engine takes them: the planner chooses γ, then observes that step (feed's costs and
    acceptance) -> the γ it chose, step by step."""
    picks = []
    for i in range(steps):
        g = planner.choose(B)
        feed(planner, B, cost, accept, 1, gamma_of=lambda _: g, seed=seed * steps + i)
        picks.append(g)
    return picks


def strong_at_b4():
    """A planner that has seen 300 steps at B = 4 where drafts pass at 0.95 and a step costs 1 + 0.3 γ (γ = 4
    wins), and that cost."""
    p = DraftPlanner(4, keep_accept=0.99)
    cost = lambda g: 1.0 + 0.3 * g  # noqa: E731
    feed(p, 4, cost, (0.95,) * 4, 300)
    return p, cost


def test_a_close_neighbour_is_probed_at_its_turns_a_far_one_when_stale():
    """γ = 4 wins; γ = 3 is 5 % behind (probed at each of its turns, every 3 PROBE steps), γ = 0 half (only once
    STALE steps have passed since it ran)."""
    p, cost = strong_at_b4()
    s = p.speedups(4)
    assert s[3] > (1 - MARGIN) * s[4] > s[0]
    n = 960  # several STALE windows
    picks = run(p, 4, cost, (0.95,) * 4, n)
    assert picks.count(3) >= n // (3 * PROBE) - 1
    assert 1 <= picks.count(0) <= n // STALE + 1
    assert picks.count(4) == n - picks.count(3) - picks.count(0)


def test_a_new_batch_size_class_probes_at_once():
    """Costs are kept by batch-size class: γ = 0, measured in the last five steps at B = 4, is unmeasured at
    B = 8 and runs at its first turn there although the priors put it far behind."""
    p, cost = strong_at_b4()
    s = p.speedups(8)
    assert s[0] < (1 - MARGIN) * max(s)
    assert 0 in run(p, 8, cost, (0.95,) * 4, 3 * PROBE)


def test_decay_follows_a_change():
    p, cost = strong_at_b4()
    assert p.choose(4) == 4
    feed(p, 4, cost, (0.05,) * 4, 300, seed=1)  # the proposer stops being right
    assert [p.choose(4) for _ in range(PROBE)].count(0) >= PROBE - 1  # all but the probe


def test_a_block_drafter_that_wins_by_a_margin_probes_rarely():
    """The shipped block drafter's shape (budgets 0, 1, 3; its acceptance by position; one forward whatever γ):
    γ = 3 leads γ = 1 by 18 % and γ = 0 by 40 %, so they run only when stale: about 2 steps in STALE, where a
    probe at every turn took 2 in 3 PROBE (11 %)."""
    cost = lambda g: 1.0 + 0.15 * g + (0.2 if g else 0.0)  # noqa: E731
    accept = (0.86, 0.65, 0.63)
    p = DraftPlanner(3, keep_accept=0.999, budgets=block_budgets(3))
    feed(p, 1, cost, accept, 300, gamma_of=lambda i: (0, 1, 3)[i % 3])
    s = p.speedups(1)
    assert max(s[0], s[1]) < (1 - MARGIN) * s[3]
    n = 960  # several STALE windows
    picks = run(p, 1, cost, accept, n)
    assert picks.count(3) >= n - 2 * (n // STALE + 1)
    assert picks.count(1) >= 1 and picks.count(0) >= 1  # still measured now and then


@pytest.mark.parametrize("max_drafts, want", [(1, [0, 1]), (3, [0, 1, 3]), (5, [0, 1, 3, 5]), (7, [0, 1, 3, 7]),
                                              (8, [0, 1, 3, 7, 8]), (15, [0, 1, 3, 7, 15])])
def test_block_budgets_double_the_verify_rows(max_drafts, want):
    assert block_budgets(max_drafts) == want


@pytest.mark.parametrize("accept", [(0.9, 0.8, 0.8, 0.7, 0.7, 0.6, 0.6), (0.6, 0.3, 0.3, 0.2, 0.2, 0.1, 0.1),
                                    (0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1)], ids=["strong", "middling", "weak"])
def test_a_block_drafters_planner_picks_the_best_of_its_budgets(accept):
    """A block drafter's cost: one forward whatever γ, plus verify rows. Its planner picks only among 0, 1, 3, 7,
    and there the argmax of tokens per second, probes aside."""
    cost = lambda g: 0.02 * (1 + 0.1 * g) + (0.01 if g else 0.0)  # noqa: E731
    p = DraftPlanner(7, keep_accept=0.999, budgets=block_budgets(7))
    feed(p, 1, cost, accept, 2000, gamma_of=lambda i: (0, 1, 3, 7)[i % 4])
    picks = [p.choose(1) for _ in range(10 * PROBE)]
    assert set(picks) <= {0, 1, 3, 7}

    def e(g):
        return 1 + sum(_prod(accept[:i + 1]) for i in range(g))
    best = max((0, 1, 3, 7), key=lambda g: e(g) / cost(g))
    assert picks.count(best) >= len(picks) - len(picks) // PROBE  # all but the probes


def test_budgets_are_checked():
    for bad in ([1, 2], [0, 3, 2, 4], [0, 1, 3]):
        with pytest.raises(ValueError, match="budgets:"):
            DraftPlanner(4, budgets=bad)


def test_dflash_auto_verifies_only_its_budgets():
    """The shipped checkpoint's block drafter under auto: every step's γ is one of its budgets, output unchanged."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    llm = LLM(proposer="dflash", num_drafts="auto", max_batch=2)
    assert llm.planner.budgets == block_budgets(llm.config.dflash.block_size - 1)
    out = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert out == [o.token_ids for o in LLM(proposer="none", max_batch=2).generate(PROMPTS, params)]
    assert set(llm.stats["gamma_hist"]) <= set(llm.planner.budgets)


def test_a_stall_does_not_poison_the_cost():
    p = DraftPlanner(4)
    feed(p, 1, lambda g: 1.0 + 0.3 * g, (0.8,) * 4, 50)
    before = p.step_cost(1, 2)
    p.observe_step(1, 2, 1000.0, 0.0, [(2, 2)])  # the machine stalled for a second
    assert p.step_cost(1, 2) < 1.5 * before


def test_expected_tokens_is_one_plus_the_sum_of_products():
    p = DraftPlanner(3)
    p.trials, p.hits = [10.0, 10.0, 10.0], [8.0, 5.0, 2.0]
    assert p.expected_tokens(0) == 1
    assert p.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.2)


def test_threads_rule_and_override(ckpt):
    import torch

    from nano_spec.engine.threads import SPLIT_WORK, TORCH_THREADS, default_threads

    llm = LLM(ckpt, max_batch=1)
    n = sum(p.numel() for p in llm.model.parameters())
    assert torch.get_num_threads() == 1  # a tiny model at batch 1: splitting its ops only costs
    assert default_threads(llm.model, int(SPLIT_WORK // n) + 1, torch.device("cpu")) == TORCH_THREADS
    assert default_threads(llm.model, 1, torch.device("cuda")) == TORCH_THREADS
    before = torch.get_num_threads()
    try:
        LLM(ckpt, max_batch=1, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def drafts_by_position(llm, prompts, params):
    """{(seq_id, tokens generated before the step): the drafts that step verified}."""
    seen, generated = {}, {}

    def on_step(report):
        for seq_id, _ in report.admitted:
            generated[seq_id] = 1
        for row in report.rows:
            seen[(row.seq_id, generated[row.seq_id])] = row.drafts
            generated[row.seq_id] += len(row.emitted)

    llm.on_step = on_step
    llm.generate(prompts, params)
    return seen


def test_drafts_after_plain_steps_are_those_of_a_fixed_gamma(ckpt):
    """Steps with γ = 0 still run the MTP catch-up: the head's KV rows, and so every later draft,
    are those of a run that drafted all along."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fixed = drafts_by_position(LLM(ckpt, proposer="mtp", num_drafts=4, max_batch=2), PROMPTS, params)
    llm = LLM(ckpt, proposer="mtp", num_drafts="auto", max_batch=2)
    llm.scheduler.planner = llm.planner = ScriptedPlanner(4, (0, 0, 4, 0, 2, 4))
    auto = drafts_by_position(llm, PROMPTS, params)
    shared = [k for k in auto if k in fixed and auto[k]]
    assert len(shared) >= 10
    for k in shared:
        assert auto[k] == fixed[k][: len(auto[k])], k


def test_a_seeded_sampled_request_is_reproducible_under_auto(ckpt):
    """Its draws follow γ, and auto's γ follows measured times: a step that carries a seeded sampled request
    runs at γ_max, so the request gives what a fixed γ_max gives, whatever the planner would pick."""
    seeded = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9, seed=3)
    _, fixed = generate(ckpt, 4, "mtp", params=seeded)
    llm, auto = generate(ckpt, "auto", "mtp", script=(0, 2, 1, 4, 3), params=seeded)
    assert auto == fixed and set(llm.stats["gamma_hist"]) == {4}
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True, seed=3)  # a seed changes nothing greedy
    llm, _ = generate(ckpt, "auto", "mtp", script=(0, 2), params=greedy)
    assert set(llm.stats["gamma_hist"]) == {0, 2}
