"""The clients' core: every call's arguments and documentation, its request, its answer.

Each client method is written once, here, as a function of its arguments (``timeout``
among them) returning a ``Call``: the RPC, the request message, how the answer is read.
``DrafterClient`` and ``AsyncDrafterClient`` make their methods of these functions
(``base.method_of``) and differ only in how they send a Call: on the blocking stub or on
the grpc.aio one.

Everything here is pure: Python / numpy / torch values in, protobuf messages
out, and back. Argument checks happen here, eagerly, so a bad argument raises
``TypeError`` / ``ValueError`` in the caller before any RPC starts (including
Prefill, whose chunks are then produced lazily while the stream is sent).
"""

from __future__ import annotations

import enum
import functools
import json
import operator
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeAlias, TypeVar

import numpy as np

from mtpdraft.v1 import drafter_pb2 as pb

from . import wire
from .errors import error_from_value
from .kv_blob import kv_bytes, kv_chunks
from .proto_record import record_values
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

#: Default size bound of one PrefillChunk message, in bytes.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

# Worst-case bytes of a PrefillChunk besides its token varints and hidden data:
# state_id 1+10, start_position 1+10, tokens tag+len 1+5, hiddens tag+len 1+5,
# dtype 1+1, shape tag+len 1+1 and two int64 varints 10+10, data tag+len 1+5.
CHUNK_OVERHEAD = 64

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class _Default(enum.Enum):
    TOKEN = 0


#: Sentinel for "use the client's default timeout" (None means no deadline).
DEFAULT = _Default.TOKEN
Timeout: TypeAlias = "float | Literal[_Default.TOKEN] | None"

_R = TypeVar("_R")


@dataclass(frozen=True)
class Call(Generic[_R]):
    """One call of a client method, ready to send, whichever client sends it: the stub's
    method (``rpc``), its request (a message; for a client stream, an iterator of them),
    how its answer is read (``parse``; of all its messages for a ``streamed`` answer, None
    where they are handed on as they come) and its deadline (DEFAULT: the client's)."""

    rpc: str
    request: Any
    parse: Callable[[Any], _R] | None
    timeout: Timeout = DEFAULT
    streamed: bool = False  # the server answers with a stream of messages


#: The request metadata a proxy (or gRPC's ring_hash policy) routes by: every call with one
#: key reaches one replica (deploy/README.md).
AFFINITY_HEADER = "x-mtpdraft-affinity"
Metadata: TypeAlias = "tuple[tuple[str, str], ...] | None"


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    """The per-call timeout when given, else the client's default."""
    return default if timeout is DEFAULT else timeout


def _uint64(value: Any, name: str) -> int:
    v = operator.index(value)
    if not 0 <= v < 2**64:
        raise ValueError(f"{name} {v} is not a uint64")
    return v


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    v = operator.index(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v} is out of range [{lo}, {hi}]")
    return v


def _tokens(tokens: Any) -> list[int]:
    if wire.is_torch_tensor(tokens):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"tokens: expected integers, got {arr.dtype}")
    out = arr.astype(np.int64).tolist() if arr.size else []
    if out and (min(out) < _INT32_MIN or max(out) > _INT32_MAX):
        raise ValueError("tokens: a token does not fit in int32")
    return out


