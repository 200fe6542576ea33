"""Edge inputs to the engine, the API, grammars, configs and the tokenizer: each is refused up front with one
line naming the field, or handled as the docs say; never a late failure, a traceback or a false "stop"."""
import json
import re

import pytest

from helpers import assert_idle, tiny_checkpoint
from nano_spec import LLM, SamplingParams
from nano_spec.text import grammar as grammar_module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("edge") / "tiny", seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2)


def refused(llm, params: SamplingParams, field: str) -> str:
    """The one-line ValueError of a request with these params, queued beside a good one; nothing runs."""
    with pytest.raises(ValueError) as e:
        llm.generate(["x = 1", "h"], [SamplingParams(max_new_tokens=4), params])
    message = str(e.value)
    assert message.startswith(f"SamplingParams.{field}: ") and "\n" not in message, message
    assert_idle(llm)
    return message


# ---- 1. constraints no text satisfies ---------------------------------------------------------------------
UNSATISFIABLE = [  # found where the text the grammar forces from the start ends
    (dict(regex="[a&&b]"), "regex", "unsatisfiable"),                       # an empty character class
    (dict(regex="x[a&&b]|[c&&d]y"), "regex", "unsatisfiable"),              # every branch empty
    (dict(regex="a\\"), "regex", "lone backslash"),                        # would match "a"
    (dict(regex="ab\\\\\\"), "regex", "lone backslash"),                   # an escaped backslash, then a lone one
    (dict(grammar='start: "x" Y\nY: /[a&&b]/'), "grammar", "unsatisfiable"),
    (dict(grammar='start: A B\nA: "x"\nB: /[a&&b]/'), "grammar", "unsatisfiable"),
    (dict(grammar='start: "x" /[a&&b]/ "y"'), "grammar", "unsatisfiable"),
    (dict(grammar='start: a\na: "x" a'), "grammar", "Too many items"),      # never ends
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
    """A grammar that walks into a dead end at run time (the construction probe, which would refuse this one, is
    off): EOS is what llguidance allows there, and the output it rejects must end as an error with one line,
    never as "stop"."""
    monkeypatch.setattr(grammar_module.Grammars, "_probe", lambda *args: None)
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=2)
    outs = llm.generate(["h", "x = 1"], [SamplingParams(max_new_tokens=8, grammar='start: "x" Y\nY: /[a&&b]/'),
                                         SamplingParams(max_new_tokens=8, regex="[0-9]{3}")])
    assert outs[0].finish_reason == "error" and outs[0].text == "x", (outs[0].finish_reason, outs[0].text)
    assert outs[0].error.startswith("grammar: dead end") and "\n" not in outs[0].error, outs[0].error
    assert outs[1].finish_reason == "stop" and re.fullmatch("[0-9]{3}", outs[1].text)  # the other is unharmed
    assert_idle(llm)


# ---- 2. settings that passed validation, then failed after a token -----------------------------------------
@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30, -1, True, 2.0])
def test_top_k_is_bounded_at_construction(top_k):
    with pytest.raises(ValueError, match=r"^SamplingParams\.top_k: must be an integer in \[0, 2\*\*31 - 1\], got "):
        SamplingParams(top_k=top_k)


def test_top_k_at_its_bound_runs(llm):
    out = llm.generate("h", SamplingParams(max_new_tokens=4, top_k=2**31 - 1, temperature=1.0, seed=1))[0]
    assert out.finish_reason in ("stop", "length") and out.error is None and len(out.token_ids) >= 1


TOO_LARGE = [  # forced runs longer than llguidance follows: refused up front instead of failing after a token
    (dict(regex="x{4294967295}"), "regex", "too many expressions"),
    (dict(regex="(x{1000}){1000}"), "regex", "refused (llguidance: "),  # nested
    (dict(grammar="start: /x{4294967295}/"), "grammar", "refused (llguidance: "),
    (dict(grammar='start: "x"{100000}'), "grammar", "refused (llguidance: "),
    (dict(grammar='start: a{200}\na: "x"{200}'), "grammar", "refused (llguidance: "),  # through a rule
    (dict(grammar='start: "x" start'), "grammar", "Too many items"),
    (dict(json_schema={"type": "string", "pattern": "^x{4294967295}$"}), "json_schema", "refused (llguidance: "),
    (dict(json_schema={"type": "string", "pattern": "a\\"}), "json_schema", "lone backslash"),
]


@pytest.mark.parametrize("kw, field, message", TOO_LARGE, ids=[str(c[0]) for c in TOO_LARGE])
def test_oversized_constraints_are_refused(llm, kw, field, message):
    assert message in refused(llm, SamplingParams(**kw), field)


