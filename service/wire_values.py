"""Propose requests read off the wire into plain values, checked, without torch (and a
ProposeColumns answer built from the engine's proposals).

A gRPC front-end process reads each ProposeRequest here, so that a malformed
tensor is refused where it arrived, and hands the engine process tuples of ints
and bytes, which pickle at a third of a protobuf message's cost, with each
hidden's NaN/inf check done already: work taken off the engine process, whose
one GIL the forward and every stream's message share. `wire.py` turns these
values into the engine's tensors.

The NaN/inf flag is for a process of its own only. Next to the engine thread it
costs more than it saves: numpy lets go of the GIL for arrays past 500 elements,
so the event loop must win it back from the busy engine thread (2.7 us a row
alone, 7.7 us beside a spinning thread on a 2-core CPU). In one
H200 run (one process, 64 Go streams, alternating) flagging here filled batches
of 40 and 54 on average against 60 with the engine checking each batch's hiddens
together (14.1k and 18.4k drafts/s against 17.5k and 19.6k); in the engine
process before 4 front ends, 21.6k and 22.3k against 19.3k and 20.5k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mtpdraft.v1 import drafter_pb2 as pb

from .engine.errors import InvalidArgument
from .engine.types import Proposal

ITEMSIZE = {pb.DTYPE_BF16: 2, pb.DTYPE_FP16: 2, pb.DTYPE_FP32: 4, pb.DTYPE_INT32: 4}
HIDDEN_DTYPES = (pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32)
# No real tensor here has a dimension past 2**31; an empty tensor's other
# dimensions could otherwise be anything, up to sizes torch cannot represent.
_MAX_DIM = 2**31 - 1
# An IEEE float is NaN or inf exactly when its exponent bits are all set: (the
# same-sized unsigned integer, little-endian as on the wire; those bits, of that
# type, which takes a row of 4096 from 3.5 to 2.7 us against a Python int). The
# engine's torch check reads the same bits (engine/validation.py, _EXPONENT_BITS).
_EXPONENT_BITS = {
    pb.DTYPE_BF16: (np.dtype("<u2"), np.uint16(0x7F80)),
    pb.DTYPE_FP16: (np.dtype("<u2"), np.uint16(0x7C00)),
    pb.DTYPE_FP32: (np.dtype("<u4"), np.uint32(0x7F800000)),
}


class RawTensor(NamedTuple):
    """A tensor as the wire gave it: its DType, shape and little-endian bytes."""

    dtype: int
    shape: tuple[int, ...]
    data: bytearray  # writable, so the engine's tensor can use it as it is
    finite: bool | None = None  # a float tensor: free of NaN and inf


class RawVerdict(NamedTuple):
    num_accepted: int
    refeed_hiddens: RawTensor | None


class RawPropose(NamedTuple):
    state_id: int
    token: int
    hidden: RawTensor
    position: int
    num_drafts: int
    bitmask: RawTensor | None
    min_confidence: float
    previous: RawVerdict | None


def read_tensor(msg: pb.Tensor, field: str, allowed: tuple[int, ...]) -> RawTensor:
    """The tensor's values, its dtype and byte count checked; INVALID_ARGUMENT when malformed."""
    if msg.dtype not in allowed:
        names = ", ".join(pb.DType.Name(d) for d in allowed)
        raise InvalidArgument(
            f"{field}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in ITEMSIZE else msg.dtype} "
            f"is not accepted here (expected one of {names})",
            reason="BAD_DTYPE",
            field=field,
        )
    shape = tuple(msg.shape)
    if any(not 0 <= d <= _MAX_DIM for d in shape):
        raise InvalidArgument(
            f"{field}: shape {list(shape)} has a dimension outside [0, {_MAX_DIM}]",
            reason="BAD_SHAPE",
            field=field,
        )
    data = msg.data  # each read of a bytes field builds a new bytes object
    expected = math.prod(shape) * ITEMSIZE[msg.dtype]
    if len(data) != expected:
        raise InvalidArgument(
            f"{field}: {len(data)} bytes of data, but shape {list(shape)} of "
            f"{pb.DType.Name(msg.dtype)} needs {expected}",
            reason="BAD_BYTE_COUNT",
            field=field,
        )
    # A copy (bytearray): the engine gets a writable buffer that no message's memory backs.
    return RawTensor(msg.dtype, shape, bytearray(data))


