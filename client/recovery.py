"""When a state's KV is gone, or must move: re-prefill it, or move it to another server;
and when a step's outcome is unknown: send it again.

A state lives in one replica's memory. When that replica dies or restarts, or the hash
ring sends its key elsewhere, a call for the state fails with ``StateLost`` (NOT_FOUND,
reason STATE_LOST). The verifier holds what the drafter needs to rebuild it: the
sequence's committed tokens and its target hiddens. ``reprefill`` allocates a new state
(on the replica the key now reaches) and prefills it with those rows; the verifier then
proposes again, without a verdict (the lost proposal's verdict is in the rows).

    try:
        p = client.propose(state, token, hidden, position, k, previous=verdict)
    except StateLost:
        state = reprefill(client, tokens[1:position], hiddens[: position - 1])
        p = client.propose(state, token, hidden, position, k)

Rows prefilled are committed rows: where the lost state held speculative rows (accepted
drafts without refeed), the rebuilt one holds the target's hiddens instead, so its drafts
can differ slightly; with refeed on every verdict they are the same.

``move_state`` hands a state to another server without a re-prefill (a draining replica's
states): TakeKV and ExportKV on the source, AllocState and ImportKV on the destination.

A step whose outcome the verifier did not learn (a deadline passed, the connection broke:
``is_ambiguous``) may have been applied all the same. Numbered (``step_number``, growing
with each of the state's steps), it is safe to send again as it was: the server answers a
step it applied with the proposal it made, and applies it no second time. ``retry_step``
does so:

    step += 1
    p = retry_step(lambda: client.propose(state, token, hidden, position, k,
                                          previous=verdict, step_number=step))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, TypeVar

import grpc

from .errors import DrafterError, StateLost
from .messages import DEFAULT, Timeout
from .wire import Array

if TYPE_CHECKING:
    from .async_client import AsyncDrafterClient
    from .sync_client import DrafterClient

T = TypeVar("T")

# The codes of a call that may have been applied although it failed: its deadline passed
# (while it computed, or in a stopped replica's socket), or its connection broke.
AMBIGUOUS = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


def is_state_lost(err: BaseException) -> bool:
    """Whether a call failed because its state's KV is gone (re-prefill it)."""
    return isinstance(err, StateLost)


def is_ambiguous(err: BaseException) -> bool:
    """Whether a failed call may have been applied all the same (a deadline, a broken
    connection): a numbered step is then sent again as it was. A drain's refusal is no
    such failure: it was not applied, and will not be."""
    return isinstance(err, DrafterError) and err.code in AMBIGUOUS and err.reason != "DRAINING"


def retry_step(call: Callable[[], T], *, attempts: int = 3, backoff: float = 0.1) -> T:
    """``call()``, a numbered step sent as it was each time, again while its outcome is
    unknown (``is_ambiguous``): at most ``attempts`` times in all, ``backoff`` seconds
    apart, doubling; then its last error. The server applies a numbered step once: a retry
    of one it applied is answered with the proposal it made then."""
    _check_attempts(attempts)
    for attempt in range(attempts - 1):
        try:
            return call()
        except DrafterError as err:
            if not is_ambiguous(err):
                raise
        time.sleep(backoff * 2**attempt)
    return call()


async def retry_step_async(
    call: Callable[[], Awaitable[T]], *, attempts: int = 3, backoff: float = 0.1
) -> T:
    """``retry_step`` with an asyncio client's call."""
    _check_attempts(attempts)
    for attempt in range(attempts - 1):
        try:
            return await call()
        except DrafterError as err:
            if not is_ambiguous(err):
                raise
        await asyncio.sleep(backoff * 2**attempt)
    return await call()


def _check_attempts(attempts: int) -> None:
    if attempts < 1:
        raise ValueError(f"attempts: {attempts}; a call is sent once at least")


def reprefill(
    client: DrafterClient,
    tokens: Sequence[int] | Array,
    hiddens: Array | None,
    *,
    start_position: int = 1,
    timeout: Timeout = DEFAULT,
) -> int:
    """A new state holding the committed rows (tokens[i], hiddens[i]) from
    ``start_position`` (a state's first row, token x1 with hidden h0, is at 1); the state
    is freed again if the Prefill fails. Returns its id; the next Propose is at
    ``start_position + len(tokens)``."""
    state = client.alloc_state(timeout=timeout)
    try:
        client.prefill(state, tokens, hiddens, start_position, timeout=timeout)
    except BaseException:
        _free_quietly(client, state)
        raise
    return state


