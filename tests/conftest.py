"""Fixtures shared by the tests: a test checkpoint, a real server on loopback, clients.

The server is the real `mtpdraft serve` command in a subprocess, on a tiny fp32
checkpoint so that its drafts can be compared with the float64 oracle
(tests/mtp_reference.py). After every test that uses it the server must hold
no states, no handles and a full block pool: nothing leaked.
"""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything
# imports mtpdraft.kernels, so that without a GPU the kernels run on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import patch_interpreter

    patch_interpreter()

from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import PATIENCE, SERVER_ARGS, ServerProcess, start_server

from mtpdraft.client import DrafterClient
from mtpdraft.service.model.synthetic import write_random_checkpoint


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def mimo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("mimo"), "mimo", seed=1)


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("deepseek"),
        "deepseek",
        seed=2,
        shards=2,
        extra_config={"attention_bias": True, "partial_rotary_factor": 0.5},
    )


@pytest.fixture(scope="session")
def server(mimo_checkpoint: Path) -> Iterator[ServerProcess]:
    """`mtpdraft serve` on the test checkpoint, shared by the tests of the service."""
    proc = start_server(mimo_checkpoint, *SERVER_ARGS)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[DrafterClient]:
    """A client of the shared server; the test must leave nothing behind."""
    with DrafterClient(server.address, timeout=PATIENCE) as c:
        yield c
        info = c.info()
        assert info.live_states == 0, "a state leaked"
        assert info.kv_handles == 0, "a KV handle leaked"
        assert info.kv_blocks_free == info.kv_blocks_total, "KV blocks leaked"