def read_hiddens(msg: pb.Tensor, field: str, flag_finite: bool) -> RawTensor:
    """A Propose's float tensor (a row or a few); `flag_finite`: with whether it is free
    of NaN and inf."""
    raw = read_tensor(msg, field, HIDDEN_DTYPES)
    if not flag_finite:
        return raw
    if not raw.data:
        return raw._replace(finite=True)
    as_int, exponent = _EXPONENT_BITS[raw.dtype]
    # The masked values are at most the mask: one of them equal to it is NaN or inf.
    masked = np.bitwise_and(np.frombuffer(raw.data, dtype=as_int), exponent)
    return raw._replace(finite=bool(masked.max() != exponent))


def read_bitmask(msg: pb.Tensor) -> RawTensor:
    return read_tensor(msg, "bitmask", (pb.DTYPE_INT32,))


def read_verdict(msg: pb.Verdict, field: str, flag_finite: bool) -> RawVerdict:
    refeed = None
    if msg.HasField("refeed_hiddens"):
        refeed = read_hiddens(msg.refeed_hiddens, f"{field}.refeed_hiddens", flag_finite)
    return RawVerdict(msg.num_accepted, refeed)


def read_propose(msg: pb.ProposeRequest, flag_finite: bool) -> RawPropose:
    if not msg.HasField("hidden"):
        raise InvalidArgument("hidden: required", reason="MISSING_FIELD", field="hidden")
    return RawPropose(
        state_id=msg.state_id,
        token=msg.token,
        hidden=read_hiddens(msg.hidden, "hidden", flag_finite),
        position=msg.position,
        num_drafts=msg.num_drafts,
        bitmask=read_bitmask(msg.bitmask) if msg.HasField("bitmask") else None,
        min_confidence=msg.min_confidence,
        previous=(
            read_verdict(msg.previous, "previous", flag_finite)
            if msg.HasField("previous")
            else None
        ),
    )


def read_proposes(
    requests: Sequence[pb.ProposeRequest], batch: bool, flag_finite: bool
) -> list[RawPropose]:
    """One call's requests; a ProposeBatch's errors name the request's index."""
    if not batch:
        return [read_propose(m, flag_finite) for m in requests]
    read = []
    for i, msg in enumerate(requests):
        try:
            read.append(read_propose(msg, flag_finite))
        except InvalidArgument as err:
            err.message = f"requests[{i}].{err.message}"
            raise
    return read


# Which column a per-state request's field comes from, for the errors of a row.
COLUMN_OF_FIELD = {
    "state_id": "state_ids",
    "requests": "state_ids",
    "token": "tokens",
    "position": "positions",
    "hidden": "hiddens",
    "num_drafts": "num_drafts",
    "bitmask": "bitmasks",
    "min_confidence": "min_confidence",
    "previous.num_accepted": "num_accepted",
    "previous.refeed_hiddens": "refeed_hiddens",
}


def columns_answer(
    request_id: int, width: int, results: list[Proposal | pb.Error]
) -> pb.ColumnsResponse:
    """Each row's proposal, or its error (an Error value), as a ColumnsResponse."""
    size = len(results)
    drafts = np.full((size, width), -1, dtype=np.int32)
    probs = np.zeros((size, width), dtype=np.float32)
    counts = np.zeros(size, dtype=np.int32)
    confidences = np.zeros(size, dtype=np.float32)
    first_positions = np.zeros(size, dtype=np.int64)
    failed = []
    for i, result in enumerate(results):
        if isinstance(result, pb.Error):
            failed.append(pb.RowError(row=i, error=result))
            continue
        n = len(result.tokens)
        drafts[i, :n], probs[i, :n], counts[i] = result.tokens, result.probs, n
        confidences[i], first_positions[i] = result.confidence, result.first_position
    return pb.ColumnsResponse(
        request_id=request_id,
        width=width,
        drafts=drafts.ravel().tolist(),
        probs=probs.ravel().tolist(),
        draft_counts=counts.tolist(),
        confidences=confidences.tolist(),
        first_positions=first_positions.tolist(),
        errors=failed,
    )
