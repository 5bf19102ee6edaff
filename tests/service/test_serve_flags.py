"""What each of `mtpdraft serve`'s serving flags changes, seen by a client.

The servers are built in this process the way the command builds them
(cli_server.CliServer), so that a test can hold the engine busy or read the
scheduler's queue; a server per test, since each test's flags differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from cli_server import CliServer, hold_the_engine, serve_args
from drafting import Expected, hiddens, tokens
from mtp_reference import Reference
from safetensors.torch import save_file

from mtpdraft.client import (
    BatchResult,
    DrafterClient,
    ProposeArgs,
    ResourceExhausted,
    Unavailable,
)
from mtpdraft.service import addresses, cli
from mtpdraft.service.addresses import ListenError
from mtpdraft.service.model.synthetic import write_random_checkpoint
from mtpdraft.service.telemetry import Telemetry

SMALL = ("--kv-blocks", "64", "--block-size", "4", "--max-drafts", "8", "--max-batch", "8")


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def serve(mimo_checkpoint: Path):
    """Starts CliServers on the test checkpoint (with SMALL's limits); drains them after."""
    started: list[CliServer] = []

    def start(*argv: str, model: Path = mimo_checkpoint) -> CliServer:
        started.append(CliServer("--model", str(model), *SMALL, *argv))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _draft(address: str, seed: int = 0, k: int = 4):
    """A prompt of 6 rows, then one proposal of K drafts; the state is freed."""
    with DrafterClient(address, timeout=60) as c:
        state = c.alloc_state()
        c.prefill(state, tokens(6, seed), hiddens(6, seed), 1)
        proposal = c.propose(state, 7, hiddens(1, seed + 1)[0], 7, k)
        c.free_state(state)
    return proposal


# --- --model, --device ---------------------------------------------------------------


def test_a_full_target_checkpoint_serves_its_mtp_head(serve, deepseek_checkpoint, tmp_path):
    """Its decoder layers (MLA and MoE here, which the MTP layer may not be) and final
    norm sit beside the MTP layer; only the MTP layer, the embedding and the head are
    read: the drafts are the MTP-only checkpoint's, and a shard of target layers alone
    may even be missing."""
    full = tmp_path / "full"
    shutil.copytree(deepseek_checkpoint, full)
    target = {
        "model.layers.0.self_attn.q_a_proj.weight": torch.randn(8, 64),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(8, 64),
        "model.layers.1.input_layernorm.weight": torch.randn(64),
        "model.norm.weight": torch.randn(64),
    }
    save_file(target, full / "model-target.safetensors")
    index = json.loads((full / "model.safetensors.index.json").read_text())
    index["weight_map"] |= dict.fromkeys(target, "model-target.safetensors")
    (full / "model.safetensors.index.json").write_text(json.dumps(index))

    def drafts(server: CliServer) -> tuple[list[int], list[float]]:
        proposal = _draft(server.address, seed=9)
        return proposal.tokens, proposal.probs

    expected = drafts(serve(model=deepseek_checkpoint))
    assert drafts(serve(model=full)) == expected
    (full / "model-target.safetensors").unlink()
    assert drafts(serve(model=full)) == expected


def test_device_auto_picks_cuda_when_there_is_one_else_the_cpu(mimo_checkpoint) -> None:
    engine = cli.build_engine(serve_args("--model", str(mimo_checkpoint), *SMALL))  # auto
    assert engine.info().device == ("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA device")
def test_device_cuda_without_one_is_refused(mimo_checkpoint) -> None:
    config = serve_args("--model", str(mimo_checkpoint), "--device", "cuda")
    with pytest.raises(SystemExit, match="--device cuda, but no CUDA device is available"):
        cli.build_engine(config)


# --- --host ---------------------------------------------------------------------------


def test_host_binds_that_address_alone(serve) -> None:
    server = serve("--host", "127.0.0.2")
    port = server.server.port
    with DrafterClient(f"127.0.0.2:{port}", timeout=30) as c:
        assert c.info().model_family == "mimo"
    # The same port on another loopback address: nothing listens there.
    with DrafterClient(f"127.0.0.1:{port}", timeout=5) as c, pytest.raises(Unavailable):
        c.info()


def test_unix_socket_serves_there_too(serve, tmp_path) -> None:
    path = tmp_path / "drafter.sock"
    server = serve("--unix-socket", str(path))
    assert path.is_socket()
    assert _draft(f"unix:{path}").tokens == _draft(f"127.0.0.1:{server.server.port}").tokens


def test_a_stale_unix_socket_is_replaced(serve, tmp_path) -> None:
    """A socket file whose server is gone (it was not removed) stands in nobody's way."""
    path = tmp_path / "drafter.sock"
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(path))
    server = serve("--unix-socket", str(path))
    assert _draft(f"unix:{path}").tokens == _draft(f"127.0.0.1:{server.server.port}").tokens


