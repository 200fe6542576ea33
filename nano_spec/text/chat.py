"""Chat templates: a checkpoint's own chat_template, rendered as transformers' apply_chat_template renders it.

The template comes from chat_template.jinja or, failing that, tokenizer_config.json's chat_template. It runs
in jinja2's immutable sandbox (templates are code from the hub) with transformers' settings and helpers, and
sees `messages`, `tools` and `documents` (None), `add_generation_prompt` (True) and the special tokens of
tokenizer_config.json (bos_token, eos_token, ...).
"""
import json
from datetime import datetime
from pathlib import Path

from nano_spec.text.tokenizer import special_token, tokenizer_config

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def conversation(messages, where: str = "messages") -> list:
    """A validated copy of one conversation: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        got = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise ValueError(f"{where}: expected a non-empty list of {{'role': ..., 'content': ...}} dicts, got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"{where}[{i}].{key}: expected a string, got {type(m.get(key)).__name__}")
        extra = sorted(map(str, set(m) - {"role", "content"}))
        if extra:
            raise ValueError(f"{where}[{i}]: unsupported key(s) {', '.join(extra)}; a message has 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversations(messages) -> tuple:
    """(list of validated conversations, whether one was given rather than a list of them)."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
        return [conversation(c, f"messages[{i}]") for i, c in enumerate(messages)], False
    return [conversation(messages)], True


class ChatTemplate:
    def __init__(self, path):
        self.path = path = Path(path)
        config = tokenizer_config(path)
        self.source, self.file = _template_source(path, config)
        self.variables = {k: v for k in SPECIAL_TOKENS if (v := special_token(config.get(k))) is not None}
        self._compiled = None

    def render(self, messages: list) -> str:
        """The prompt of one validated conversation, ending with the assistant's turn opened."""
        if self.source is None:
            raise ValueError(f"chat_template: {self.path} has none (looked in {TEMPLATE_FILE} and "
                             "tokenizer_config.json); base models such as the shipped weights have none: use an "
                             "instruct checkpoint, e.g. ibm-granite/granite-4.0-h-350m")
        if self._compiled is None:
            self._compiled = _compile(self.source, self.file)
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                         **self.variables)
        except Exception as e:  # the template is data: raise_exception, a sandbox refusal or a type error in it
            raise ValueError(f"chat_template: {self.file}: rendering failed ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None


def _template_source(path: Path, config: dict) -> tuple:
    """(template text or None, the file it came from); chat_template.jinja wins, as in transformers."""
    file = path / TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8"), file
        except UnicodeDecodeError:
            raise ValueError(f"chat_template: {file} is not UTF-8 text") from None
    file, template = path / "tokenizer_config.json", config.get("chat_template")
    if isinstance(template, list):  # named templates, [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"chat_template: {file} names templates {sorted(map(str, named))} but no 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template: {file}: expected a string, got {type(template).__name__}")
    return template, file


def _compile(source: str, file: Path):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja's own escapes HTML characters, which a prompt must keep
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: {file}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
