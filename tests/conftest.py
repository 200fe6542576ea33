"""Test setup: without CUDA, Triton kernels run in the interpreter on the CPU.

TRITON_INTERPRET must be set before any `@triton.jit` function is defined, so
this happens at conftest import, before the test modules import `kernels`.
"""
import os

import torch

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