async def reprefill_async(
    client: AsyncDrafterClient,
    tokens: Sequence[int] | Array,
    hiddens: Array | None,
    *,
    start_position: int = 1,
    timeout: Timeout = DEFAULT,
) -> int:
    """``reprefill`` with an asyncio client."""
    state = await client.alloc_state(timeout=timeout)
    try:
        await client.prefill(state, tokens, hiddens, start_position, timeout=timeout)
    except BaseException:
        with suppress(DrafterError):
            await client.free_state(state)
        raise
    return state


def move_state(
    source: DrafterClient,
    destination: DrafterClient,
    state: int,
    *,
    free_source: bool = True,
    timeout: Timeout = DEFAULT,
) -> int:
    """Moves a state's KV to a new state on ``destination`` (a server of the same model
    and dtype) and returns the new state's id; the source state is freed (unless
    ``free_source``: then it keeps its KV, a copy). The state must have no proposal
    awaiting its verdict (apply it with AfterVerify first).

    All or nothing: if the import fails (another model, no room), the source state holds
    its KV as before and the new state is freed. The KV is exported with its handle kept
    and installed back into the source state afterwards, so a failure at any point
    leaves the source whole."""
    handle = source.take_kv(state, timeout=timeout)
    moved = None
    try:
        moved = destination.alloc_state(timeout=timeout)
        chunks = _Relay(source.export_kv_chunks(handle, keep_handle=True, timeout=timeout))
        try:
            destination.import_kv(moved, chunks, timeout=timeout)
        except DrafterError:
            chunks.raise_failure()  # the export's own error explains the import's
            raise
    except BaseException:
        if moved is not None:
            _free_quietly(destination, moved)
        with suppress(DrafterError):  # the source gone too? The first error says why.
            source.install_kv(state, handle, timeout=timeout)  # the source as it was
        raise
    # Done: the handle back into the source state, then freed with it. The source may be
    # going away; the KV lives on at the destination.
    with suppress(DrafterError):
        source.install_kv(state, handle, timeout=timeout)
        if free_source:
            source.free_state(state, timeout=timeout)
    return moved


async def move_state_async(
    source: AsyncDrafterClient,
    destination: AsyncDrafterClient,
    state: int,
    *,
    free_source: bool = True,
    timeout: Timeout = DEFAULT,
) -> int:
    """``move_state`` with asyncio clients."""
    handle = await source.take_kv(state, timeout=timeout)
    moved = None
    try:
        moved = await destination.alloc_state(timeout=timeout)
        chunks = _AsyncRelay(source.export_kv_chunks(handle, keep_handle=True, timeout=timeout))
        try:
            await destination.import_kv(moved, chunks, timeout=timeout)
        except DrafterError:
            chunks.raise_failure()
            raise
    except BaseException:
        with suppress(DrafterError):
            if moved is not None:
                await destination.free_state(moved)
        with suppress(DrafterError):
            await source.install_kv(state, handle, timeout=timeout)
        raise
    with suppress(DrafterError):
        await source.install_kv(state, handle, timeout=timeout)
        if free_source:
            await source.free_state(state, timeout=timeout)
    return moved


def _free_quietly(client: DrafterClient, state: int) -> None:
    with suppress(DrafterError):
        client.free_state(state)


class _Relay:
    """Chunks from one call to another, keeping the first call's error: gRPC reports an
    error raised by a request iterator only as the second call's cancellation."""

    def __init__(self, chunks: Iterator) -> None:
        self._chunks, self.failure = chunks, None

    def __iter__(self) -> Iterator:
        try:
            yield from self._chunks
        except DrafterError as err:
            self.failure = err
            raise

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


class _AsyncRelay:
    def __init__(self, chunks: AsyncIterator) -> None:
        self._chunks, self.failure = chunks, None

    async def __aiter__(self) -> AsyncIterator:
        try:
            async for chunk in self._chunks:
                yield chunk
        except DrafterError as err:
            self.failure = err
            raise

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure
