"""RemoteBackend and BackendHost over a real unix-socket link, without gRPC around them."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from drafting import hiddens
from servers import PATIENCE, small_engine, until

from mtpdraft.client import messages as m
from mtpdraft.service.backend import LocalBackend
from mtpdraft.service.backend_host import BackendHost
from mtpdraft.service.engine import errors
from mtpdraft.service.remote_backend import RemoteBackend


async def _linked(engine, tmp_path):
    """(remote, local, host): a RemoteBackend connected to a LocalBackend on `engine`."""
    local = LocalBackend(engine, batch_wait=0)
    host = BackendHost(local, lambda *_: None, lambda _: None)
    path = str(tmp_path / "engine.sock")
    await host.listen(path)
    local.start()
    remote = RemoteBackend(lambda _: None, lambda: None)
    await remote.connect(path)
    return remote, local, host


async def _close(local: LocalBackend, host: BackendHost) -> None:
    await host.close()
    await local.close()


def test_errors_and_results_cross_the_link_unchanged(mimo_checkpoint, tmp_path) -> None:
    async def run() -> None:
        engine = small_engine(mimo_checkpoint)
        remote, local, host = await _linked(engine, tmp_path)
        try:
            assert not await remote.free_state(12345)
            with pytest.raises(errors.NotFound) as missing:
                await remote.take_kv(12345)
            assert missing.value.reason == "STATE_NOT_FOUND"
            state = await remote.alloc_state("test")
            assert state in engine.states and engine.states[state].owner == "test"
            chunks = m.prefill_chunks(state, [1, 2, 3], hiddens(3, 1), 1)

            async def stream():
                for chunk in chunks:
                    yield chunk

            rows = await remote.prefill(stream())
            assert (rows.num_rows, rows.next_position) == (3, 4)
            request = m.propose_request(state, 4, hiddens(1, 2)[0], 4, 3)
            future, timing = remote.propose([request], None)
            (proposal,) = await future
            assert proposal.state_id == state and len(proposal.tokens) == 3
            assert timing.queued_ns <= timing.started_ns <= timing.done_ns
            assert timing.batch_requests == 1
            unknown = m.propose_request(state + 1, 4, hiddens(1, 2)[0], 4, 3)
            future, _ = remote.propose([unknown], None, batch=True)
            with pytest.raises(errors.NotFound) as missing:
                await future
            assert missing.value.reason == "STATE_NOT_FOUND"
            # A malformed tensor is refused on this side: nothing reaches the engine.
            batches = dict(local.scheduler.batch_sizes)
            bad = m.propose_request(state, 4, hiddens(1, 2)[0], 4, 3)
            bad.hidden.ClearField("data")
            with pytest.raises(errors.InvalidArgument) as invalid:
                remote.propose([bad], None, batch=True)
            assert invalid.value.field == "hidden" and invalid.value.message.startswith(
                "requests[0]."
            )
            assert not remote._open
            assert dict(local.scheduler.batch_sizes) == batches
            assert await remote.free_state(state)
        finally:
            await _close(local, host)

    asyncio.run(run())


def test_a_fast_prefill_stream_is_held_back_while_the_engine_is_busy(
    mimo_checkpoint, tmp_path
) -> None:
    """The front end takes a chunk from its client only when the engine asks for more."""

    async def run() -> None:
        engine = small_engine(mimo_checkpoint)
        remote, local, host = await _linked(engine, tmp_path)
        state = engine.alloc_state()
        busy = threading.Event()
        begin = engine.begin_prefill

        def slow_begin(*args):
            busy.wait(PATIENCE)
            return begin(*args)

        engine.begin_prefill = slow_begin
        rows = hiddens(20, 3)
        pulled = 0

        async def fast_client():
            nonlocal pulled
            for chunk in m.prefill_chunks(state, list(range(20)), rows, 1, chunk_bytes=600):
                pulled += 1
                yield chunk

        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            prefill = asyncio.ensure_future(remote.prefill(fast_client()))
            await until(lambda: pulled >= 1, "the first chunk")
            # Ten times as long as the first took (half a second at least): no more than
            # the two a fast client may have in flight are taken meanwhile.
            await asyncio.sleep(max(0.5, 10 * (loop.time() - started)))
            assert pulled <= 3, f"{pulled} chunks taken from the client while the engine waits"
            busy.set()
            result = await prefill
            assert result.num_rows == 20 and pulled > 3
        finally:
            busy.set()
            await _close(local, host)

    torch.manual_seed(0)
    asyncio.run(run())


def test_a_cancelled_propose_leaves_the_engine_queue(mimo_checkpoint, tmp_path) -> None:
    async def run() -> None:
        engine = small_engine(mimo_checkpoint)
        remote, local, host = await _linked(engine, tmp_path)
        state = engine.alloc_state()
        hold = threading.Event()
        local.runner.submit(hold.wait, PATIENCE)  # the engine thread is busy: calls stay queued
        try:
            request = m.propose_request(state, 4, hiddens(1, 4)[0], 1, 2)
            future, _ = remote.propose([request], None)
            # Queued, then taken into a batch that waits for the thread.
            await until(lambda: len(host.calls) == 1, "the link")
            (calls,) = host.calls.values()
            await until(lambda: calls.open and not local.scheduler.queued, "the call taken")
            assert len(calls.open) == 1
            future.cancel()
            await until(lambda: not calls.open, "the engine process to drop the cancelled call")
            hold.set()
            await local.scheduler.settle(PATIENCE)
            assert engine.states[state].pending is None, "the cancelled call was drafted"
        finally:
            hold.set()
            await _close(local, host)

    asyncio.run(run())
