"""Chat templates and model ids, with no network.

transformers' apply_chat_template, on a PreTrainedTokenizerFast read from the same checkpoint directory,
is the oracle for rendered prompts and their token ids. Model ids resolve from a cache laid out as
huggingface_hub lays it out, under HF_HUB_OFFLINE=1.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_checkpoint, tiny_model
from nano_spec.engine.llm import LLM
from nano_spec.model.sampling import SamplingParams
from nano_spec.model.weights import save_model

transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|pad|>"]  # ids 0..3

# Granite-style: a default system turn, every turn closed by eos_token, the assistant's turn opened at the end;
# indented {% %} blocks (trim_blocks / lstrip_blocks), a namespace, loop.last and raise_exception
GRANITE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = "You are a helpful assistant. Today's word: naïve." %}
    {%- set turns = messages %}
{%- endif %}
{%- set ns = namespace(users=0) %}
<|start_of_role|>system<|end_of_role|>{{ system }}{{ eos_token }}
{% for message in turns %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles after the system turn must be user or assistant, got ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
<|start_of_role|>{{ message['role'] }}<|end_of_role|>{{ message['content'] }}{{ eos_token }}
    {% if loop.last and add_generation_prompt %}
<|start_of_role|>assistant<|end_of_role|>
    {%- endif %}
{% endfor %}
{%- if ns.users == 0 %}{{ raise_exception('no user turn') }}{% endif %}"""

# transformers' tojson keeps non-ASCII and HTML characters as they are; bos_token is a template variable too
JSON_STYLE = "{{ bos_token }}{{ messages | tojson }}{% if add_generation_prompt %}\n>>> {% endif %}"

