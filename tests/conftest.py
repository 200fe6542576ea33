"""Test setup: without CUDA, Triton kernels run in the interpreter on the CPU.

TRITON_INTERPRET must be set before any `@triton.jit` function is defined, so
this happens at conftest import, before the test modules import `nano_spec_kernels`.
"""
import os
import sys
from pathlib import Path

import torch

# The checkout's kernels, whether nano_spec is installed editable, as a wheel, or not at all:
# the folder kernels/ holds the one package nano_spec_kernels (README, "Layout").
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tiny shapes gain nothing from threads, and spinning OpenMP threads stall on a busy machine
torch.set_num_threads(1)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
