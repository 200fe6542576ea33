"""A thin wrapper over a checkpoint's tokenizer.json, with EOS ids from config.json and tokenizer_config.json."""
import codecs
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from nano_spec.model.config import ModelConfig


def tokenizer_config(path) -> dict:
    """A checkpoint's tokenizer_config.json ({} when there is none): special tokens and the chat template."""
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    return config


def special_token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, path, cfg: ModelConfig):
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{Path(path)}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{file}: cannot be read as a tokenizers file ({e})") from None
        self._added, self._bytes = set(self._tok.get_added_tokens_decoder()), {}  # token_bytes: id -> bytes
        if self._tok.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"{file}: {self._tok.get_vocab_size()} tokens but the model has "
                                 f"vocab_size {cfg.vocab_size}")
        # an instruct model ends its turn with the tokenizer's EOS (the chat template's end token), which
        # config.json need not list; a name that is no token of tokenizer.json is ignored
        eot = self._tok.token_to_id(special_token(tokenizer_config(path).get("eos_token")) or "")
        self.eos_ids = cfg.eos_ids + ((eot,) if eot is not None and eot not in cfg.eos_ids else ())

    def encode(self, text: str) -> list:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (say from undecodable bytes in argv) is no text
            raise ValueError(f"prompt: not valid Unicode: lone surrogate {text[e.start]!r} at index {e.start}") \
                from None
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, ids) -> bytes | None:
        """The bytes the ids decode from, for a byte-level BPE tokenizer (GPT-2's, Granite's, ours); None for
        a tokenizer of another kind, whose tokens are not byte strings."""
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        for i in ids:
            if i not in self._bytes:
                piece = self._tok.id_to_token(i) or ""
                if i in self._added:  # special and added tokens: their text, as decode() gives it
                    self._bytes[i] = self._tok.decode([i], skip_special_tokens=True).encode()
                elif all(c in UNICODE_TO_BYTE for c in piece):
                    self._bytes[i] = bytes(UNICODE_TO_BYTE[c] for c in piece)
                else:
                    return None
        return b"".join(self._bytes[i] for i in ids)


def _unicode_to_byte() -> dict:
    """The inverse of GPT-2's bytes_to_unicode, which byte-level BPE vocabularies are written in: printable
    bytes stand for themselves, the others for chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


UNICODE_TO_BYTE = _unicode_to_byte()


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding only a short window per new token, so a whole
    output costs O(n) rather than the O(n²) of decoding everything at every token.

    `text` holds only complete characters: a token that ends inside a multi-byte character waits for
    the token that completes it. A U+FFFD in the text itself, or bytes no later token could complete, are
    complete characters and do not wait. `full_text()` is what decoding all ids at once gives.

    Tokens are decoded when their text is read (`add`, `text`), one window per token in order, so the text is the
    same whenever it is read; `push` only appends. A request that no one reads until it ends (no stop string, no
    stream) is decoded once, by `full_text()`, instead of twice per token inside the engine's step loop.
    """

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self._text = tok, [], ""
        self.start = self.done = 0  # ids[start:done]: context already turned into text
        self.read = 0  # ids[:read] have been through _decode_one

    def push(self, token: int):
        """Append one token, decoded when the text is next read."""
        self.ids.append(token)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ('' while a character is unfinished), with that of
        tokens pushed before it."""
        self.push(token)
        return self._decode_pushed()

    @property
    def text(self) -> str:
        self._decode_pushed()
        return self._text

    def _decode_pushed(self) -> str:
        new = ""
        while self.read < len(self.ids):
            self.read += 1
            new += self._decode_one()
        return new

    def _decode_one(self) -> str:
        """The text ids[read - 1] completes, with its window's context."""
        before = self.tok.decode(self.ids[self.start : self.done])
        after = self.tok.decode(self.ids[self.start : self.read])
        if not after.startswith(before) or (after.endswith("\ufffd") and self._unfinished()):
            return ""
        new = after[len(before) :]
        self.start, self.done = self.done, self.read
        self._text += new
        return new

    def _unfinished(self) -> bool:
        """The decoded window ends in U+FFFD: the start of a UTF-8 character more bytes could finish, or a real one?"""
        data = self.tok.token_bytes(self.ids[self.start : self.read])
        if data is None:  # not byte-level: wait, as before
            return True
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(data[-4:], final=False)  # a character is at most 4 bytes; invalid bytes are replaced, not kept
        return bool(decoder.getstate()[0])

    def full_text(self) -> str:
        before = self.tok.decode(self.ids[self.start : self.done])
        return self._text + self.tok.decode(self.ids[self.start :])[len(before) :]
