"""The torch backend on a machine without triton (macOS, Windows).

Each check runs in a fresh python in which `import triton` fails as it does where
the package is not installed: a meta-path finder, inserted before anything else is
imported, raises ModuleNotFoundError for `triton` and `triton.*`. The child gets
no TRITON_* variables (conftest sets TRITON_INTERPRET=1 for this process).

To check another piece of code without triton, call `run_without_triton(code)`.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = sorted(p.stem for p in (ROOT / "kernels" / "nano_spec_kernels").glob("*.py") if p.stem != "__init__")

# first lines of every child: make sure triton is not loaded yet, then make its import fail
BLOCK_TRITON = """
import sys

assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported at startup"


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTriton())
"""


def run_without_triton(code: str, timeout: float = 600) -> str:
    """Run `code` in a fresh python (cwd: the repository root) where triton cannot be imported;
    fail the test on a non-zero exit; return the child's stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # small tensors; threads only stall a busy machine
    proc = subprocess.run([sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode} without triton\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def test_the_blocker_blocks():
    out = run_without_triton("""
        try:
            import triton  # noqa: F401
        except ImportError:
            print("blocked")
    """)
    assert out.split() == ["blocked"]


def test_every_kernel_module_imports():
    out = run_without_triton(f"""
        import importlib

        import torch

        import nano_spec_kernels.common

        assert not nano_spec_kernels.common.HAS_TRITON
        for name in {KERNEL_MODULES!r}:
            importlib.import_module("nano_spec_kernels." + name)
        # a launcher checks its inputs, then refuses to run rather than fail deep inside
        from nano_spec_kernels.rmsnorm import rmsnorm
        try:
            rmsnorm(torch.randn(3, 8), torch.ones(8), 1e-5)
        except ImportError as e:
            assert "backend='torch'" in str(e), e
        else:
            raise AssertionError("a launcher ran without triton")
        print("imported", len({KERNEL_MODULES!r}))
    """)
    assert out.split() == ["imported", str(len(KERNEL_MODULES))]


def test_torch_ops_compute():
    out = run_without_triton("""
        import torch

        from nano_spec.model.ops import OP_NAMES, Ops, resolve_backend

        ops = Ops("torch")
        assert all(callable(getattr(ops, name)) for name in OP_NAMES)
        x, w = torch.randn(3, 8), torch.randn(8)  # (rows, D), (D,)
        y, h = ops.rmsnorm(x, w, 1e-5)
        assert h is x
        assert torch.allclose(y, w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), atol=1e-6)
        src, idx = torch.randn(2, 4, 5), torch.tensor([3, 0])  # (B, K, D), (B,)
        assert torch.equal(ops.gather_rows(src, idx), torch.stack([src[0, 3], src[1, 0]]))
        assert resolve_backend("auto", "cuda") == "torch"  # a CUDA machine without triton runs the references
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_triton_backend_is_refused():
    out = run_without_triton("""
        from nano_spec.model.ops import Ops

        try:
            Ops("triton")
        except ValueError as e:
            assert "backend" in str(e), e
            print("refused")
    """)
    assert out.split() == ["refused"]


def test_generate_cli_on_torch_backend():
    """python -m nano_spec.generate --backend torch on the shipped weights (weights/)."""
    out = run_without_triton("""
        import runpy
        import sys

        sys.argv = ["nano_spec.generate", "--backend", "torch", "--max-new-tokens", "8"]
        runpy.run_module("nano_spec.generate", run_name="__main__", alter_sys=True)
    """)
    from nano_spec.generate import DEMO_CLASS, DEMO_METHODS

    assert out.startswith(DEMO_CLASS + DEMO_METHODS[0]), out
    assert out[len(DEMO_CLASS + DEMO_METHODS[0]):].strip(), f"no completion printed: {out!r}"


def test_reference_loop_without_triton():
    out = run_without_triton("""
        from nano_spec.engine.llm import LLM
        from nano_spec.reference import speculative_generate

        llm = LLM(backend="torch", max_batch=1)
        ids = llm.tokenizer.encode("def add(a, b):")
        tokens, origins = speculative_generate(llm.model, ids, 8, 3, "mtp")
        print(len(tokens), set(origins) <= {"bonus", "correction", "draft", "prefill"})
    """)
    assert out.split() == ["8", "True"]
