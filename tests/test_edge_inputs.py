"""Edge inputs to the engine, the API, grammars, configs and the tokenizer: each is refused up front with one
line naming the field, or handled as the docs say; never a late failure, a traceback or a false "stop"."""
import re

import pytest

from helpers import tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec import grammar as grammar_module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("edge") / "tiny", seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2)


def assert_idle(llm):
    sched = llm.scheduler
    assert not sched.has_work() and sorted(sched.free_slots) == list(range(llm.runner.cache.num_slots))


def refused(llm, params: SamplingParams, field: str) -> str:
    """The one-line ValueError of a request with these params, queued beside a good one; nothing runs."""
    with pytest.raises(ValueError) as e:
        llm.generate(["x = 1", "h"], [SamplingParams(max_new_tokens=4), params])
    message = str(e.value)
    assert message.startswith(f"SamplingParams.{field}: ") and "\n" not in message, message
    assert_idle(llm)
    return message


# ---- 1. constraints no text satisfies ---------------------------------------------------------------------
UNSATISFIABLE = [
    (dict(regex="[a&&b]"), "regex", "unsatisfiable"),                       # an empty character class
    (dict(regex="x[a&&b]|[c&&d]y"), "regex", "unsatisfiable"),              # every branch empty
    (dict(regex="a\\"), "regex", "lone backslash"),                        # would match "a"
    (dict(regex="ab\\\\\\"), "regex", "lone backslash"),                   # an escaped backslash, then a lone one
    (dict(grammar='start: "x" Y\nY: /[a&&b]/'), "grammar", "Y, /[a&&b]/ can match no finite text"),
    (dict(grammar='start: "a" | "b" Y\nY: /[a&&b]/'), "grammar", "Y, /[a&&b]/"),  # a dead end after "b"
    (dict(grammar='start: A B\nA: "x"\nB: /[a&&b]/'), "grammar", "B, /[a&&b]/"),
    (dict(grammar='start: "x" /[a&&b]/ "y"'), "grammar", "/[a&&b]/"),
    (dict(grammar='start: a\na: "x" a'), "grammar", "start, a can match no finite text"),  # never ends
]


@pytest.mark.parametrize("kw, field, message", UNSATISFIABLE, ids=[str(c[0]) for c in UNSATISFIABLE])
def test_unsatisfiable_constraints_are_refused(llm, kw, field, message):
    assert message in refused(llm, SamplingParams(**kw), field)


SATISFIABLE = [  # (params, a check of the finished text): edges of the rules above that must still run
    (dict(regex="a\\\\"), lambda t: t == "a\\"),                              # an escaped backslash
    (dict(regex=""), lambda t: t == ""),                                      # only the empty text
    (dict(regex="(x|[a&&b])"), lambda t: t == "x"),                           # one empty branch of two
    (dict(grammar='start: a\na: "x" a | "y"'), lambda t: re.fullmatch("x*y", t)),  # recursion that can end
    (dict(grammar='start: "q" Y?\nY: "z"'), lambda t: t in ("q", "qz")),
    (dict(grammar='start: %json {"type": "integer", "minimum": 1, "maximum": 9}'), lambda t: t in "123456789"),
]


@pytest.mark.parametrize("kw, check", SATISFIABLE, ids=[str(c[0]) for c in SATISFIABLE])
def test_satisfiable_edges_still_run(llm, kw, check):
    out = llm.generate("h", SamplingParams(max_new_tokens=40, **kw))[0]
    assert out.finish_reason == "stop" and check(out.text), (out.text, out.finish_reason, out.error)


def test_dead_end_is_an_error_not_a_stop(ckpt, monkeypatch):
    """A grammar that passes the checks but walks into a dead end at run time: EOS is what llguidance allows
    there, and the output it rejects must end as an error with one line, never as "stop"."""
    monkeypatch.setattr(grammar_module, "lark_dead_parts", lambda *args: [], raising=False)
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2)
    outs = llm.generate(["h", "x = 1"], [SamplingParams(max_new_tokens=8, grammar='start: "x" Y\nY: /[a&&b]/'),
                                         SamplingParams(max_new_tokens=8, regex="[0-9]{3}")])
    assert outs[0].finish_reason == "error" and outs[0].text == "x", (outs[0].finish_reason, outs[0].text)
    assert outs[0].error.startswith("grammar: dead end") and "\n" not in outs[0].error, outs[0].error
    assert outs[1].finish_reason == "stop" and re.fullmatch("[0-9]{3}", outs[1].text)  # the other is unharmed
    assert_idle(llm)
