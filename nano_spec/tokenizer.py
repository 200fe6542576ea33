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
        self.bos_id = cfg.bos_token_id
        if self._tok.get_vocab_size() > cfg.vocab_size:
            raise TokenizerError(f"{file}: {self._tok.get_vocab_size()} tokens but the model has "
                                 f"vocab_size {cfg.vocab_size}")

    def encode(self, text: str) -> list:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
