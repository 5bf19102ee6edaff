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
from mtp_reference import Reference
from servers import PATIENCE, SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, StateNotFound, Unavailable, Verdict
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

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
    ttl = 2.0
    proc = start_server(mimo_checkpoint, *SERVER_ARGS, "--state-ttl", str(ttl), "--no-reflection")
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
            # A state in use keeps its lease: touch `kept` (an empty prefill is a no-op that
            # renews) until the idle states and the handle are reaped, and a TTL more.
            deadline, reaped = time.monotonic() + PATIENCE, None
            while reaped is None or time.monotonic() < reaped + ttl:
                c.prefill(kept, [], None, 1)
                info = c.info()
                if reaped is None and (info.live_states, info.kv_handles) == (1, 0):
                    reaped = time.monotonic()
                assert time.monotonic() < deadline, "the idle states and the handle outlived it"
                time.sleep(0.1)
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


def test_sigterm_drains_then_frees_everything(mimo_checkpoint) -> None:
    args = (*SERVER_ARGS[:-2], "--grace-period", "600")
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
        # ...and once it is freed the server stops, long before the 600 s grace ends.
        c.free_state(state)
        assert proc.process.wait(timeout=PATIENCE) == 0
    out = "".join(proc.lines) + proc.process.stdout.read()
    assert "freed 0 live states" in out


def test_sigterm_frees_states_left_at_the_end_of_the_grace(mimo_checkpoint) -> None:
    args = (*SERVER_ARGS[:-2], "--grace-period", "1")
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


# How far a bf16 server's log-probabilities may be from the float64 oracle's. The
# default model's logits reach |12|, where bf16 keeps a spacing of 2^-4: storing a
# logit alone moves it by up to 0.031, and log p = l - logsumexp(l) can double that;
# every op before it (the hidden passed on included) rounds to 8 significant bits
# too. One CPU's worst over 36 drafts was 0.058. A draft whose oracle log-probability
# is within this of the top's is a near-tie either token may win; a larger margin
# decides the token.
BF16_LOG_TOL = 0.2


def _oracle_follow(
    ref: Reference, tokens: list[int], hiddens: torch.Tensor, drafts: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The oracle's log-probabilities at each step of a chain whose drafts are given
    (the server's), and the output hidden each step passes on."""
    tokens, hiddens = list(tokens), hiddens.double()
    log_probs, outs = [], []
    for draft in drafts:
        out = ref.rows(tokens, hiddens)[-1]
        log_probs.append(ref.logits(out).log_softmax(-1))
        outs.append(out)
        tokens.append(draft)
        hiddens = torch.cat([hiddens, out[None]])
    return log_probs, outs


def _assert_bf16_chain(proposal, log_probs: list[torch.Tensor]) -> int:
    """Each draft is the oracle's top token or within a near-tie of it, with the
    oracle's probability; returns how many drafts the oracle's margin decided."""
    assert len(proposal.tokens) == len(log_probs)
    decided = 0
    for token, prob, lp in zip(proposal.tokens, proposal.probs, log_probs, strict=True):
        top2 = lp.topk(2).values
        assert lp[token] >= top2[0] - BF16_LOG_TOL, (token, int(lp.argmax()))
        assert abs(torch.tensor(prob).log() - lp[token]) <= BF16_LOG_TOL, (prob, lp[token].exp())
        decided += int(top2[0] - top2[1] > BF16_LOG_TOL)
    return decided


def test_the_embedded_default_model_serves_drafts() -> None:
    """What a newcomer runs first: `mtpdraft serve` with no --model. Its bf16 drafts
    follow the float64 oracle on the embedded checkpoint, over a verdict too."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--port", "0", "--device", "cpu"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ref = Reference(DEFAULT_CHECKPOINT)
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
            assert (info.vocab_size, info.hidden_size) == (256, 384)
            rows = torch.randn(10, info.hidden_size, generator=torch.Generator().manual_seed(0))
            rows = rows.to(torch.bfloat16)  # the oracle reads the same values, in float64
            state = c.alloc_state()
            c.prefill(state, list(range(1, 9)), rows[:8], 1)
            first = c.propose(state, 9, rows[8], 9, 6)
            tokens, hiddens = [*range(1, 10)], rows[:9].double()
            log_probs, outs = _oracle_follow(ref, tokens, hiddens, first.tokens)
            decided = _assert_bf16_chain(first, log_probs)
            # Two drafts accepted: their rows keep the chain's hiddens, then R0 = (20, h).
            second = c.propose(state, 20, rows[9], 12, 4, previous=Verdict(2))
            tokens += [*first.tokens[:2], 20]
            hiddens = torch.cat([hiddens, *(o[None] for o in outs[:2]), rows[9:].double()])
            log_probs, _ = _oracle_follow(ref, tokens, hiddens, second.tokens)
            decided += _assert_bf16_chain(second, log_probs)
            assert decided >= 5  # most drafts are no near-tie: their tokens are checked exactly
            c.after_verify(state, 0)
            assert c.free_state(state)
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0