WITHIN_LIMITS = [  # long but followable, and large counts off the forced path
    (dict(regex="x{3}"), lambda t: t == "xxx"),
    (dict(regex="(ab){2}c{0,10000}"), lambda t: re.fullmatch("ababc*", t)),
    (dict(grammar='start: a{3}\na: "ab"'), lambda t: t == "ababab"),
    (dict(grammar='start: "q" | a{100}\na: "x"{100}'), lambda t: t == "q" or t.startswith("x")),  # a short way
    (dict(json_schema={"type": "string", "pattern": "^[0-9]{2}$"}), lambda t: re.fullmatch('"[0-9]{2}"', t)),
]


@pytest.mark.parametrize("kw, check", WITHIN_LIMITS, ids=[str(c[0]) for c in WITHIN_LIMITS])
def test_constraints_within_the_limits_run(llm, kw, check):
    out = llm.generate("h", SamplingParams(max_new_tokens=12, **kw))[0]
    assert out.finish_reason in ("stop", "length") and out.error is None and check(out.text), (out.text, out.error)


def test_llguidance_failures_are_one_line(ckpt, monkeypatch):
    """With the construction probe off, llguidance fails after a token: the request ends with an error of one line
    (no parser state dump), never with "stop", and the other request in the batch is unharmed."""
    monkeypatch.setattr(grammar_module.Grammars, "_probe", lambda *args: None)
    llm = LLM(ckpt, proposer="mtp", num_drafts=2, max_batch=3)
    params = [SamplingParams(max_new_tokens=6, regex="x{4294967295}"),
              SamplingParams(max_new_tokens=6, grammar='start: a{200}\na: "x"{200}'),
              SamplingParams(max_new_tokens=6, ignore_eos=True)]
    outs = llm.generate(["h", "h", "x = 1"], params)
    for o, message in zip(outs, ["too many expressions constructed", "Too many items"]):
        assert o.finish_reason == "error" and o.error.startswith("grammar: ") and message in o.error, o.error
        assert "\n" not in o.error and "<state>" not in o.error, o.error
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 6
    assert_idle(llm)


# ---- 3. JSON whitespace: bounded by default, flexible when the schema asks ---------------------------------
OBJ = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}


def accepts(llm, schema, text: str) -> bool:
    """Whether the schema's constraint takes exactly these tokens (the prefix of a longer text may be fine)."""
    ids = llm.tokenizer.encode(text)
    return llm.grammars.constraint(SamplingParams(json_schema=schema)).valid_prefix(ids) == len(ids)


COMPACT, SPACED, LOOSE, PRETTY = ('{"a":1,"b":true}', '{ "a" : 1 , "b" : true }', '{\n  "a": 1,\n\n\n  "b": true}',
                                  '{"a": 1, "b": true}')


@pytest.mark.parametrize("x_guidance, allowed", [
    (None, {COMPACT}),
    ({"whitespace_flexible": True}, {COMPACT, SPACED, LOOSE, PRETTY}),
    ({"whitespace_pattern": " ?"}, {COMPACT, SPACED, PRETTY}),
    ({"item_separator": ", ", "key_separator": ": "}, {PRETTY}),  # whitespace_flexible stays off
], ids=["default", "flexible", "pattern", "separators"])
def test_json_whitespace_is_compact_unless_the_schema_says(llm, x_guidance, allowed):
    schema = dict(OBJ, **({"x-guidance": x_guidance} if x_guidance else {}))
    for as_text in (False, True):  # a schema given as a JSON string is read the same way
        got = {t for t in (COMPACT, SPACED, LOOSE, PRETTY)
               if accepts(llm, json.dumps(schema) if as_text else schema, t)}
        assert got == allowed, (x_guidance, as_text, got)


def test_json_schema_true_is_any_compact_value(llm):
    for schema in ("true", {}):
        assert accepts(llm, schema, COMPACT) and accepts(llm, schema, "[1,2]") and not accepts(llm, schema, LOOSE)


def test_shipped_model_finishes_json_without_x_guidance():
    """The shipped model under docs/person.schema.json stripped of its x-guidance: with flexible whitespace half
    of these prompts ran to the token limit on newlines; compact, every one finishes with a parsable object."""
    from nano_spec.engine.settings import shipped_weights

    ckpt = shipped_weights()
    schema = json.loads((ckpt.parent.parent / "docs" / "person.schema.json").read_text(encoding="utf-8"))
    assert schema.pop("x-guidance") == {"whitespace_flexible": False}
    prompts = [json.loads(line)["prompt"] for line in (ckpt / "eval_prompts.jsonl").read_text().splitlines()[:8]]
    outs = LLM(ckpt, proposer="mtp", num_drafts=3, max_batch=8, threads=1).generate(
        prompts, SamplingParams(max_new_tokens=96, json_schema=schema))
    assert [o.finish_reason for o in outs] == ["stop"] * 8, [o.text for o in outs]
    for o in outs:
        value = json.loads(o.text)
        assert set(value) == {"name", "age", "languages"} and "\n" not in o.text and " :" not in o.text, o.text


