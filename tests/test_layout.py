"""The house rules of the source tree (docs/DESIGN.md §9): imports stack at most 7 layers deep with no cycle, the
folders show the architecture, no module passes 400 lines, the reference loop stands alone, scripts stand apart
from the tests. Every import of a nano_spec module counts, those inside functions too."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nano_spec"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def nano_spec_imports(path: Path, known: set) -> set:
    """The nano_spec modules a file imports, anywhere in it: `from a.b import c` names a.b.c when that is a
    module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found |= {full} if full in known else {node.module} & known
    return found - {module_name(path)}


def layers() -> dict:
    """module -> its layer: 1 + the highest layer it imports (1 for a module that imports none)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    deps = {name: nano_spec_imports(path, set(files)) for name, path in files.items()}
    layer = {}

    def of(name, path=()):
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name not in layer:
            layer[name] = 1 + max((of(d, path + (name,)) for d in deps[name]), default=0)
        return layer[name]

    for name in files:
        of(name)
    return layer


def test_imports_stack_at_most_7_layers_without_a_cycle():
    found = layers()
    deepest = sorted(found.items(), key=lambda kv: -kv[1])[:5]
    assert max(found.values()) <= 7, deepest
    assert found["nano_spec.reference"] == found["nano_spec.reference_hybrid"] == 1  # the oracles import nothing


def test_the_tree_shows_the_architecture():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert {"engine", "model", "drafters", "text"} <= folders
    for name in ("generate", "bench", "reference"):  # python -m nano_spec.generate / .bench, the oracle on top
        assert (PACKAGE / f"{name}.py").is_file()


FOLDER_ORDER = ("model", "text", "drafters", "engine")  # each folder imports only from those before it


def test_folders_import_one_way():
    """model -> text -> drafters -> engine: no folder imports one above it, so each reads without the next."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    folder = lambda name: name.split(".")[1] if name.count(".") >= 2 else None  # noqa: E731 (nano_spec.<folder>.x)
    back = [(name, dep) for name, path in files.items() if folder(name) in FOLDER_ORDER
            for dep in nano_spec_imports(path, set(files)) if folder(dep) in FOLDER_ORDER
            and FOLDER_ORDER.index(folder(dep)) > FOLDER_ORDER.index(folder(name))]
    assert not back, back


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_passes_400_lines(path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 400


def test_scripts_import_nothing_from_tests():
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith(("tests.", "bench.", "helpers")) for n in names), path


@pytest.mark.parametrize("path", sorted((ROOT / "kernels" / "nano_spec_kernels").glob("*.py")),
                         ids=lambda p: p.name)
def test_kernel_files_read_reference_then_kernel_then_launcher(path):
    """The math (the docstring), the torch `_ref`, the Triton kernel, then the launcher."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    jit = [n.lineno for n in defs if any("triton.jit" in ast.unparse(d) for d in n.decorator_list)]
    refs = [n.lineno for n in defs if n.name.endswith("_ref")]
    if jit and refs:
        assert ast.get_docstring(tree) and max(refs) < min(jit), path.name