def affinity_metadata(key: str | None) -> Metadata:
    """The metadata naming an affinity key (None: no key, no metadata)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"affinity_key: expected a str, got {type(key).__name__}")
    if not key or not key.isascii() or not key.isprintable() or key != key.strip():
        raise ValueError(
            f"affinity_key {key!r}: must be non-empty printable ASCII without surrounding spaces"
        )
    return ((AFFINITY_HEADER, key),)


# The kinds of Grammar, as the wire's Grammar message names them.
GRAMMAR_KINDS = ("json_schema", "ebnf", "regex", "structural_tag")


# --- requests --------------------------------------------------------------------------------


def alloc_state_request(
    sampling: SamplingParams | None = None, grammar: Grammar | None = None
) -> pb.AllocStateRequest:
    req = pb.AllocStateRequest()
    if sampling is not None:
        sampling_message(sampling, into=req.sampling)
    if grammar is not None:
        req.grammar.CopyFrom(grammar_message(grammar))
    return req


def grammar_message(grammar: Grammar) -> pb.Grammar:
    """A Grammar message: exactly one kind, a dict source as JSON text."""
    given = {k: getattr(grammar, k) for k in GRAMMAR_KINDS if getattr(grammar, k) is not None}
    if len(given) != 1:
        raise ValueError(f"grammar: exactly one of {', '.join(GRAMMAR_KINDS)}, got {len(given)}")
    ((kind, source),) = given.items()
    return pb.Grammar(**{kind: source if isinstance(source, str) else json.dumps(source)})


def sampling_message(
    sampling: SamplingParams, into: pb.SamplingParams | None = None
) -> pb.SamplingParams:
    """A SamplingParams message (its values are the server's to check)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
    msg = pb.SamplingParams() if into is None else into
    msg.temperature = float(sampling.temperature)
    msg.top_k = _int(sampling.top_k, "sampling.top_k", _INT32_MIN, _INT32_MAX)
    msg.top_p = float(sampling.top_p)
    msg.min_p = float(sampling.min_p)
    msg.seed = _uint64(sampling.seed, "sampling.seed")
    return msg


def get_info_request() -> pb.GetInfoRequest:
    return pb.GetInfoRequest()


def prefill_chunks(*args: Any, **kwargs: Any) -> Iterator[pb.PrefillChunk]:
    """``prefill``'s PrefillChunk stream (its arguments), checked now, made lazily."""
    return prefill(*args, **kwargs).request


def verdict_message(previous: Verdict | int, into: pb.Verdict | None = None) -> pb.Verdict:
    """A Verdict message from a :class:`Verdict` (or a bare accepted count); ``into``: a
    request's Verdict field, filled in place (see ``wire.tensor_from_raw``)."""
    if not isinstance(previous, Verdict):
        previous = Verdict(num_accepted=previous)
    msg = pb.Verdict() if into is None else into
    msg.num_accepted = _accepted(previous)
    if previous.refeed_hiddens is not None:
        refeed = previous.refeed_hiddens
        wire.encode_hidden(refeed, ndims=(1, 2), name="refeed_hiddens", into=msg.refeed_hiddens)
    return msg


def propose_request(*args: Any, **kwargs: Any) -> pb.ProposeRequest:
    """``propose``'s ProposeRequest (its arguments)."""
    return propose(*args, **kwargs).request


def _column(values: Any, name: str, dtype: type, size: int, *, one_for_all: bool) -> list:
    """A column's values as a list: ``size`` of them, or one for all where allowed."""
    arr = np.asarray(values.detach().cpu() if wire.is_torch_tensor(values) else values)
    arr = arr.reshape(-1) if arr.ndim == 0 else arr
    if arr.ndim != 1 or len(arr) not in ((size, 1) if one_for_all else (size,)):
        want = f"{size} values" + (" or one" if one_for_all else "")
        raise ValueError(f"{name}: expected {want}, got shape {arr.shape}")
    if np.issubdtype(dtype, np.integer):
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integers, got {arr.dtype}")
        info = np.iinfo(dtype)
        # A column whose type fits (a verifier's own int32 / int64 arrays) needs no scan.
        fits = np.can_cast(arr.dtype, dtype)
        if arr.size and not fits and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"{name}: a value does not fit in {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False).tolist()


def batch_request(*args: Any, **kwargs: Any) -> pb.ProposeBatchRequest:
    """``propose_batch``'s ProposeBatchRequest (its arguments): a ProposeStream's message."""
    return propose_batch(*args, **kwargs).request


def _sampling_rows(req: pb.ProposeBatchRequest, sampling: Mapping[int, SamplingParams]) -> None:
    """The rows of ``sampling`` in order, each with its parameters."""
    for row in sorted(sampling):
        req.sampling_rows.append(_int(row, "sampling row", 0, len(req.state_ids) - 1))
        sampling_message(sampling[row], into=req.sampling.add())


def batch_request_of(
    requests: Sequence[ProposeArgs], return_bitmasks: bool = False
) -> pb.ProposeBatchRequest:
    """A ProposeBatchRequest from states given one by one: row i is ``requests[i]``'s (their
    hiddens stacked, their refeeds and bitmasks one after another, with each one's row
    count)."""
    if not requests:
        raise ValueError("requests: expected at least one")
    hiddens, refeeds, masks = _Rows("hidden"), _Rows("refeed_hiddens"), _Rows("bitmask")
    req = pb.ProposeBatchRequest(return_bitmasks=return_bitmasks)
    accepted, refeed_rows, mask_rows = [], [], []
    for i, a in enumerate(requests):
        if not isinstance(a, ProposeArgs):
            raise TypeError(f"requests[{i}]: expected ProposeArgs, got {type(a).__name__}")
        req.state_ids.append(_uint64(a.state, "state"))
        req.tokens.append(_int(a.token, "token", _INT32_MIN, _INT32_MAX))
        req.positions.append(_int(a.position, "position", -(2**63), 2**63 - 1))
        req.num_drafts.append(_int(a.num_drafts, "num_drafts", _INT32_MIN, _INT32_MAX))
        req.min_confidence.append(float(a.min_confidence))
        req.step_numbers.append(_uint64(a.step_number, "step_number"))
        if hiddens.add(a.hidden, wire.HIDDEN_DTYPES, i) != 1:
            raise ValueError(f"requests[{i}].hidden: expected one row, [H] or [1, H]")
        verdict = a.previous
        if verdict is not None and not isinstance(verdict, Verdict):
            verdict = Verdict(verdict)  # a bare accepted count
        accepted.append(-1 if verdict is None else _accepted(verdict))
        refeed = None if verdict is None else verdict.refeed_hiddens
        refeed_rows.append(0 if refeed is None else refeeds.add(refeed, wire.HIDDEN_DTYPES, i))
        mask_rows.append(0 if a.bitmask is None else masks.add(a.bitmask, wire.BITMASK_DTYPES, i))
    hiddens.into(req.hiddens)
    _sampling_rows(req, {i: a.sampling for i, a in enumerate(requests) if a.sampling})
    if any(a.num_drafts == 0 for a in requests):
        req.draft_caps.extend(_int(a.draft_cap, "draft_cap", 0, _INT32_MAX) for a in requests)
        req.verify_token_costs.extend(float(a.verify_token_cost) for a in requests)
    if any(n >= 0 for n in accepted):
        req.num_accepted.extend(accepted)
    if any(refeed_rows):
        req.refeed_rows.extend(refeed_rows)
        refeeds.into(req.refeed_hiddens)
    if any(mask_rows):
        req.bitmask_rows.extend(mask_rows)
        masks.into(req.bitmasks)
    if not any(req.min_confidence):
        del req.min_confidence[:]
    if not any(req.step_numbers):
        del req.step_numbers[:]
    return req


def _accepted(verdict: Verdict) -> int:
    return _int(verdict.num_accepted, "num_accepted", 0, _INT32_MAX)


class _Rows:
    """One tensor column's rows, gathered state by state (each state's [n, X], or one row
    flat, [X]). Rows of different dtypes meet in float32, exact for all; bitmask rows of
    fewer words are padded with zero words, which allow no token, as the server reads them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[tuple[np.ndarray, int]] = []

    def add(self, x: wire.Array, allowed: frozenset[int], i: int) -> int:
        """Adds ``requests[i]``'s rows; returns how many."""
        name = f"requests[{i}].{self.name}"
        raw, dtype = wire.as_raw(x, allowed=allowed, ndims=(1, 2), name=name)
        rows = raw
        if raw.ndim == 1:  # one row flat, or none
            rows = raw.reshape(1, -1) if raw.size else raw.reshape(0, 0)
        if len(rows):
            self.parts.append((rows, dtype))
        return len(rows)

    def into(self, msg: pb.Tensor) -> None:
        """The rows as one tensor, written into ``msg``."""
        dtypes = {dtype for _, dtype in self.parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else wire.FP32
        width = max(rows.shape[1] for rows, _ in self.parts)
        parts = [self._fitted(rows, d, dtype, width) for rows, d in self.parts]
        wire.tensor_from_raw(parts[0] if len(parts) == 1 else np.concatenate(parts), dtype, msg)

    def _fitted(self, rows: np.ndarray, dtype: int, to: int, width: int) -> np.ndarray:
        """Raw rows of ``dtype`` as raw rows of ``to`` (``dtype`` or float32), ``width`` wide."""
        if dtype != to:
            floats = (rows.astype(np.uint32) << 16).view(np.float32) if dtype == wire.BF16 else rows
            rows = floats.astype(wire.STORAGE[to])
        if rows.shape[1] == width:
            return rows
        if to != wire.INT32:
            raise ValueError(f"{self.name}: rows of {rows.shape[1]} and of {width} values")
        return np.pad(rows, ((0, 0), (0, width - rows.shape[1])))


def after_verify_request(
    state: int, num_accepted: int, *, refeed_hiddens: wire.Array | None = None
) -> pb.AfterVerifyRequest:
    return pb.AfterVerifyRequest(
        state_id=_uint64(state, "state"),
        verdict=verdict_message(Verdict(num_accepted, refeed_hiddens)),
    )


def take_kv_request(state: int) -> pb.TakeKVRequest:
    return pb.TakeKVRequest(state_id=_uint64(state, "state"))


def install_kv_request(state: int, handle: KVHandle | int) -> pb.InstallKVRequest:
    handle_id = handle.handle_id if isinstance(handle, KVHandle) else handle
    return pb.InstallKVRequest(
        state_id=_uint64(state, "state"), handle_id=_uint64(handle_id, "handle")
    )


def free_state_request(state: int) -> pb.FreeStateRequest:
    return pb.FreeStateRequest(state_id=_uint64(state, "state"))


def export_kv_request(
    handle: KVHandle | int, max_chunk_bytes: int | None, keep_handle: bool
) -> pb.ExportKVRequest:
    handle_id = handle.handle_id if isinstance(handle, KVHandle) else handle
    size = 0 if max_chunk_bytes is None else _int(max_chunk_bytes, "max_chunk_bytes", 1, 2**62)
    return pb.ExportKVRequest(
        handle_id=_uint64(handle_id, "handle"), max_chunk_bytes=size, keep_handle=bool(keep_handle)
    )


def import_kv_chunks(state: int, kv: bytes | Iterable[pb.KVChunk]) -> Iterator[pb.KVChunk]:
    """ImportKV's requests: the exported chunks, the first set to name ``state``."""
    state_id = _uint64(state, "state")
    chunks = kv_chunks(kv)

    def named() -> Iterator[pb.KVChunk]:
        for i, chunk in enumerate(chunks):
            if i == 0:
                chunk.state_id = state_id
            yield chunk

    return named()


def import_kv_chunks_async(
    state: int, chunks: AsyncIterable[pb.KVChunk]
) -> AsyncIterator[pb.KVChunk]:
    """``import_kv_chunks`` of an asyncio client's ExportKV chunks, as they come."""
    state_id = _uint64(state, "state")

    async def named() -> AsyncIterator[pb.KVChunk]:
        first = True
        async for chunk in chunks:
            if first:
                chunk.state_id, first = state_id, False
            yield chunk

    return named()


# --- responses -------------------------------------------------------------------------------


def parse_alloc_state(resp: pb.AllocStateResponse) -> int:
    return int(resp.state_id)


def parse_prefill(resp: pb.PrefillResponse) -> PrefillResult:
    return PrefillResult(num_rows=int(resp.num_rows), next_position=int(resp.next_position))


def parse_proposal(resp: pb.Proposal) -> Proposal:
    q_ids = q_probs = None
    if resp.q_support:
        shape = (len(resp.tokens), resp.q_support)
        q_ids = np.array(resp.q_ids[:], np.int32).reshape(shape).tolist()
        q_probs = np.array(resp.q_probs[:], np.float32).reshape(shape).tolist()
    return Proposal(
        state_id=int(resp.state_id),
        tokens=[int(t) for t in resp.tokens],
        probs=[float(p) for p in resp.probs],
        confidence=float(resp.confidence),
        first_position=int(resp.first_position),
        q_ids=q_ids,
        q_probs=q_probs,
        bitmasks=wire.decode(resp.bitmasks) if resp.HasField("bitmasks") else None,
    )


def parse_batch(resp: pb.ProposeBatchResponse, state_ids: Sequence[int]) -> BatchResult:
    """A ProposeBatchResponse (to a request naming ``state_ids``) as numpy columns; the
    failed rows' errors by row."""
    size = len(resp.draft_counts)
    q_ids = q_probs = None
    if resp.q_support:
        shape = (size, resp.width, resp.q_support)
        q_ids = np.array(resp.q_ids[:], np.int32).reshape(shape)
        q_probs = np.array(resp.q_probs[:], np.float32).reshape(shape)
    return BatchResult(
        state_ids=np.array(list(state_ids), dtype=np.uint64),
        drafts=np.array(resp.drafts[:], dtype=np.int32).reshape(size, resp.width),
        probs=np.array(resp.probs[:], dtype=np.float32).reshape(size, resp.width),
        counts=np.array(resp.draft_counts[:], dtype=np.int32),
        confidences=np.array(resp.confidences[:], dtype=np.float32),
        first_positions=np.array(resp.first_positions[:], dtype=np.int64),
        errors={e.row: error_from_value(e.error) for e in resp.errors},
        q_ids=q_ids,
        q_probs=q_probs,
        bitmasks=_batch_bitmasks(resp),
    )


def _batch_bitmasks(resp: pb.ProposeBatchResponse) -> dict[int, np.ndarray]:
    """Each row's grammar bitmasks, where the answer has any."""
    if not resp.HasField("bitmasks"):
        return {}
    words = wire.decode(resp.bitmasks).reshape(-1, resp.bitmasks.shape[-1])
    ends = np.cumsum(resp.bitmask_rows)
    return {
        row: words[end - n : end]
        for row, (n, end) in enumerate(zip(resp.bitmask_rows, ends, strict=True))
        if n
    }


def parse_after_verify(resp: pb.AfterVerifyResponse) -> VerifyResult:
    return VerifyResult(num_rows=int(resp.num_rows), next_position=int(resp.next_position))


def parse_take_kv(resp: pb.TakeKVResponse) -> KVHandle:
    return KVHandle(
        handle_id=int(resp.handle_id),
        num_rows=int(resp.num_rows),
        ttl_seconds=float(resp.ttl_seconds),
    )


def parse_install_kv(resp: pb.InstallKVResponse) -> InstallResult:
    return InstallResult(num_rows=int(resp.num_rows), next_position=int(resp.next_position))


def parse_free_state(resp: pb.FreeStateResponse) -> bool:
    return bool(resp.existed)


def parse_import_kv(resp: pb.ImportKVResponse) -> InstallResult:
    return InstallResult(num_rows=int(resp.num_rows), next_position=int(resp.next_position))


def parse_info(resp: pb.GetInfoResponse) -> ServerInfo:
    return ServerInfo(**record_values(resp))


# --- calls: each client method once (its arguments, its documentation, its Call) -------------


def info(*, timeout: Timeout = DEFAULT) -> Call[ServerInfo]:
    """The server's model shape, limits and live counters."""
    return Call("GetInfo", get_info_request(), parse_info, timeout)


def alloc_state(
    grammar: Grammar | None = None,
    *,
    sampling: SamplingParams | None = None,
    timeout: Timeout = DEFAULT,
) -> Call[int]:
    """A new, empty state; returns its id. ``grammar``: what every draft obeys (none by
    default); ``sampling``: how its drafts are chosen (default greedy)."""
    return Call("AllocState", alloc_state_request(sampling, grammar), parse_alloc_state, timeout)


def prefill(
    state: int,
    tokens: Sequence[int] | Array,
    hiddens: Array | None,
    start_position: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout: Timeout = DEFAULT,
) -> Call[PrefillResult]:
    """Appends committed rows (tokens[i], hiddens[i]) at start_position + i, streamed in
    chunks of at most ``chunk_bytes`` bytes each. All or nothing."""
    # Checked now, made as they are sent: each chunk whole rows, at most chunk_bytes
    # serialized, naming state_id and start_position; no rows, one empty chunk.
    state_id = _uint64(state, "state")
    start = _int(start_position, "start_position", -(2**63), 2**63 - 1)
    toks = _tokens(tokens)
    chunk_bytes = operator.index(chunk_bytes)
    if hiddens is None:
        if toks:
            raise ValueError("hiddens: required when tokens is not empty")
        chunks = iter([pb.PrefillChunk(state_id=state_id, start_position=start)])
        return Call("Prefill", chunks, parse_prefill, timeout)
    raw, dtype = wire.as_raw(hiddens, allowed=wire.HIDDEN_DTYPES, ndims=(1, 2), name="hiddens")
    if raw.ndim == 1:  # one row may come flat, as the server takes it
        raw = raw.reshape(1, -1)
    n = raw.shape[0]
    if n != len(toks):
        raise ValueError(f"hiddens has {n} rows but there are {len(toks)} tokens")
    token_bytes = 10 if toks and min(toks) < 0 else 5  # varint of a negative int32 is 10 bytes
    row_bytes = raw.shape[1] * wire.ITEMSIZE[dtype] + token_bytes
    rows_per_chunk = (chunk_bytes - CHUNK_OVERHEAD) // row_bytes
    if rows_per_chunk < 1:
        raise ValueError(
            f"chunk_bytes {chunk_bytes} cannot hold one row ({row_bytes + CHUNK_OVERHEAD} bytes)"
        )

    def rows() -> Iterator[pb.PrefillChunk]:
        for lo in range(0, max(n, 1), rows_per_chunk):
            hi = min(lo + rows_per_chunk, n)
            chunk = pb.PrefillChunk(
                state_id=state_id,
                start_position=start,
                tokens=toks[lo:hi],
                # Lets the server tell a stream cut short from a finished one.
                total_rows=n if lo == 0 else 0,
            )
            wire.tensor_from_raw(raw[lo:hi], dtype, into=chunk.hiddens)
            yield chunk

    return Call("Prefill", rows(), parse_prefill, timeout)


def propose(
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
) -> Call[Proposal]:
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

    req = pb.ProposeRequest(return_bitmasks=return_bitmasks)
    req.state_id = _uint64(state, "state")
    req.token = _int(token, "token", _INT32_MIN, _INT32_MAX)
    wire.encode_hidden(hidden, ndims=(1, 2), name="hidden", into=req.hidden)
    req.position = _int(position, "position", -(2**63), 2**63 - 1)
    req.num_drafts = _int(num_drafts, "num_drafts", _INT32_MIN, _INT32_MAX)
    req.min_confidence = float(min_confidence)
    if bitmask is not None:
        wire.encode_bitmask(bitmask, into=req.bitmask)
    if previous is not None:
        verdict_message(previous, into=req.previous)
    if sampling is not None:
        sampling_message(sampling, into=req.sampling)
    req.draft_cap = _int(draft_cap, "draft_cap", _INT32_MIN, _INT32_MAX)
    req.verify_token_cost = float(verify_token_cost)
    req.step_number = _uint64(step_number, "step_number")
    return Call("Propose", req, parse_proposal, timeout)


def propose_batch(
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
) -> Call[BatchResult]:
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

    ids = np.asarray(state_ids.detach().cpu() if wire.is_torch_tensor(state_ids) else state_ids)
    size = len(ids.reshape(-1))
    req = pb.ProposeBatchRequest(
        state_ids=_column(ids, "state_ids", np.uint64, size, one_for_all=False),
        tokens=_column(tokens, "tokens", np.int32, size, one_for_all=False),
        positions=_column(positions, "positions", np.int64, size, one_for_all=False),
        num_drafts=_column(num_drafts, "num_drafts", np.int32, size, one_for_all=True),
        return_bitmasks=return_bitmasks,
    )
    wire.encode_hidden(hiddens, ndims=(1, 2), name="hiddens", into=req.hiddens)
    if num_accepted is not None:
        req.num_accepted.extend(
            _column(num_accepted, "num_accepted", np.int32, size, one_for_all=False)
        )
    # Counts and their tensor go as given: the server says when they do not fit together.
    if refeed_rows is not None:
        req.refeed_rows.extend(
            _column(refeed_rows, "refeed_rows", np.int32, size, one_for_all=False)
        )
    if refeed_hiddens is not None:
        wire.encode_hidden(
            refeed_hiddens, ndims=(1, 2), name="refeed_hiddens", into=req.refeed_hiddens
        )
    if bitmask_rows is not None:
        rows = _column(bitmask_rows, "bitmask_rows", np.int32, size, one_for_all=False)
        req.bitmask_rows.extend(rows)
    if bitmasks is not None:
        allowed = wire.BITMASK_DTYPES
        wire.encode(bitmasks, allowed=allowed, ndims=(1, 2), name="bitmasks", into=req.bitmasks)
    if min_confidence is not None:
        req.min_confidence.extend(
            _column(min_confidence, "min_confidence", np.float32, size, one_for_all=True)
        )
    if sampling:
        _sampling_rows(req, sampling)
    if draft_caps is not None:
        req.draft_caps.extend(_column(draft_caps, "draft_caps", np.int32, size, one_for_all=True))
    if verify_token_costs is not None:
        costs = _column(
            verify_token_costs, "verify_token_costs", np.float32, size, one_for_all=True
        )
        req.verify_token_costs.extend(costs)
    if step_numbers is not None:
        req.step_numbers.extend(
            _column(step_numbers, "step_numbers", np.uint64, size, one_for_all=True)
        )
    return batch_call(req, timeout)


def propose_many(
    requests: Sequence[ProposeArgs], *, timeout: Timeout = DEFAULT
) -> Call[BatchResult]:
    """``propose_batch`` of states given one by one: row i is ``requests[i]``'s
    (``result.proposals()`` gives each row's Proposal, raising a failed row's error)."""
    req = batch_request_of(requests)
    return batch_call(req, timeout)


def batch_call(req: pb.ProposeBatchRequest, timeout: Timeout = DEFAULT) -> Call[BatchResult]:
    """The ProposeBatch Call of a request made otherwise (``batch_request``, or by hand)."""
    return Call(
        "ProposeBatch", req, functools.partial(parse_batch, state_ids=req.state_ids), timeout
    )


def after_verify(
    state: int,
    num_accepted: int,
    *,
    refeed_hiddens: Array | None = None,
    timeout: Timeout = DEFAULT,
) -> Call[VerifyResult]:
    """The verifier accepted the first ``num_accepted`` drafts of the pending proposal."""
    req = after_verify_request(state, num_accepted, refeed_hiddens=refeed_hiddens)
    return Call("AfterVerify", req, parse_after_verify, timeout)


def take_kv(state: int, *, timeout: Timeout = DEFAULT) -> Call[KVHandle]:
    """Detaches the state's KV into a handle; the state stays allocated and empty."""
    return Call("TakeKV", take_kv_request(state), parse_take_kv, timeout)


def install_kv(
    state: int, handle: KVHandle | int, *, timeout: Timeout = DEFAULT
) -> Call[InstallResult]:
    """Installs a handle's KV into an empty state, consuming the handle."""
    return Call("InstallKV", install_kv_request(state, handle), parse_install_kv, timeout)


def export_kv_chunks(
    handle: KVHandle | int,
    *,
    max_chunk_bytes: int | None = None,
    keep_handle: bool = False,
    timeout: Timeout = DEFAULT,
) -> Call[None]:
    """ExportKV's chunks as they come: pass them to another server's ``import_kv``
    without holding them all. The handle is freed once the last chunk is read,
    unless ``keep_handle``."""
    req = export_kv_request(handle, max_chunk_bytes, keep_handle)
    return Call("ExportKV", req, None, timeout, streamed=True)  # handed on, not read here


def export_kv(
    handle: KVHandle | int,
    *,
    max_chunk_bytes: int | None = None,
    keep_handle: bool = False,
    timeout: Timeout = DEFAULT,
) -> Call[bytes]:
    """A KV handle's rows as bytes (with the model's fingerprint, the dtype and the KV
    shape), for ``import_kv`` on another server of the same model. The handle is freed
    once exported, unless ``keep_handle``."""
    req = export_kv_request(handle, max_chunk_bytes, keep_handle)
    return Call("ExportKV", req, kv_bytes, timeout, streamed=True)


def import_kv(
    state: int,
    kv: bytes | Iterable[pb.KVChunk] | AsyncIterable[pb.KVChunk],
    *,
    timeout: Timeout = DEFAULT,
) -> Call[InstallResult]:
    """Installs exported KV (``export_kv``'s bytes, or ``export_kv_chunks``' chunks) into
    an empty state: all or nothing."""
    if isinstance(kv, AsyncIterable):  # an asyncio client's chunks, as they come
        return Call("ImportKV", import_kv_chunks_async(state, kv), parse_import_kv, timeout)
    return Call("ImportKV", import_kv_chunks(state, kv), parse_import_kv, timeout)


def free_state(state: int, *, timeout: Timeout = DEFAULT) -> Call[bool]:
    """Releases the state; returns whether it existed. Idempotent."""
    return Call("FreeState", free_state_request(state), parse_free_state, timeout)
