"""The blocking drafter client: ``DrafterClient``.

A thin layer over the generated stub: ``messages`` builds each request and
parses each response, and every ``grpc.RpcError`` is raised as a typed
``DrafterError``. Thread-safe (one channel, shared by all calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc

from . import messages as m
from .errors import from_rpc_error
from .messages import DEFAULT, Timeout
from .security import PemSource, asks_for_security, open_channel
from .stream import ProposeStream
from .tracing import traced_channel
from .types import (
    BatchResult,
    Grammar,
    InstallResult,
    KVHandle,
    PrefillResult,
    Proposal,
    ProposeArgs,
    SamplingParams,
    ServerInfo,
    Verdict,
    VerifyResult,
)
from .wire import Array

_R = TypeVar("_R")


class DrafterClient:
    """Blocking client of the ``mtpdraft.v1.Drafter`` service.

    ``DrafterClient("localhost:50051")`` opens an insecure channel (with the
    given grpc channel ``options``); pass ``channel=`` to use your own (e.g. a
    secure one), which ``close`` then leaves open.

    TLS: ``root_certificates`` (PEM bytes or a file's path; ``tls=True`` alone trusts
    the system's roots) opens a secure channel, and ``private_key`` with
    ``certificate_chain`` present a client certificate (mutual TLS). ``token`` sends
    ``authorization: Bearer <token>`` on every call, as gRPC call credentials; without
    TLS that is possible only to a loopback address or Unix socket (see
    ``mtpdraft.client.security``). ``options`` may carry e.g.
    ``("grpc.ssl_target_name_override", "localhost")``. ``timeout`` is the default
    deadline in seconds of every unary call and Prefill (None: none); each method's
    ``timeout=`` overrides it, None included. A stream (``stream``) has no deadline
    unless its own ``timeout=`` asks for one: a verifier keeps its stream open for its
    whole life.

    ``tracing=True`` traces every call: a client span per call, parented by the
    caller's current span, whose context the server's span joins (see
    ``mtpdraft.client.tracing``: where the application set no tracer provider, one is
    made from the standard OTEL_* variables).

    ``affinity_key`` (e.g. the verifier's engine id) goes with every call as the
    ``x-mtpdraft-affinity`` metadata, by which a proxy or gRPC's ring_hash policy sends all
    of a key's calls to one replica (deploy/README.md); ``keyed`` gives a client of the same
    channel with another key.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        channel: grpc.Channel | None = None,
        tls: bool = False,
        root_certificates: PemSource | None = None,
        private_key: PemSource | None = None,
        certificate_chain: PemSource | None = None,
        token: str | None = None,
        tracing: bool = False,
        affinity_key: str | None = None,
    ) -> None:
        security = dict(
            tls=tls,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            token=token,
        )
        if channel is None:
            if target is None:
                raise ValueError("give a target or a channel")
            channel = open_channel(grpc, target, options, **security)
            self._owns_channel = True
        elif asks_for_security(**security):
            raise ValueError("with channel=, put the credentials and token in the channel")
        else:
            self._owns_channel = False
        if tracing:
            channel = traced_channel(channel)  # closing it closes the channel under it
        self.target = target
        self.timeout = timeout
        self.affinity_key = affinity_key
        self._metadata = m.affinity_metadata(affinity_key)
        self._channel = channel
        self._stub = drafter_pb2_grpc.DrafterStub(channel)

    def keyed(self, affinity_key: str | None) -> DrafterClient:
        """A client of this channel whose calls carry ``affinity_key`` (closing it leaves
        the channel open)."""
        client = DrafterClient(
            channel=self._channel, timeout=self.timeout, affinity_key=affinity_key
        )
        client.target = self.target
        return client

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def close(self) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> DrafterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(
        self, rpc: Callable[..., Any], request: Any, parse: Callable[[Any], _R], timeout: Timeout
    ) -> _R:
        try:
            resp = rpc(
                request, timeout=m.resolve_timeout(timeout, self.timeout), metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return parse(resp)

    def info(self, *, timeout: Timeout = DEFAULT) -> ServerInfo:
        """The server's model shape, limits and live counters."""
        return self._unary(self._stub.GetInfo, m.get_info_request(), m.parse_info, timeout)

    def alloc_state(
        self,
        grammar: Grammar | None = None,
        *,
        sampling: SamplingParams | None = None,
        timeout: Timeout = DEFAULT,
    ) -> int:
        """A new, empty state; returns its id. ``grammar``: what every draft obeys (none by
        default); ``sampling``: how its drafts are chosen (default greedy)."""
        req = m.alloc_state_request(sampling, grammar)
        return self._unary(self._stub.AllocState, req, m.parse_alloc_state, timeout)

    def prefill(
        self,
        state: int,
        tokens: Sequence[int] | Array,
        hiddens: Array | None,
        start_position: int,
        *,
        chunk_bytes: int = m.DEFAULT_CHUNK_BYTES,
        timeout: Timeout = DEFAULT,
    ) -> PrefillResult:
        """Appends committed rows (tokens[i], hiddens[i]) at start_position + i, streamed in
        chunks of at most ``chunk_bytes`` bytes each. All or nothing."""
        chunks = m.prefill_chunks(state, tokens, hiddens, start_position, chunk_bytes=chunk_bytes)
        return self._unary(self._stub.Prefill, chunks, m.parse_prefill, timeout)

    def propose(
        self,
        state: int,
        token: int,
        hidden: Array,
        position: int,
        num_drafts: int,
        *,
        bitmask: Array | None = None,
        min_confidence: float = 0.0,
        previous: Verdict | int | None = None,
        sampling: SamplingParams | None = None,
        draft_cap: int = 0,
        verify_token_cost: float = 0.0,
        step_number: int = 0,
        return_bitmasks: bool = False,
        timeout: Timeout = DEFAULT,
    ) -> Proposal:
        """Up to ``num_drafts`` drafts after ``token`` (its target hidden: ``hidden``, at
        ``position - 1``). ``previous`` first applies the verdict on the pending proposal;
        ``sampling`` changes the state's sampling from this step on. ``num_drafts`` 0
        lets the drafter choose how many, up to ``draft_cap`` (0: the server's
        max_drafts), for the most tokens per verify cost, one more token costing
        ``verify_token_cost`` of a verify step.

        ``step_number`` (increasing with each of the state's steps; 0: none) makes the
        call safe to send again when its outcome is unknown (a deadline, a broken
        connection): the server answers a step it applied as it did, and applies it no
        second time (``recovery.retry_step``). ``return_bitmasks``: for a state with a
        grammar, the answer carries the grammar's bitmask at each draft's position and the
        bonus position (``Proposal.bitmasks``)."""
        req = m.propose_request(
            state,
            token,
            hidden,
            position,
            num_drafts,
            bitmask=bitmask,
            min_confidence=min_confidence,
            previous=previous,
            sampling=sampling,
            draft_cap=draft_cap,
            verify_token_cost=verify_token_cost,
            step_number=step_number,
            return_bitmasks=return_bitmasks,
        )
        return self._unary(self._stub.Propose, req, m.parse_proposal, timeout)

    def propose_batch(
        self,
        state_ids: Array | Sequence[int],
        tokens: Array | Sequence[int],
        positions: Array | Sequence[int],
        hiddens: Array,
        num_drafts: Array | Sequence[int] | int,
        *,
        num_accepted: Array | Sequence[int] | None = None,
        refeed_rows: Array | Sequence[int] | None = None,
        refeed_hiddens: Array | None = None,
        bitmask_rows: Array | Sequence[int] | None = None,
        bitmasks: Array | None = None,
        min_confidence: Array | Sequence[float] | float | None = None,
        sampling: Mapping[int, SamplingParams] | None = None,
        draft_caps: Array | Sequence[int] | int | None = None,
        verify_token_costs: Array | Sequence[float] | float | None = None,
        step_numbers: Array | Sequence[int] | int | None = None,
        return_bitmasks: bool = False,
        timeout: Timeout = DEFAULT,
    ) -> BatchResult:
        """A verifier's whole step for B states in one message, as columns.

        Row i of every column is state_ids[i]'s: its last token, position and target
        hidden (``hiddens`` [B, H]), K (``num_drafts``: B values or one), the verdict on
        its pending proposal (``num_accepted``: B values, -1 for none), its refeed
        (``refeed_rows`` B counts of ``refeed_hiddens`` rows, 0 or num_accepted), its
        bitmask (``bitmask_rows`` B counts of ``bitmasks`` rows, 0 for none),
        min_confidence (B values or one) and step number (``step_numbers``: B values or
        one, as ``propose``'s ``step_number``); ``sampling`` maps rows to their states' new
        sampling parameters; a row asking ``num_drafts`` 0 has the drafter choose its K,
        up to ``draft_caps`` for ``verify_token_costs`` (B values or one). A row that
        fails has its error in ``errors`` and leaves its state unchanged; the other rows
        are answered.
        """
        req = m.batch_request(
            state_ids,
            tokens,
            positions,
            hiddens,
            num_drafts,
            num_accepted=num_accepted,
            refeed_rows=refeed_rows,
            refeed_hiddens=refeed_hiddens,
            bitmask_rows=bitmask_rows,
            bitmasks=bitmasks,
            min_confidence=min_confidence,
            sampling=sampling,
            draft_caps=draft_caps,
            verify_token_costs=verify_token_costs,
            step_numbers=step_numbers,
            return_bitmasks=return_bitmasks,
        )
        return self._batch(req, timeout)

    def propose_many(
        self, requests: Sequence[ProposeArgs], *, timeout: Timeout = DEFAULT
    ) -> BatchResult:
        """``propose_batch`` of states given one by one: row i is ``requests[i]``'s
        (``result.proposals()`` gives each row's Proposal, raising a failed row's error)."""
        return self._batch(m.batch_request_of(requests), timeout)

    def _batch(self, req: pb.ProposeBatchRequest, timeout: Timeout) -> BatchResult:
        def parse(resp: pb.ProposeBatchResponse) -> BatchResult:
            return m.parse_batch(resp, req.state_ids)

        return self._unary(self._stub.ProposeBatch, req, parse, timeout)

    def after_verify(
        self,
        state: int,
        num_accepted: int,
        *,
        refeed_hiddens: Array | None = None,
        timeout: Timeout = DEFAULT,
    ) -> VerifyResult:
        """The verifier accepted the first ``num_accepted`` drafts of the pending proposal."""
        req = m.after_verify_request(state, num_accepted, refeed_hiddens=refeed_hiddens)
        return self._unary(self._stub.AfterVerify, req, m.parse_after_verify, timeout)

    def take_kv(self, state: int, *, timeout: Timeout = DEFAULT) -> KVHandle:
        """Detaches the state's KV into a handle; the state stays allocated and empty."""
        req = m.take_kv_request(state)
        return self._unary(self._stub.TakeKV, req, m.parse_take_kv, timeout)

    def install_kv(
        self, state: int, handle: KVHandle | int, *, timeout: Timeout = DEFAULT
    ) -> InstallResult:
        """Installs a handle's KV into an empty state, consuming the handle."""
        req = m.install_kv_request(state, handle)
        return self._unary(self._stub.InstallKV, req, m.parse_install_kv, timeout)

    def export_kv_chunks(
        self,
        handle: KVHandle | int,
        *,
        max_chunk_bytes: int | None = None,
        keep_handle: bool = False,
        timeout: Timeout = DEFAULT,
    ) -> Iterator[pb.KVChunk]:
        """ExportKV's chunks as they come: pass them to another server's ``import_kv``
        without holding them all. The handle is freed once the last chunk is read,
        unless ``keep_handle``."""
        req = m.export_kv_request(handle, max_chunk_bytes, keep_handle)
        call = self._stub.ExportKV(
            req, timeout=m.resolve_timeout(timeout, self.timeout), metadata=self._metadata
        )

        def chunks() -> Iterator[pb.KVChunk]:
            try:
                yield from call
            except grpc.RpcError as e:
                raise from_rpc_error(e) from e

        return chunks()

    def export_kv(
        self,
        handle: KVHandle | int,
        *,
        max_chunk_bytes: int | None = None,
        keep_handle: bool = False,
        timeout: Timeout = DEFAULT,
    ) -> bytes:
        """A KV handle's rows as bytes (with the model's fingerprint, the dtype and the KV
        shape), for ``import_kv`` on another server of the same model. The handle is freed
        once exported, unless ``keep_handle``."""
        return m.kv_bytes(
            self.export_kv_chunks(
                handle, max_chunk_bytes=max_chunk_bytes, keep_handle=keep_handle, timeout=timeout
            )
        )

    def import_kv(
        self, state: int, kv: bytes | Iterable[pb.KVChunk], *, timeout: Timeout = DEFAULT
    ) -> InstallResult:
        """Installs exported KV (``export_kv``'s bytes, or ``export_kv_chunks``' chunks) into
        an empty state: all or nothing."""
        chunks = m.import_kv_chunks(state, kv)
        return self._unary(self._stub.ImportKV, chunks, m.parse_import_kv, timeout)

    def stream(self, *, timeout: float | None = None) -> ProposeStream:
        """The hot path: a ProposeStream, one message and one answer per verify step
        (``step`` takes the arguments of ``propose_batch``; ``propose`` those of
        ``propose``, a batch of one). No deadline unless ``timeout`` (seconds, for the
        whole stream) is given: the client's default timeout is not applied."""
        return ProposeStream(self._stub, timeout, self._metadata)

    def free_state(self, state: int, *, timeout: Timeout = DEFAULT) -> bool:
        """Releases the state; returns whether it existed. Idempotent."""
        req = m.free_state_request(state)
        return self._unary(self._stub.FreeState, req, m.parse_free_state, timeout)
