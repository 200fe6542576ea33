"""The engines the bench sets beside nano_spec's, on the same base weights and token ids: transformers'
GraniteMoeHybridForCausalLM.generate (--vs-transformers) and llama.cpp on a GGUF (--vs-llama-cpp). Each has
generate(ids, max_new_tokens) -> token ids per prompt, and stats()."""
import time
from pathlib import Path

import torch


class Transformers:
    """transformers' GraniteMoeHybridForCausalLM.generate, greedy, batches of `batch` left-padded prompts."""

    def __init__(self, model_dir, batch, device, dtype):
        import transformers

        transformers.logging.set_verbosity_error()  # it lists the MTP tensors it does not know
        self.name, self.batch, self.device = "transformers", batch, device
        self.proposer, self.gamma = "none", 0
        self.model = transformers.GraniteMoeHybridForCausalLM.from_pretrained(
            model_dir, dtype=dtype).to(device).eval()  # the MTP head's tensors are ignored
        self.config = self.model.generation_config
        self.config.eos_token_id = None  # like ignore_eos: every request runs to max_new_tokens
        self.config.pad_token_id = 0

    def generate(self, ids, max_new_tokens):  # transformers' generate runs without autograd
        outs = []
        for i in range(0, len(ids), self.batch):
            chunk = ids[i : i + self.batch]
            L = max(map(len, chunk))
            x = torch.tensor([[0] * (L - len(c)) + c for c in chunk], device=self.device)
            mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in chunk], device=self.device)
            y = self.model.generate(x, attention_mask=mask, generation_config=self.config, do_sample=False,
                                    max_new_tokens=max_new_tokens)
            outs += y[:, L:].tolist()
        return outs

    def stats(self):
        return {"steps_s": None, "tau": None, "accept_at": None, "gamma_hist": None, "predicted_speedup": None,
                "propose_ms_per_step": None}


# llama.cpp's general.file_type: what most of a GGUF's weights are stored in (its enum llama_ftype)
GGUF_TYPES = {0: "f32", 1: "f16", 7: "q8_0", 32: "bf16"}


class LlamaCpp:
    """llama-cpp-python's plain decoding of a GGUF, greedy, one prompt at a time (it decodes one sequence)."""
    name, proposer, gamma = "llama.cpp", "none", 0

    @staticmethod
    def check(path):
        """Refuse before any engine is built: llama-cpp-python missing, no such file, or not a GGUF. llama.cpp
        reads the file only at batch 1, which may come after other batch sizes' timing."""
        try:
            import llama_cpp  # noqa: F401
        except (ImportError, OSError, RuntimeError) as e:  # a wheel whose shared library fails to load raises too
            raise ImportError(f"--vs-llama-cpp needs llama-cpp-python ({type(e).__name__} on import; "
                              "pip install llama-cpp-python==0.3.36 builds it, see docs/BENCHMARKS.md, "
                              "\"Beside llama.cpp\")") from None
        if not Path(path).is_file():
            raise ValueError(f"--vs-llama-cpp: {path} is not a file (scripts/export_gguf.py writes one)")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ValueError(f"--vs-llama-cpp: cannot read {path} ({e.strerror})") from None
        if magic != b"GGUF":  # every GGUF file, of either byte order, starts with these bytes
            raise ValueError(f"--vs-llama-cpp: {path} is not a GGUF file (it does not start with the bytes GGUF; "
                             "scripts/export_gguf.py writes one)")

    def __init__(self, path, n_ctx):
        import llama_cpp

        threads = torch.get_num_threads()  # as many as the nano_spec engines use, prefill included
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   verbose=False)
        file_type = int(self.llm.metadata.get("general.file_type", -1))
        self.gguf_type = GGUF_TYPES.get(file_type, f"file type {file_type}")
        self.decode_s = 0.0

    def generate(self, ids, max_new_tokens):
        outs, self.decode_s = [], 0.0
        for prompt in ids:
            self.llm.reset()
            out = []
            # generate() reuses (clears) the list it is given; it never stops at EOS, as ignore_eos
            for token in self.llm.generate(list(prompt), temp=0.0, top_k=1, repeat_penalty=1.0):
                out.append(token)
                if len(out) == 1:
                    first = time.perf_counter()  # the prefill ends with the first token
                if len(out) == max_new_tokens:
                    break
            self.decode_s += time.perf_counter() - first
            outs.append(out)
        return outs

    def stats(self):
        return {"steps_s": self.decode_s, "tau": None, "accept_at": None, "gamma_hist": None,
                "predicted_speedup": None, "propose_ms_per_step": None, "gguf_type": self.gguf_type}
