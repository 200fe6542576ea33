"""The engine at its edges: abandoned streams, a stop string completed by the grammar's last token,
a clock that does not move, and the n-gram index against the plain scan."""
import random

import pytest

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.drafters.ngram import NgramDrafter
from nano_spec.reference import ngram_lookup
from nano_spec.engine.scheduler import Sequence

LONG = SamplingParams(max_new_tokens=200, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("edges") / "tiny", seed=12)


def stepped_ids(llm) -> list:
    """Record the sequence ids of every verify row from now on."""
    ids = []
    llm.on_step = lambda report: ids.extend(row.seq_id for row in report.rows)
    return ids


def test_an_unread_stream_is_never_queued(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    held = [llm.stream("def f(x):", LONG) for _ in range(3)]  # never read
    assert not llm.scheduler.has_work()
    ids = stepped_ids(llm)
    out = llm.generate("x = 1", SHORT)[0]
    assert len(out.token_ids) == 3 and len(set(ids)) == 1  # only its own sequence was stepped
    assert all(s.output is None for s in held)


def test_generate_does_not_run_a_stream_left_after_break(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    stream = llm.stream("def f(x):", LONG)
    next(stream)  # read once, then left while still referenced
    (paused,) = llm.scheduler.running
    ids = stepped_ids(llm)
    llm.generate("x = 1", SHORT)
    assert paused.id not in ids and not paused.finished
    rest = "".join(stream)  # it resumes where it stopped when read again
    assert stream.output.finish_reason == "length" and rest


def test_a_dropped_stream_frees_its_slot(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    stream = llm.stream("def f(x):", LONG)
    next(stream)
    del stream  # freed by reference counting at once: no cycle may keep it alive until a gc pass
    assert not llm.scheduler.has_work() and llm.scheduler.free_slots == [0]
    assert len(llm.generate("x = 1", SHORT)[0].token_ids) == 3


def test_generate_with_every_slot_held_by_paused_streams_still_finishes(ckpt):
    """No slot for its request: the others run until one comes free (slow, but never stuck)."""
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    stream = llm.stream("def f(x):", SamplingParams(max_new_tokens=20, ignore_eos=True))
    next(stream)
    assert len(llm.generate("x = 1", SHORT)[0].token_ids) == 3


def test_stop_string_completed_by_the_grammars_last_token_is_cut(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3)
    out = llm.generate("x", SamplingParams(regex="abc;", stop=[";"], max_new_tokens=20))[0]
    assert (out.text, out.finish_reason) == ("abc", "stop")


@pytest.mark.parametrize("clock", [lambda: 0.0, lambda: 1.0], ids=["zero", "constant"])
def test_a_clock_that_does_not_move(ckpt, clock):
    """Zero-duration steps: the planner's costs floor at a tiny positive time instead of dividing by zero."""
    llm = LLM(ckpt, proposer="mtp", num_drafts="auto", clock=clock)
    want = LLM(ckpt, proposer="none").generate(["def f(x):", "x = 1"], LONG)
    outs = llm.generate(["def f(x):", "x = 1"], LONG)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.stats["predicted_speedup"] is not None


def test_ngram_index_equals_the_plain_scan():
    """The incremental index returns what a scan of the whole sequence returns, as tokens arrive in steps of
    1..5 (a verify's emitted run), for contexts with many repeats."""
    rng = random.Random(0)
    proposer = NgramDrafter(4, "cpu")
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 50])
        seq = Sequence(trial, 5, [rng.randrange(vocab) for _ in range(5)], SamplingParams(), slot=trial % 3)
        proposer.admit(seq, None, None)
        while len(seq.tokens) < 120:
            for gamma in (0, 1, 4):
                assert proposer.lookup(seq, gamma) == ngram_lookup(seq.tokens, gamma), (trial, len(seq.tokens))
            seq.tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]


def test_on_finish_hands_over_each_output_once_as_it_finishes(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=2)
    got, steps = [], []
    llm.on_step = lambda report: steps.append(len(got))
    prompts = ["def f(x):", "x = 1", "h"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 30, 9)]
    outs = llm.generate(prompts, params, on_finish=lambda i, o: got.append((i, o)))
    assert sorted(i for i, _ in got) == [0, 1, 2] and all(o == outs[i] for i, o in got)
    assert got[-1][0] == 1 and steps[0] < 3  # the short ones were handed over before the long one finished
