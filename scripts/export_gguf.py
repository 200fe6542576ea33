"""A nano_spec checkpoint as a GGUF file for llama.cpp (docs/BENCHMARKS.md, "Beside llama.cpp").

    python scripts/export_gguf.py --llama-cpp LLAMA_CPP_DIR --out model-f32.gguf [--model DIR] [--outtype f32]

LLAMA_CPP_DIR is a llama.cpp source tree (llama-cpp-python's source archive carries one as vendor/llama.cpp);
its convert_hf_to_gguf.py does the conversion and needs its own requirements (gguf-py from the tree, numpy,
transformers, sentencepiece). Steps:
  1. a converter-ready copy of the base model in a temporary directory: every tensor but the MTP head's
     (`mtp.*`, which llama.cpp has no place for), the config with num_nextn_predict_layers 0, the tokenizer,
     and a tokenizer_config.json that says no BOS token is added (nano_spec adds none);
  2. the converter on that copy. It names a BPE pre-tokenizer by hashing the tokens of a probe text and
     knows only published tokenizers; nano_spec's is byte-level BPE whose split is GPT-2's regex
     (tokenizer.json: ByteLevel with use_regex), so this script declares "gpt-2", and refuses a
     tokenizer with any other pre-tokenizer.
f32 keeps the weights as nano_spec runs them, so greedy outputs can be compared token for token.
"""
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: arg_types
from arg_types import Parser  # noqa: E402

from nano_spec.engine.settings import shipped_weights  # noqa: E402
from nano_spec.model.model import load_model  # noqa: E402


def converter_copy(src: Path, dst: Path) -> int:
    """Step 1: the base model of src in dst -> tensors written."""
    # read as the engine reads them on a CPU (f32): a truncated or corrupt file is a one-line CheckpointError
    state = load_model(src).state_dict()
    tensors = {k: v.contiguous() for k, v in state.items() if not k.startswith("mtp.")}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.loads((src / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or tok.get("normalizer"):
        raise ValueError(f"{src}/tokenizer.json: pre-tokenizer {pre} is not GPT-2's byte-level split; "
                         "the converter would need its own name for it")
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    eos = next((t["content"] for t in tok.get("added_tokens", []) if t["id"] == cfg.get("eos_token_id")), None)
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos,
         "add_bos_token": False, "add_eos_token": False}, indent=2))
    return len(tensors)


def convert(llama_cpp: Path, model: Path, out: Path, outtype: str):
    """Step 2: convert_hf_to_gguf.py in this process, with the pre-tokenizer declared."""
    path, argv = sys.path[:], sys.argv
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    try:
        from conversion.base import TextModel  # the converter's own package, from the llama.cpp tree

        TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
        sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", outtype, "--outfile", str(out)]
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.path[:], sys.argv = path, argv


def parse_args(argv):
    """The arguments, each path checked before anything is read or converted (one line naming the flag, exit 2)."""
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree (holds convert_hf_to_gguf.py)")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"))
    args = p.parse_args(argv)
    llama_cpp, out = Path(args.llama_cpp), Path(args.out)
    src = Path(args.model) if args.model else shipped_weights()
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file() or not (llama_cpp / "conversion" / "base.py").is_file():
        p.error(f"--llama-cpp: {llama_cpp} holds no convert_hf_to_gguf.py with its conversion/ package")
    if not (src / "model.safetensors").is_file():
        p.error(f"--model: {src} holds no model.safetensors")
    if out.exists():
        p.error(f"--out: {out} exists; choose a new path")
    parent = out.parent  # the conversion takes a while: a path it cannot write to is refused first
    if not parent.is_dir():
        p.error(f"--out: {parent} is not a directory" if parent.exists() else
                f"--out: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--out: directory {parent} is not writable")
    return args, llama_cpp, src, out


def main(argv=None) -> int:
    args, llama_cpp, src, out = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            n = converter_copy(src, Path(tmp))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{n} base tensors of {src} (no mtp.*) -> {out}", file=sys.stderr)
        # written beside --out, then renamed over it: a failure midway (or a move across file systems, which
        # copies) never leaves a partial GGUF at --out
        fd, part = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
        os.close(fd)
        try:
            convert(llama_cpp, Path(tmp), Path(part), args.outtype)
            os.replace(part, out)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