# --- an address in use --------------------------------------------------------------------


def _serve_again(model: Path, *argv: str) -> subprocess.CompletedProcess:
    """`mtpdraft serve ARGV` in a process of its own, which must exit by itself."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(model), "--device", "cpu"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=60)


def _assert_refused(done: subprocess.CompletedProcess, address: str, why: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == f"mtpdraft: cannot listen on {address}: {why}\n"
    assert "listening" not in done.stdout


def test_a_port_in_use_is_refused(serve, mimo_checkpoint) -> None:
    """A second server on a port in use exits at once (gRPC would share the port by
    SO_REUSEPORT, and split the clients' calls, and their states, between the two)."""
    first = serve()
    done = _serve_again(mimo_checkpoint, "--port", str(first.server.port))
    _assert_refused(done, first.address, "the port is in use (another server?)")
    assert len(_draft(first.address).tokens) == 4  # the first serves on


def test_no_grpc_server_can_share_the_port(serve, mimo_checkpoint, monkeypatch) -> None:
    """SO_REUSEPORT is off, so the bind itself fails where the check before it did not
    look (the port taken meanwhile): for a stock gRPC server (SO_REUSEPORT on) and for
    a second DrafterServer."""
    first = serve()
    stock = grpc.server(ThreadPoolExecutor(1))
    with pytest.raises(RuntimeError, match="Failed to bind"):
        stock.add_insecure_port(first.address)
    monkeypatch.setattr(addresses, "check_free", lambda address: None)
    config = serve_args("--model", str(mimo_checkpoint), "--device", "cpu", *SMALL)
    config = dataclasses.replace(config, port=first.server.port)

    async def second() -> None:  # gRPC's aio server is made on an event loop
        cli.build_server(config, cli.build_engine(config), Telemetry())

    with pytest.raises(ListenError, match=f"cannot listen on {first.address}: gRPC could not"):
        asyncio.run(second())


def test_a_live_unix_socket_is_not_replaced(serve, mimo_checkpoint, tmp_path) -> None:
    path = tmp_path / "drafter.sock"
    first = serve("--unix-socket", str(path))
    inode = path.stat().st_ino
    done = _serve_again(mimo_checkpoint, "--port", "0", "--unix-socket", str(path))
    _assert_refused(done, f"unix:{path}", "a server accepts connections on this socket")
    assert path.stat().st_ino == inode
    assert _draft(f"unix:{path}").tokens == _draft(first.address).tokens


def test_a_file_in_the_unix_sockets_place_is_not_replaced(mimo_checkpoint, tmp_path) -> None:
    path = tmp_path / "drafter.sock"
    path.write_text("not a socket")
    done = _serve_again(mimo_checkpoint, "--port", "0", "--unix-socket", str(path))
    _assert_refused(done, f"unix:{path}", "the path exists and is not a socket")
    assert path.read_text() == "not a socket"


# --- --dtype --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bf16")
    return write_random_checkpoint(folder, "mimo", seed=3, dtype=torch.bfloat16)


def _oracle_drafts(checkpoint: Path, seed: int = 0, k: int = 4):
    exp = Expected(Reference(checkpoint))
    exp.add(tokens(6, seed), hiddens(6, seed))
    return exp.propose(7, hiddens(1, seed + 1)[0], k)


def test_dtype_float32_computes_a_bf16_checkpoint_in_float32(serve, bf16_checkpoint) -> None:
    native = serve(model=bf16_checkpoint)
    widened = serve("--dtype", "float32", model=bf16_checkpoint)
    with DrafterClient(native.address) as a, DrafterClient(widened.address) as b:
        assert (a.info().compute_dtype, b.info().compute_dtype) == ("bfloat16", "float32")
    drafts, probs = _oracle_drafts(bf16_checkpoint)
    # In float32 the drafts are the float64 oracle's to float32 precision...
    fp32 = _draft(widened.address)
    assert fp32.tokens == drafts
    assert fp32.probs == pytest.approx(probs, abs=1e-4)
    # ...which the checkpoint's own bfloat16 (3 significant digits) does not reach.
    bf16 = _draft(native.address)
    error = max(abs(p - q) for p, q in zip(bf16.probs, probs, strict=False))
    assert error > 1e-3


# --- --ops ----------------------------------------------------------------------------


def test_ops_selects_the_op_set_and_both_draft_alike(serve) -> None:
    # Without a GPU the Triton kernels run under the interpreter (tests/conftest.py).
    torch_ops, triton_ops = serve("--ops", "torch"), serve("--ops", "triton")
    assert torch_ops.engine.head.ops.name == "torch"
    assert triton_ops.engine.head.ops.name == "triton"
    a, b = _draft(torch_ops.address, seed=5, k=3), _draft(triton_ops.address, seed=5, k=3)
    assert a.tokens == b.tokens
    assert a.probs == pytest.approx(b.probs, abs=1e-4)


# --- --no-cuda-graphs -----------------------------------------------------------------


def test_no_cuda_graphs_reaches_the_engine(mimo_checkpoint, monkeypatch) -> None:
    """On the CPU there are no graphs either way: what the flag changes is the engine's
    config's cuda_graphs (on a GPU, the test below and test_gpu_path.py's)."""
    asked: list[bool] = []
    real = cli.DraftEngine

    def engine(head, config):
        asked.append(config.cuda_graphs)
        return real(head, config)

    monkeypatch.setattr(cli, "DraftEngine", engine)
    model = ("--model", str(mimo_checkpoint), "--device", "cpu", *SMALL)
    cli.build_engine(serve_args(*model))
    cli.build_engine(serve_args(*model, "--no-cuda-graphs"))
    assert asked == [True, False]


@pytest.mark.gpu
def test_no_cuda_graphs_serves_eagerly_on_a_gpu(mimo_checkpoint) -> None:
    model = ("--model", str(mimo_checkpoint), "--device", "cuda", *SMALL)
    graphed = cli.build_engine(serve_args(*model))
    eager = cli.build_engine(serve_args(*model, "--no-cuda-graphs"))
    assert graphed.head._graphs is not None
    assert eager.head._graphs is None


# --- --max-batch ----------------------------------------------------------------------


def test_calls_of_every_kind_from_every_client_share_a_forward_of_max_batch(serve) -> None:
    """While a batch computes, a Propose, a ProposeBatch of two, a stream message and
    another Propose queue up, from three clients: the next forward takes the first
    four requests in arrival order (--max-batch 4), the last waits for the one after."""
    server = serve("--max-batch", "4")
    with (
        DrafterClient(server.address, timeout=60) as a,
        DrafterClient(server.address, timeout=60) as b,
        DrafterClient(server.address, timeout=60) as c,
        ThreadPoolExecutor(5) as pool,
        c.stream() as stream,
    ):
        s = [a.alloc_state() for _ in range(6)]

        def args(i: int) -> tuple:
            return (s[i], 1, hiddens(1, i)[0], 1, 2)

        entered, release = hold_the_engine(server.engine)
        try:
            calls = [pool.submit(a.propose, *args(0))]
            assert entered.wait(30), "the first call never reached the engine"
            queued = [
                (a.propose, args(1)),
                (b.propose_many, ([ProposeArgs(*args(2)), ProposeArgs(*args(3))],)),
                (stream.propose, args(4)),
                (a.propose, args(5)),
            ]
            for n, (call, call_args) in enumerate(queued, start=1):
                calls.append(pool.submit(call, *call_args))  # one at a time: in this order
                wait_until(lambda n=n: server.scheduler.queued == n, what=f"{n} queued")
        finally:
            release.set()
        results = [call.result(60) for call in calls]
        proposals = [
            p for r in results for p in (r.proposals() if isinstance(r, BatchResult) else [r])
        ]
        assert [len(p.tokens) for p in proposals] == [2] * 6
        assert a.info().batch_size_counts == {1: 2, 4: 1}
        for state in s:
            a.free_state(state)


# --- --max-queue ----------------------------------------------------------------------


def test_max_queue_refuses_the_call_past_n_waiting(serve) -> None:
    server = serve("--max-queue", "2")
    with DrafterClient(server.address, timeout=60) as c, ThreadPoolExecutor(4) as pool:
        states = [c.alloc_state() for _ in range(4)]
        entered, release = hold_the_engine(server.engine)

        def propose(i: int):
            return c.propose(states[i], 1, hiddens(1, i)[0], 1, 2)

        try:
            computing = pool.submit(propose, 0)
            assert entered.wait(30), "the first call never reached the engine"
            waiting = [pool.submit(propose, i) for i in (1, 2)]
            wait_until(lambda: server.scheduler.queued == 2, what="two queued calls")
            with pytest.raises(ResourceExhausted) as err:
                c.propose(states[3], 1, hiddens(1, 3)[0], 1, 2, timeout=10)
            assert err.value.reason == "QUEUE_FULL"
            assert "2 calls waiting" in err.value.details
        finally:
            release.set()
        for call in (computing, *waiting):
            assert len(call.result(60).tokens) == 2
        assert c.info().queued_calls == 0
        assert len(c.propose(states[3], 1, hiddens(1, 3)[0], 1, 2).tokens) == 2  # room again
        for state in states:
            c.free_state(state)


# --- --batch-wait-us ------------------------------------------------------------------


def test_batch_wait_holds_a_batch_for_a_verifier_due_back(serve) -> None:
    """B comes back ROUND_TRIP s after each answer; A calls just after B's answer. With a
    wait longer than B's round trip, A's call waits for B's and both run as one batch
    (with the 2 ms default, A would run alone at once)."""
    assert serve().scheduler.batch_wait == pytest.approx(2e-3)  # the default: 2000 us
    server = serve("--batch-wait-us", "60000000")  # 60 s: B's round trip bounds the wait
    round_trip = 2.5
    with DrafterClient(server.address, timeout=60) as c, ThreadPoolExecutor(1) as pool:
        a, b = c.alloc_state(), c.alloc_state()
        c.propose(b, 1, hiddens(1, 1)[0], 1, 1)
        time.sleep(round_trip)  # the scheduler learns B's round trip from this call
        c.propose(b, 2, hiddens(1, 2)[0], 2, 1, previous=0)
        alone = pool.submit(c.propose, a, 1, hiddens(1, 3)[0], 1, 1)
        # A waits in the queue for B (GetInfo reports it) ...
        wait_until(lambda: c.info().queued_calls == 1, timeout=round_trip, what="A queued")
        assert not alone.done()
        c.propose(b, 3, hiddens(1, 4)[0], 3, 1, previous=0)  # ... until B is back
        assert len(alone.result(60).tokens) == 1
        assert c.info().batch_size_counts == {1: 2, 2: 1}
        for state in (a, b):
            c.free_state(state)


# --- --max-message-bytes --------------------------------------------------------------


def test_max_message_bytes_refuses_a_larger_message(serve) -> None:
    server = serve("--max-message-bytes", "20000")
    rows, toks, hid = 100, tokens(100, 7), hiddens(100, 7)  # 100 rows of 256 bytes: 25.6 kB
    with DrafterClient(server.address, timeout=60) as c:
        info = c.info()
        assert info.max_message_bytes == 20000
        state = c.alloc_state()
        with pytest.raises(ResourceExhausted):  # in one message
            c.prefill(state, toks, hid, 1, chunk_bytes=1 << 20)
        assert c.info().kv_blocks_free == info.kv_blocks_free  # refused whole
        # The same rows in messages under the limit.
        assert c.prefill(state, toks, hid, 1, chunk_bytes=8000).num_rows == rows
        c.free_state(state)
