"""scripts/export_gguf.py in process, on a stand-in llama.cpp tree whose converter writes "GGUF" and then the bytes
of the model.safetensors it was given: a bad --out is refused while the arguments are parsed, a truncated weights
file is one line naming it, and a converter that fails midway leaves nothing at --out."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load, load_file

from helpers import load_script

SHIPPED = Path(__file__).resolve().parents[1] / "weights" / "stdlib-hybrid-8m"

CONVERTER = """
import json
import sys
from pathlib import Path

from conversion.base import TextModel  # as the real converter imports it

out = Path(sys.argv[sys.argv.index("--outfile") + 1])
seen = {"argv": sys.argv, "pre": TextModel().get_vocab_base_pre(None)}
(Path(__file__).parent / "seen.json").write_text(json.dumps(seen))
data = b"GGUF" + (Path(sys.argv[1]) / "model.safetensors").read_bytes()
with open(out, "wb") as f:
    f.write(data[: len(data) // 2] if FAIL else data)
    if FAIL:
        raise OSError(28, "No space left on device")
"""


@pytest.fixture
def tree(tmp_path):
    """A stand-in llama.cpp source tree -> (its path, a function writing its converter: fail midway or not)."""
    root = tmp_path / "llama.cpp"
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text("class TextModel:\n    pass\n")

    def converter(fail):
        (root / "convert_hf_to_gguf.py").write_text(f"FAIL = {fail}\n" + CONVERTER)
        return root

    converter(False)
    yield root, converter
    for name in [m for m in sys.modules if m == "conversion" or m.startswith("conversion.")]:
        del sys.modules[name]  # the stand-in's package, imported by the script's converter step


def export(*argv):
    return load_script("export_gguf").main([str(a) for a in argv])


def test_export_writes_the_converters_output_at_out(tree, tmp_path, capsys):
    root, _ = tree
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    assert export("--llama-cpp", root, "--out", out, "--model", SHIPPED) == 0, capsys.readouterr().err
    assert os.listdir(out.parent) == ["m.gguf"]  # no temporary file left beside it
    data = out.read_bytes()
    assert data[:4] == b"GGUF"
    given = load(data[4:])  # the model.safetensors the converter was given: the base, without the MTP head
    shipped = {k: v for k, v in load_file(SHIPPED / "model.safetensors").items() if not k.startswith("mtp.")}
    assert given.keys() == shipped.keys() and all(given[k].equal(v) for k, v in shipped.items())
    assert json.loads((root / "seen.json").read_text())["pre"] == "gpt-2"


@pytest.mark.parametrize("where", ["missing", "a-file", pytest.param("read-only", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into a directory whatever its mode"))])
def test_out_where_nothing_can_be_written_is_refused_while_parsing(tree, tmp_path, monkeypatch, capsys, where):
    root, _ = tree
    parent = tmp_path / "dir"
    if where == "a-file":
        parent.write_text("")
    elif where == "read-only":
        parent.mkdir(mode=0o500)
    module = load_script("export_gguf")
    monkeypatch.setattr(module, "converter_copy", lambda src, dst: pytest.fail("converted before --out was checked"))
    with pytest.raises(SystemExit) as e:
        module.main(["--llama-cpp", str(root), "--out", str(parent / "m.gguf"), "--model", str(SHIPPED)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --out: ") and str(parent) in err, err


def test_truncated_safetensors_is_one_line_naming_the_file(tree, tmp_path, capsys):
    root, _ = tree
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(SHIPPED / name, model / name)
    whole = (SHIPPED / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "m.gguf"
    rc = export("--llama-cpp", root, "--out", out, "--model", model)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and str(model / "model.safetensors") in err, err
    assert not out.exists() and not (root / "seen.json").exists()  # the converter never ran


def test_a_converter_failing_midway_leaves_nothing_at_out(tree, tmp_path):
    root, converter = tree
    converter(fail=True)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(OSError, match="No space left"):
        export("--llama-cpp", root, "--out", out, "--model", SHIPPED)
    assert os.listdir(out.parent) == []  # neither --out nor a temporary file
    # the converter wrote beside --out, so that the finished file only has to be renamed (a move across file
    # systems would copy it, and a copy can fail halfway)
    argv = json.loads((root / "seen.json").read_text())["argv"]
    written = Path(argv[argv.index("--outfile") + 1])
    assert written.parent == out.parent and written != out
