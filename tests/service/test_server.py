"""The server around the engine: health, reflection, leases, draining, the CLI."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from drafting import hiddens
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from servers import SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, StateNotFound, Unavailable

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_reports_serving(server) -> None:
    assert health_of(server.address) == SERVING
    assert health_of(server.address, "mtpdraft.v1.Drafter") == SERVING


def test_reflection_lists_the_services(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"mtpdraft.v1.Drafter", "grpc.health.v1.Health"} <= services


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_leases_free_idle_states_and_untaken_handles(mimo_checkpoint) -> None:
    proc = start_server(mimo_checkpoint, *SERVER_ARGS, "--state-ttl", "1", "--no-reflection")
    try:
        with DrafterClient(proc.address, timeout=10) as c:
            idle = c.alloc_state()
            c.prefill(idle, [1, 2, 3, 4, 5], hiddens(5, 1), 1)
            donor = c.alloc_state()
            c.prefill(donor, [1, 2, 3], hiddens(3, 2), 1)
            c.take_kv(donor)
            kept = c.alloc_state()
            info = c.info()
            assert (info.live_states, info.kv_handles) == (3, 1)
            assert info.kv_blocks_free < info.kv_blocks_total
            # A state in use keeps its lease: touch `kept` every 0.3 s across the TTL.
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                c.prefill(kept, [], None, 1)  # an empty prefill is a no-op that renews
                time.sleep(0.3)
            info = c.info()
            assert (info.live_states, info.kv_handles) == (1, 0)
            assert info.kv_blocks_free == info.kv_blocks_total
            with pytest.raises(StateNotFound):
                c.propose(idle, 1, hiddens(1, 3), 6, 2)
            assert c.free_state(kept)
            # Reflection was switched off.
            with grpc.insecure_channel(proc.address) as channel, pytest.raises(grpc.RpcError):
                ProtoReflectionDescriptorDatabase(channel).get_services()
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("front_ends", ["0", "2"], ids=["one-process", "2-front-ends"])
def test_sigterm_drains_then_frees_everything(mimo_checkpoint, front_ends: str) -> None:
    args = (*SERVER_ARGS[:-2], "--grace-period", "30", "--front-ends", front_ends)
    proc = start_server(mimo_checkpoint, *args)
    with DrafterClient(proc.address, timeout=10) as c:
        state = c.alloc_state()
        c.prefill(state, [1, 2, 3], hiddens(3, 4), 1)
        proc.process.send_signal(signal.SIGTERM)
        wait_until(lambda: c.info().draining)
        assert health_of(proc.address) != SERVING
        with pytest.raises(Unavailable) as err:
            c.alloc_state()
        assert err.value.reason == "DRAINING"
        # A live state finishes its work during the grace period...
        c.propose(state, 4, hiddens(1, 5), 4, 3)
        c.after_verify(state, 3)
        # ...and once it is freed the server stops well before the 30 s grace ends.
        started = time.monotonic()
        c.free_state(state)
        assert proc.process.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
    out = "".join(proc.lines) + proc.process.stdout.read()
    assert "freed 0 live states" in out


@pytest.mark.parametrize("front_ends", ["0", "2"], ids=["one-process", "2-front-ends"])
def test_sigterm_frees_states_left_at_the_end_of_the_grace(
    mimo_checkpoint, front_ends: str
) -> None:
    args = (*SERVER_ARGS[:-2], "--grace-period", "1", "--front-ends", front_ends)
    proc = start_server(mimo_checkpoint, *args)
    with DrafterClient(proc.address, timeout=10) as c:
        for _ in range(2):
            c.prefill(c.alloc_state(), [1, 2], hiddens(2, 6), 1)
    proc.process.send_signal(signal.SIGTERM)
    assert proc.process.wait(timeout=15) == 0
    assert "freed 2 live states" in proc.process.stdout.read()


def test_cli_names_a_broken_checkpoint(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(tmp_path), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no *.safetensors files" in done.stderr


def test_the_embedded_default_model_serves_drafts() -> None:
    """What a newcomer runs first: `mtpdraft serve` with no --model."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--port", "0", "--device", "cpu"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = None
        for line in process.stdout:
            if "listening on" in line:
                address = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
                break
        assert address, "the server did not start"
        with DrafterClient(address, timeout=30) as c:
            info = c.info()
            assert (info.model_family, info.compute_dtype) == ("mimo", "bfloat16")
            state = c.alloc_state()
            prompt = torch.randn(8, info.hidden_size).to(torch.bfloat16)
            c.prefill(state, list(range(1, 9)), prompt, 1)
            proposal = c.propose(state, 9, prompt[-1], 9, 4)
            assert len(proposal.tokens) == 4
            assert all(0 <= t < info.vocab_size for t in proposal.tokens)
            assert all(0 < p <= 1 for p in proposal.probs)
            assert c.free_state(state)
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0
