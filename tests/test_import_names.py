"""Our import names are ours alone: `nano_spec` and `nano_spec_kernels`, never `kernels`.

`kernels` is the Hugging Face kernel hub, which transformers imports whenever it is
installed. Both checks run in a fresh python, because the collision depends on
sys.path: from the repository root (as `python -m pytest` runs) the root comes first.
"""
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path, **env) -> str:
    """Run code in a fresh python (sys.path[0] is cwd, as under `python -m`), return stdout; fail on error."""
    full_env = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_transformers_kernel_hub_and_our_kernels_in_one_process():
    """From the repository root: transformers' GraniteMoeHybrid, the `kernels` distribution and
    nano_spec's Triton kernels load side by side, and give the same logits."""
    pytest.importorskip("transformers")
    try:
        hub_version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the `kernels` distribution is not installed: transformers >= 5 depends on it, and this "
                    "test exists to load it beside nano_spec")
    out = run_python("""
        import sys, tempfile
        import torch
        import transformers
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
        import kernels
        from kernels import CUDAProperties  # transformers' hub_kernels imports this name

        import nano_spec_kernels.common
        from nano_spec.model.model import load_model

        assert sys.path[0] in ("", "."), sys.path[0]  # the repository root comes first
        assert "site-packages" in kernels.__file__, kernels.__file__
        cfg = GraniteMoeHybridConfig(
            vocab_size=53, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            shared_intermediate_size=24, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mamba_n_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
            num_local_experts=0, position_embedding_type="rope")
        torch.manual_seed(0)
        hf = GraniteMoeHybridForCausalLM(cfg).eval()
        ids = torch.randint(0, 53, (1, 11))
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            hf.save_pretrained(d)
            backend = "triton" if nano_spec_kernels.common.HAS_TRITON else "torch"
            ours = load_model(d, backend=backend)
            err = (ours(ids) - hf(ids).logits).abs().max().item()
        print(f"transformers {transformers.__version__} from {transformers.__file__}")
        print(f"kernels {kernels.__name__} from {kernels.__file__}")
        print(f"nano_spec_kernels from {nano_spec_kernels.__file__}")
        print(f"backend {backend}: max abs logits error vs transformers {err:.2e}")
        assert err <= 1e-4, err
    """, cwd=ROOT)
    print(f"kernels distribution {hub_version}\n{out}")
    assert "max abs logits error" in out


def test_wheel_has_no_top_level_kernels(tmp_path):
    """The wheel installs `nano_spec` and `nano_spec_kernels` only; installed, it runs the kernels from
    the repository root as from anywhere else."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("nano_spec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")})
    print("wheel top-level names:", top)
    assert top == ["nano_spec", "nano_spec_kernels"], top
    assert "nano_spec_kernels/mamba_verify.py" in names
    package = {str(p.relative_to(ROOT)) for pattern in ("*.py", "*.cpp") for p in (ROOT / "nano_spec").rglob(pattern)}
    assert package <= set(names), sorted(package - set(names))  # every subfolder of the package ships, C++ too

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    for cwd in (ROOT, tmp_path):
        out = run_python("""
            import torch
            import nano_spec_kernels
            from nano_spec_kernels.common import HAS_TRITON
            from nano_spec_kernels.rmsnorm import rmsnorm, rmsnorm_ref

            x, w = torch.randn(3, 40), torch.rand(40)
            if HAS_TRITON:  # the launcher (the interpreter on a CPU) against the reference
                torch.testing.assert_close(rmsnorm(x, w, 1e-5)[0], rmsnorm_ref(x, w, 1e-5)[0])
            print(nano_spec_kernels.__file__)
        """, cwd=cwd, PYTHONPATH=str(target))
        assert Path(out.strip()).is_relative_to(target), out
