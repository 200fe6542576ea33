"""The CPU thread count under threads=None: which count the tuner picks for which machine, driven by simulated
step times (a loaded machine is never timed here: that is the benchmark's job, docs/BENCHMARKS.md, Threads)."""
import itertools

import pytest
import torch

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.engine.threads import ThreadTuner

SHAPES = [(1, 3), (1, 4), (1, 2), (1, 3), (1, 3), (1, 0)]  # (B, γ) as the planner varies γ


def simulate(tuner, cost, steps: int) -> float:
    """Run `steps` steps whose time is cost(threads, shape, i); returns the total simulated seconds."""
    total = 0.0
    for i, shape in zip(range(steps), itertools.cycle(SHAPES)):
        t = cost(tuner.threads(), shape, i)
        tuner.observe(shape, t)
        total += t
    return total


def one_thread(threads, shape, i):
    return 1e-3 * (1 + 0.3 * shape[1])


def loaded(threads, shape, i):  # another process holds the second core: every barrier waits for it
    return one_thread(1, shape, i) * (13 if threads > 1 else 1)


def split_well(threads, shape, i):  # an idle machine and a big batch: two threads are 1.4x faster
    return one_thread(1, shape, i) / (1.4 if threads > 1 else 1)


@pytest.mark.parametrize("steps, least", [(36, 0.7), (1000, 0.9)], ids=["demo-36-steps", "long-1000-steps"])
def test_a_loaded_machine_keeps_most_of_one_threads_speed(steps, least):
    tuner = ThreadTuner(2)
    total = simulate(tuner, loaded, steps)
    alone = sum(one_thread(1, s, i) for i, s in zip(range(steps), itertools.cycle(SHAPES)))
    assert alone / total >= least, (alone / total, tuner.steps)
    assert tuner.threads() == 1


def test_an_idle_machine_with_big_steps_moves_to_every_core():
    tuner = ThreadTuner(2)
    simulate(tuner, split_well, 400)
    assert tuner.threads() == 2 and tuner.steps[2] >= 0.85 * 400, tuner.steps


def test_a_load_that_comes_later_is_left_within_a_segment():
    tuner = ThreadTuner(2)
    simulate(tuner, split_well, 200)
    assert tuner.threads() == 2
    before = dict(tuner.steps)
    simulate(tuner, loaded, 12)  # one slow step probes one thread at once; its win switches
    assert tuner.threads() == 1 and tuner.steps[2] - before[2] <= 2, (before, tuner.steps)


def test_equal_speeds_stay_on_one_thread():
    tuner = ThreadTuner(2)
    simulate(tuner, lambda t, s, i: one_thread(1, s, i) * (1.05 if t > 1 else 1), 500)
    assert tuner.threads() == 1 and tuner.steps[1] >= 0.9 * 500, tuner.steps


def test_fixed_counts_never_move():
    for tuner in (ThreadTuner(4, tune=False), ThreadTuner(1)):
        simulate(tuner, loaded, 100)
        assert set(tuner.steps) == {tuner.threads()}


# ---- the engine: LLM(threads=None) tunes, driven by a clock that reads the thread count --------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tuner") / "tiny", seed=3)


def clock_of(per_call):
    """A clock that advances per read by per_call(torch's thread count): a step's measured time then grows with
    the threads it ran on, as on a machine of that kind."""
    now = [0.0]

    def clock():
        now[0] += per_call(torch.get_num_threads())
        return now[0]
    return clock


@pytest.mark.parametrize("machine, want", [("loaded", 1), ("idle", 2)])
def test_engine_default_threads_follow_the_machine(ckpt, monkeypatch, machine, want):
    monkeypatch.setattr("nano_spec.engine.llm.default_threads", lambda model, max_batch, device: 2)
    per_call = {"loaded": lambda n: 1e-3 * (13 if n > 1 else 1), "idle": lambda n: 1e-3 / (1.4 if n > 1 else 1)}
    before = torch.get_num_threads()
    try:
        llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2, clock=clock_of(per_call[machine]))
        params = SamplingParams(max_new_tokens=150, ignore_eos=True)
        out = llm.generate(["def f(x):", "x = 1"], params)
        steps = llm.stats["threads"]
        assert max(steps, key=steps.get) == want and set(steps) == {1, 2}, steps
        torch.set_num_threads(1)
        assert [o.token_ids for o in out] == \
            [o.token_ids for o in LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2, threads=1).generate(
                ["def f(x):", "x = 1"], params)]
    finally:
        torch.set_num_threads(before)


def test_engine_threads_given_or_too_small_to_split_are_fixed(ckpt):
    before = torch.get_num_threads()
    try:
        assert LLM(ckpt, max_batch=1).threads.threads() == 1 and not LLM(ckpt, max_batch=1).threads.probing
        llm = LLM(ckpt, max_batch=1, threads=2)
        llm.generate("x = 1", SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert llm.stats["threads"] == {2: llm.stats["threads"][2]} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_loaded_machine_benchmark_runs(capsys):
    """scripts/threads_under_load.py, as small as it goes (its timings are the benchmark's, not checked here)."""
    from helpers import load_script

    assert load_script("threads_under_load").main(["--busy", "0", "--rounds", "1", "--prompts", "1",
                                                   "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("default ") == 2 and out.count("1 thread ") == 2 and "outputs differ" not in out
