"""Shared setup of the kernel tests.

Without a GPU the Triton kernels run under the interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before anything imports
triton or ``mtpdraft.kernels``. With a GPU the same tests run compiled, on ``cuda``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def device() -> torch.device:
    """Where the small (CPU-sized) tests run: the GPU if there is one."""
    return DEVICE


@pytest.fixture(
    params=[
        pytest.param((torch.float32, 1e-5, 1e-5), id="fp32"),
        pytest.param((torch.bfloat16, 2e-2, 2e-2), id="bf16"),
    ]
)
def dtype_tol(request: pytest.FixtureRequest) -> tuple[torch.dtype, float, float]:
    """(dtype, atol, rtol) for comparing a kernel with its fp32 torch reference."""
    return request.param