# ---- 4. a real U+FFFD in the text is a finished character --------------------------------------------------
@pytest.mark.parametrize("text", ["x\ufffd", "\ufffd", "ab\ufffd\ufffd", "é\ufffd€", "x\ufffd€", "€✓"])
def test_decoder_passes_a_real_replacement_character_at_once(llm, text):
    """After every token the text is a prefix of the whole (an unfinished character waits, nothing is invented),
    and once the last token is in, all of it, without asking for full_text()."""
    from nano_spec.text.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(llm.tokenizer)
    for token in llm.tokenizer.encode(text):
        decoder.add(token)
        assert text.startswith(decoder.text), (text, decoder.text)
    assert decoder.text == text


def test_stop_string_right_after_a_replacement_character(llm):
    """The output "x\ufffd..." with stop "\ufffd": the stop is seen on the token that completes U+FFFD, not one
    token later, here the last one max_new_tokens allows."""
    n = len(llm.tokenizer.encode("x\ufffd"))
    out = llm.generate("h", SamplingParams(max_new_tokens=n, regex="x\ufffd[a-z]{5}", stop="\ufffd"))[0]
    assert (out.finish_reason, out.text) == ("stop", "x"), (out.finish_reason, out.text)


def test_stream_yields_a_replacement_character_before_the_next_token(llm):
    stream = llm.stream("h", SamplingParams(max_new_tokens=20, regex="x\ufffdyz"))
    seen, pieces = [], []
    for piece in stream:
        pieces.append(piece)
        seen.append("".join(pieces))
    assert seen[-1] == "x\ufffdyz" and "x\ufffd" in seen, pieces


# ---- 9. a prompt that is not valid Unicode ------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["\ud800", "ab\udcffc", "x = 1\n\udfff"], ids=["high", "escaped-byte", "low"])
def test_lone_surrogate_in_a_prompt_is_refused(llm, prompt):
    index = next(i for i, c in enumerate(prompt) if "\ud800" <= c <= "\udfff")
    for call in (lambda: llm.generate(["x = 1", prompt]), lambda: llm.stream(prompt)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"prompt: not valid Unicode: lone surrogate {prompt[index]!r} at index {index}"
        assert_idle(llm)


def test_characters_beyond_the_bmp_are_text(llm):
    out = llm.generate("x = '😀 é ✓'", SamplingParams(max_new_tokens=3))[0]
    assert out.finish_reason in ("stop", "length") and out.prompt == "x = '😀 é ✓'"


# ---- 10. config.json values of the wrong JSON type ----------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "tie_word_embeddings: 'false' is not true or false"),
    ("attention_bias", "true", "attention_bias: 'true' is not true or false"),
    ("mamba_conv_bias", 0, "mamba_conv_bias: 0 is not true or false"),
    ("mamba_proj_bias", None, "mamba_proj_bias: None is not true or false"),
    ("eos_token_id", True, "eos_token_id: True is not a token id"),
    ("eos_token_id", [0, True], "eos_token_id: True is not a token id"),
    ("eos_token_id", False, "eos_token_id: False is not a token id"),
    ("eos_token_id", 1.0, "eos_token_id: 1.0 is not a token id"),
    ("bos_token_id", True, "bos_token_id: True is not a token id"),
    ("pad_token_id", "0", "pad_token_id: '0' is not a token id"),
    ("num_nextn_predict_layers", True, "num_nextn_predict_layers: True is not an integer"),
])
def test_config_values_of_the_wrong_type_name_the_field(field, value, message):
    from helpers import tiny_config
    from nano_spec.model.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(**{field: value})
    assert str(e.value).startswith(message), str(e.value)


def test_config_booleans_and_ids_that_are_fine():
    from helpers import tiny_config

    cfg = tiny_config(tie_word_embeddings=True, attention_bias=False, eos_token_id=[0, 5], bos_token_id=None,
                      pad_token_id=3, num_nextn_predict_layers=0)
    assert cfg.tie_word_embeddings is True and cfg.eos_ids == (0, 5) and cfg.pad_token_id == 3 and not cfg.has_mtp


def test_config_file_with_a_string_boolean_is_refused_by_llm(ckpt, tmp_path):
    """Through the API: "tie_word_embeddings": "false" read as true would tie the head to the embedding."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    config["tie_word_embeddings"] = "false"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^tie_word_embeddings: 'false' is not true or false$"):
        LLM(bad)