CONVERSATIONS = {
    "system": [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    "default-system": [{"role": "user", "content": "def f(x):\n    return x + 1\n"}],
    "multi-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "for i in range(10):"}],
    "empty-content": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": " "}],
    "non-ascii": [{"role": "system", "content": "Réponds en français ✓"},
                  {"role": "user", "content": "héllo wörld ✓ 漢字 🚀 <b>&amp;</b> \"q\" \\ \t"}],
    "special-token-text": [{"role": "user", "content": "a <|end_of_text|> b <|start_of_role|>"}],
}


def train_tokenizer(file):
    """A byte-level BPE tokenizer.json of 300 tokens with Granite's role and end tokens as specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n", "héllo wörld ✓ " * 3] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(file))


def write_tokenizer_config(path, template=None, **tokens):
    """tokenizer_config.json with the special tokens (strings, or AddedToken dicts) and the chat template."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **tokens}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


GRANITE_TOKENS = dict(bos_token="<|end_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>")


def granite_checkpoint(path, seed=0, model=None):
    """A random-weight checkpoint in the instruct layout: config.json (EOS = <|end_of_text|>, id 0),
    model.safetensors, tokenizer.json and tokenizer_config.json with the chat template."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_file = path.parent / f"{path.name}.tokenizer.json"
    train_tokenizer(tok_file)
    save_model(model or tiny_model(seed=seed, vocab_size=300), path, extra_files={"tokenizer.json": tok_file})
    write_tokenizer_config(path, GRANITE, **GRANITE_TOKENS)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return granite_checkpoint(tmp_path_factory.mktemp("chat") / "granite-tiny", seed=4)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, backend="torch", device="cpu", max_batch=4, max_seq_len=256)


def reference(path, conversation):
    """(text, token ids) from transformers' apply_chat_template on the checkpoint's own tokenizer files."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_rendered_prompt_equals_transformers(llm, ckpt, name):
    conv = CONVERSATIONS[name]
    text, ids = reference(ckpt, conv)
    assert text.endswith("<|start_of_role|>assistant<|end_of_role|>")
    out = llm.chat(conv, SamplingParams(max_new_tokens=3))
    assert len(out) == 1 and out[0].prompt == text
    assert llm.tokenizer.encode(out[0].prompt) == ids


@pytest.mark.parametrize("source", ["tokenizer_config", "jinja-file", "both", "named-list"])
def test_template_sources_and_variables_equal_transformers(tmp_path, source):
    """chat_template.jinja, tokenizer_config.json's chat_template (a string or a list of named templates), and
    chat_template.jinja winning over tokenizer_config.json when both are there; tojson and bos_token as in
    transformers; special tokens written as AddedToken dicts."""
    path = tmp_path / "ck"
    path.mkdir()
    train_tokenizer(path / "tokenizer.json")
    tokens = dict(bos_token={"content": "<|start_of_role|>", "__type": "AddedToken", "special": True},
                  eos_token="<|end_of_text|>")
    if source == "named-list":
        write_tokenizer_config(path, [{"name": "tool_use", "template": GRANITE},
                                      {"name": "default", "template": JSON_STYLE}], **tokens)
    else:
        write_tokenizer_config(path, GRANITE if source == "both" else JSON_STYLE, **tokens)
        if source != "tokenizer_config":
            (path / "chat_template.jinja").write_text(JSON_STYLE, encoding="utf-8")
    from nano_spec.text.chat import ChatTemplate, conversation

    template = ChatTemplate(path)
    for conv in CONVERSATIONS.values():
        text, _ = reference(path, conv)
        assert text.startswith("<|start_of_role|>[{")  # the JSON template rendered in every case
        assert template.render(conversation(conv)) == text


def test_a_list_of_conversations_and_streaming(llm, ckpt):
    convs = [CONVERSATIONS["system"], CONVERSATIONS["non-ascii"]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = llm.chat(convs, params)
    assert [o.prompt for o in outs] == [reference(ckpt, c)[0] for c in convs]
    plain = llm.generate([o.prompt for o in outs], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stream = llm.chat_stream(convs[1], params)
    assert "".join(stream) == outs[1].text and stream.output.token_ids == outs[1].token_ids


def test_the_tokenizers_eos_ends_the_reply(tmp_path):
    """config.json lists no EOS; tokenizer_config.json's eos_token, a token of tokenizer.json, ends the reply.
    The model is made to emit <|end_of_text|> (id 0) at a known step: the rows of lm_head for id 0 and for the
    token it picks there are swapped, which changes no earlier greedy pick."""
    conv = CONVERSATIONS["system"]
    params = SamplingParams(max_new_tokens=12)
    model = tiny_model(seed=5, vocab_size=300, eos_token_id=None, num_nextn_predict_layers=0)
    kw = dict(backend="torch", device="cpu", max_batch=1, max_seq_len=128, proposer="none")
    free = LLM(granite_checkpoint(tmp_path / "free", model=model), **kw).chat(conv, params)[0]
    assert free.finish_reason == "length"
    k = next(i for i in range(1, len(free.token_ids))
             if free.token_ids[i] not in free.token_ids[:i] + [0])  # a new token, not already the end token
    assert 0 not in free.token_ids[:k]
    with torch.no_grad():
        head = model.lm_head.weight
        head[[0, free.token_ids[k]]] = head[[free.token_ids[k], 0]]
    ended = LLM(granite_checkpoint(tmp_path / "ended", model=model), **kw)
    assert ended.tokenizer.eos_ids == (0,)
    out = ended.chat(conv, params)[0]
    assert out.token_ids == free.token_ids[:k] + [0] and out.finish_reason == "stop"
    assert out.text == ended.tokenizer.decode(free.token_ids[:k])  # the end token is not text
    # the same weights without tokenizer_config.json's eos_token: nothing ends the reply there
    path = granite_checkpoint(tmp_path / "no-eos", model=model)
    write_tokenizer_config(path, GRANITE, bos_token="<|end_of_text|>")
    run_on = LLM(path, **kw)
    assert run_on.tokenizer.eos_ids == ()
    assert run_on.chat(conv, params)[0].token_ids[: k + 1] == out.token_ids
    write_tokenizer_config(path, GRANITE, eos_token="<|no such token|>")  # a name tokenizer.json lacks: ignored
    assert LLM(path, **kw).tokenizer.eos_ids == ()


BAD_MESSAGES = {  # messages -> the start of the error
    "not-a-list": ("hello", "messages: expected a non-empty list of {'role': ..., 'content': ...} dicts, got str"),
    "empty": ([], "messages: expected a non-empty list of {'role': ..., 'content': ...} dicts, got an empty list"),
    "not-a-dict": ([{"role": "user", "content": "x"}, "y"], "messages[1]: expected a dict with 'role' and 'content', "
                                                            "got str"),
    "no-content": ([{"role": "user"}], "messages[0].content: expected a string, got NoneType"),
    "role-not-str": ([{"role": 1, "content": "x"}], "messages[0].role: expected a string, got int"),
    "extra-key": ([{"role": "user", "content": "x", "name": "b"}], "messages[0]: unsupported key(s) name"),
    "in-a-batch": ([[{"role": "user", "content": "x"}], []], "messages[1]: expected a non-empty list"),
    "template-refuses": ([{"role": "tool", "content": "x"}], "chat_template: "),
}


@pytest.mark.parametrize("messages, message", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_malformed_messages_are_one_line_value_errors(llm, ckpt, messages, message):
    batch = isinstance(messages, list) and messages and isinstance(messages[0], list)
    for call in (llm.chat,) if batch else (llm.chat, llm.chat_stream):
        with pytest.raises(ValueError) as e:
            call(messages)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    if message == "chat_template: ":  # the template's own raise_exception, quoted
        assert str(e.value) == (f"chat_template: {ckpt / 'tokenizer_config.json'}: rendering failed (TemplateError: "
                                "roles after the system turn must be user or assistant, got tool)")
    assert not llm.scheduler.running and not llm.scheduler.waiting  # nothing was queued


def test_chat_stream_takes_one_conversation(llm):
    with pytest.raises(ValueError, match="messages: chat_stream takes one conversation"):
        llm.chat_stream([CONVERSATIONS["system"]])


def test_a_checkpoint_without_a_template_names_the_files(tmp_path):
    path = tiny_checkpoint(tmp_path / "base", seed=1)
    llm = LLM(path, backend="torch", device="cpu", max_batch=1, max_seq_len=64)
    with pytest.raises(ValueError) as e:
        llm.chat(CONVERSATIONS["system"])
    assert str(e.value) == (f"chat_template: {path} has none (looked in chat_template.jinja and "
                            "tokenizer_config.json); base models such as the shipped weights have none: use an "
                            "instruct checkpoint, e.g. ibm-granite/granite-4.0-h-350m")
    assert llm.generate("def f(x):", SamplingParams(max_new_tokens=2))[0].finish_reason in ("stop", "length")


# ---- model ids ---------------------------------------------------------------------------------------------
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo_id: str, src: Path) -> Path:
    """Lay src out in cache as huggingface_hub does: blobs named by content hash, snapshots/<revision>/ of
    relative symlinks to them, and refs/main naming the revision. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under HF_HUB_OFFLINE=1, for this process (huggingface_hub reads the
    variables at import) and for subprocesses; the working directory holds no org/name directories."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return cache


def test_an_id_resolves_from_the_cache_offline(ckpt, offline_cache, tmp_path):
    hub_cache(offline_cache, "granite-test/granite-tiny", ckpt)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    kw = dict(backend="torch", device="cpu", max_batch=2, max_seq_len=128)
    by_id = LLM("granite-test/granite-tiny", **kw)
    by_dir = LLM(ckpt, **kw)
    convs = [CONVERSATIONS["multi-turn"], CONVERSATIONS["non-ascii"]]
    assert [o.token_ids for o in by_id.chat(convs, params)] == [o.token_ids for o in by_dir.chat(convs, params)]
    # a directory of the same name wins over the id
    other = granite_checkpoint(tmp_path / "granite-test" / "granite-tiny", seed=9)  # the working directory's
    local = LLM("granite-test/granite-tiny", **kw).generate("def f(x):", params)[0].token_ids
    assert local == LLM(other, **kw).generate("def f(x):", params)[0].token_ids
    assert local != by_dir.generate("def f(x):", params)[0].token_ids


def test_an_id_missing_offline_is_one_line(offline_cache):
    with pytest.raises(ValueError) as e:
        LLM("granite-test/not-cached", backend="torch", device="cpu")
    assert str(e.value) == (f"model: granite-test/not-cached is not a directory and is not in the Hugging Face cache "
                            f"({offline_cache}); offline (HF_HUB_OFFLINE=1): get it with "
                            "`hf download granite-test/not-cached` where the network allows")


def test_a_partial_cache_entry_names_the_missing_files(ckpt, offline_cache, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (partial / "model.safetensors").unlink()
    hub_cache(offline_cache, "granite-test/partial", partial)
    with pytest.raises(ValueError, match=r"model: granite-test/partial is not a directory and lacks "
                                         r"model\.safetensors \(.*\); offline \(HF_HUB_OFFLINE=1\): get it with"):
        LLM("granite-test/partial", backend="torch", device="cpu")


@pytest.mark.parametrize("hub_answer", ["files", "refused", "no-tokenizer"])
def test_an_id_not_cached_is_downloaded_where_the_network_allows(ckpt, offline_cache, tmp_path, monkeypatch,
                                                                 hub_answer):
    """Online, with nothing cached: one download of the files nano_spec reads. A stand-in for huggingface_hub's
    snapshot_download answers as the hub would: the files, a refusal, or a repository without tokenizer.json."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    repo_id, calls = "granite-test/granite-tiny", []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, local_files_only, allow_patterns))
        if local_files_only:
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
        if hub_answer == "refused":
            raise OSError("404 Client Error. (Request ID: x)\n\nRepository Not Found for url: https://...")
        src = tmp_path / "repo"
        shutil.copytree(ckpt, src, ignore=None if hub_answer == "files" else shutil.ignore_patterns("tokenizer.json"))
        return str(hub_cache(offline_cache, repo_id, src))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    files = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja"]
    kw = dict(backend="torch", device="cpu", max_batch=1, max_seq_len=64)
    if hub_answer == "files":
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        assert (LLM(repo_id, **kw).generate("def f(x):", params)[0].token_ids
                == LLM(ckpt, **kw).generate("def f(x):", params)[0].token_ids)
    else:
        with pytest.raises(ValueError) as e:
            LLM(repo_id, **kw)
        assert str(e.value) == {
            "refused": "model: granite-test/granite-tiny is not a directory and the hub refused it (404 Client Error. "
                       "(Request ID: x))",
            "no-tokenizer": "model: granite-test/granite-tiny on the hub lacks tokenizer.json; nano_spec needs "
                            "config.json, tokenizer.json and safetensors weights"}[hub_answer]
    assert calls == [(repo_id, True, files), (repo_id, False, files)]


@pytest.mark.parametrize("listing", [False, True], ids=["no-tree-listing", "tree-listing"])
def test_a_partial_cache_with_the_hub_unreachable_says_both(ckpt, offline_cache, tmp_path, monkeypatch, listing):
    """Online, a cache holding all but the weights, and no hub: the real huggingface_hub against an endpoint on a
    closed local port (refused at once, whatever the machine's network). It returns the partial snapshot without a
    word, or, where it cached the repository's file list (as an interrupted download leaves it: trees/<revision>.json,
    which versions without one ignore), refuses it as incomplete. Either way the message says the cache holds part of
    it and the hub cannot be reached, not that the hub lacks the weights."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)  # a proxy would answer for the closed port
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (partial / "model.safetensors").unlink()
    snapshot = hub_cache(offline_cache, "granite-test/partial", partial)
    if listing:  # the format huggingface_hub documents in its _tree_cache module
        files = {f.name: {"size": f.stat().st_size, "blob_id": "0" * 40} for f in ckpt.iterdir()}
        (snapshot.parents[1] / "trees").mkdir()
        (snapshot.parents[1] / "trees" / f"{REVISION}.json").write_text(json.dumps({"format_version": 1,
                                                                                   "files": files}))
    with pytest.raises(ValueError) as e:
        LLM("granite-test/partial", backend="torch", device="cpu")
    assert str(e.value) == (f"model: granite-test/partial is not a directory, is in the Hugging Face cache "
                            f"({offline_cache}) only in part (lacks model.safetensors) and the hub cannot be "
                            "reached: get it with `hf download granite-test/partial` where the network allows")


@pytest.mark.parametrize("model, message", [
    ("a/b..c", "model: a/b..c is not a directory and not a valid Hugging Face model id (org/name): "),
    ("", "model: empty; expected a checkpoint directory or a Hugging Face model id (org/name)"),
], ids=["invalid-id", "empty"])
def test_a_malformed_model_is_one_line_naming_model(offline_cache, model, message):
    """The working directory (offline_cache's) is a directory, but the empty string does not name it."""
    with pytest.raises(ValueError) as e:
        LLM(model, backend="torch", device="cpu")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# ---- the CLI -------------------------------------------------------------------------------------------------
def cli(*args, env=None):
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           **(env or {})}
    r = subprocess.run([sys.executable, "-m", "nano_spec.generate", *map(str, args)], capture_output=True,
                       text=True, timeout=300, env=env)
    return r.returncode, r.stdout, r.stderr


def test_cli_chat_by_id_offline_equals_the_directory(llm, ckpt, offline_cache):
    hub_cache(offline_cache, "granite-test/granite-tiny", ckpt)
    env = {"HF_HOME": str(offline_cache.parent), "HF_HUB_OFFLINE": "1"}
    flags = ["--chat", "--system", "Be brief.", "--prompt", "héllo ✓", "--prompt", "", "--max-new-tokens", 6,
             "--json", "--backend", "torch", "--device", "cpu"]
    runs = [cli("--model", model, *flags, env=env) for model in ("granite-test/granite-tiny", ckpt)]
    for rc, _, err in runs:
        assert rc == 0, err
    rows = [[json.loads(line) for line in out.splitlines()] for _, out, _ in runs]
    assert [r["token_ids"] for r in rows[0]] == [r["token_ids"] for r in rows[1]]
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}]
    assert rows[0][0]["prompt"] == reference(ckpt, conv)[0]
    rc, out, err = cli("--model", "granite-test/granite-tiny", "--chat", "--prompt", "Hi", "--max-new-tokens", 4,
                       "--backend", "torch", "--device", "cpu", env=env)  # one prompt is streamed: the reply only
    reply = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=4))[0].text
    assert rc == 0 and out == reply + "\n", (out, err)


def test_cli_errors_exit_2_with_one_line(ckpt, offline_cache, tmp_path):
    base = tiny_checkpoint(tmp_path / "base", seed=1)
    env = {"HF_HOME": str(offline_cache.parent), "HF_HUB_OFFLINE": "1"}
    cases = {
        ("--model", base, "--chat", "--prompt", "Hi"): "error: chat_template: ",
        ("--model", "granite-test/not-cached", "--chat", "--prompt", "Hi"):
            "error: model: granite-test/not-cached is not a directory and is not in the Hugging Face cache",
        ("--model", "", "--prompt", "Hi"): "error: model: empty; ",
        ("--model", "a/b..c", "--prompt", "Hi"): "error: model: a/b..c is not a directory and not a valid ",
        ("--model", ckpt, "--system", "Be brief.", "--prompt", "Hi"): "error: --system: only with --chat",
    }
    for args, message in cases.items():
        rc, out, err = cli(*args, "--backend", "torch", "--device", "cpu", env=env)
        assert rc == 2, (args, err)
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, (args, err)
