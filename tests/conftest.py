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

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtpdraft.client import DrafterClient
from mtpdraft.service.model.synthetic import write_random_checkpoint

SERVER_START_TIMEOUT = 60.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str
    lines: list[str]

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(model: Path, *extra: str) -> ServerProcess:
    """Starts `mtpdraft serve --port 0` and waits for the port it prints."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(model), "--port", "0"]
    cmd += ["--device", "cpu", *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in process.stdout:  # the server prints its port once it accepts calls
        lines.append(line)
        match = re.search(r"listening on (\S+):(\d+)", line)
        if match:
            return ServerProcess(process, f"127.0.0.1:{match.group(2)}", lines)
    process.wait()
    raise RuntimeError("server exited before listening:\n" + "".join(lines))


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


# Small blocks (4 rows) so that every test crosses block boundaries; 256 blocks
# = 1024 rows in all, enough for every test and small enough to exhaust on purpose.
SERVER_ARGS = ("--kv-blocks", "256", "--block-size", "4", "--max-drafts", "8")
SERVER_ARGS += ("--max-batch", "8", "--max-states", "32", "--grace-period", "2")


@pytest.fixture(scope="session")
def server(mimo_checkpoint: Path) -> Iterator[ServerProcess]:
    proc = start_server(mimo_checkpoint, *SERVER_ARGS)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[DrafterClient]:
    """A client of the shared server; the test must leave nothing behind."""
    with DrafterClient(server.address, timeout=30.0) as c:
        yield c
        info = c.info()
        assert info.live_states == 0, "a state leaked"
        assert info.kv_handles == 0, "a KV handle leaked"
        assert info.kv_blocks_free == info.kv_blocks_total, "KV blocks leaked"
