"""One LLM used from several threads at once (a web server's workers): every request of every thread runs in
the same batch, and each stream or generate call gets exactly the tokens it would get alone."""
import threading

import pytest

from helpers import assert_idle, tiny_checkpoint
from nano_spec import LLM, SamplingParams

PROMPTS = ["def f(x):", "x = 1", "import os\n", "class A:", "for i in", "while True:"]
PARAMS = [SamplingParams(max_new_tokens=20, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0.9, seed=7, ignore_eos=True)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("threads") / "tiny", seed=5)


def alone(ckpt, proposer) -> list:
    """The reference: each request on a fresh engine of its own, one at a time (num_drafts fixed: seeded
    sampling is reproducible at a fixed γ)."""
    return [LLM(ckpt, proposer=proposer, num_drafts=3, max_batch=1).generate(p, PARAMS[i % 2])[0].token_ids
            for i, p in enumerate(PROMPTS)]


def in_threads(llm, work) -> list:
    """work(i) in one thread per prompt, all started together; the first step waits until every request is
    queued, so the steps after it must batch requests of several threads."""
    ready, rows_per_step, errors = threading.Barrier(len(PROMPTS)), [], []
    everything_queued = threading.Event()

    def on_step(report):
        rows_per_step.append(len(report.rows))
        everything_queued.wait(timeout=120)

    def run(i):
        try:
            ready.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    llm.on_step = on_step
    results = [None] * len(PROMPTS)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    while llm.scheduler.next_id < len(PROMPTS) and not errors and any(t.is_alive() for t in threads):
        threading.Event().wait(0.01)  # polls a condition; nothing is timed
    everything_queued.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert max(rows_per_step) > 1, rows_per_step  # requests of different threads shared a step
    return results


@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_streams_from_several_threads_each_get_their_own_tokens(ckpt, proposer):
    llm = LLM(ckpt, proposer=proposer, num_drafts=3, max_batch=4)  # fewer slots than threads: some wait

    def read(i):
        stream = llm.stream(PROMPTS[i], PARAMS[i % 2])
        pieces = list(stream)
        assert "".join(pieces) == stream.output.text
        return stream.output.token_ids

    assert in_threads(llm, read) == alone(ckpt, proposer)
    assert_idle(llm)


def test_generate_and_streams_from_several_threads(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=3)

    def mixed(i):
        if i % 3 == 0:
            return llm.generate(PROMPTS[i], PARAMS[i % 2])[0].token_ids
        stream = llm.stream(PROMPTS[i], PARAMS[i % 2])
        "".join(stream)
        return stream.output.token_ids

    assert in_threads(llm, mixed) == alone(ckpt, "mtp")
    assert_idle(llm)


def test_a_stream_closed_by_another_thread_frees_its_slot(ckpt):
    llm = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=1)
    stream = llm.stream("def f(x):", SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(stream)
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join()
    assert_idle(llm)
    assert len(llm.generate("x = 1", SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3
