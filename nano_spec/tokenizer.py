"""A thin wrapper over a checkpoint's tokenizer.json, with EOS/BOS ids from its config."""
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from nano_spec.config import ModelConfig


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, path, cfg: ModelConfig):
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{Path(path)}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{file}: cannot be read as a tokenizers file ({e})") from None
        self.eos_ids = cfg.eos_ids
        if self._tok.get_vocab_size() > cfg.vocab_size:
            raise TokenizerError(f"{file}: {self._tok.get_vocab_size()} tokens but the model has "
                                 f"vocab_size {cfg.vocab_size}")

    def encode(self, text: str) -> list:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding only a short window per new token, so a whole
    output costs O(n) rather than the O(n²) of decoding everything at every token.

    `text` holds only complete characters: a token that ends inside a multi-byte character waits for
    the token that completes it. `full_text()` is what decoding all ids at once gives.
    """

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self.text = tok, [], ""
        self.start = self.done = 0  # ids[start:done]: context already turned into text

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ('' while a character is unfinished)."""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.start : self.done])
        after = self.tok.decode(self.ids[self.start :])
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""
        new = after[len(before) :]
        self.start, self.done = self.done, len(self.ids)
        self.text += new
        return new

    def full_text(self) -> str:
        before = self.tok.decode(self.ids[self.start : self.done])
        return self.text + self.tok.decode(self.ids[self.start :])[len(before) :]
