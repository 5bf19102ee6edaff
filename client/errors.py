"""Typed exceptions for the drafter's gRPC status codes.

Every client call turns a ``grpc.RpcError`` into a :class:`DrafterError`
subclass chosen by status code, carrying the machine-readable details the
server attaches through gRPC rich errors (``grpc-status-details-bin``): the
``google.rpc.ErrorInfo`` reason and, for INVALID_ARGUMENT, the offending field
from ``google.rpc.BadRequest``. Client-side argument checks raise plain
``TypeError`` / ``ValueError`` before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mtpdraft.v1 import drafter_pb2 as pb

DETAILS_KEY = "grpc-status-details-bin"


class DrafterError(Exception):
    """A failed drafter RPC.

    Attributes:
      code: the ``grpc.StatusCode``.
      details: the status message.
      reason: ``google.rpc.ErrorInfo.reason`` when the server sent one, else None.
      domain: ``google.rpc.ErrorInfo.domain`` ("mtpdraft.v1"), else None.
      metadata: ``google.rpc.ErrorInfo.metadata`` (empty when absent).
      field: ``google.rpc.BadRequest.field_violations[0].field``, else None.
      status: the whole ``google.rpc.Status`` when the server sent one, else None.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        reason: str | None = None,
        domain: str | None = None,
        metadata: dict[str, str] | None = None,
        field: str | None = None,
        status: status_pb2.Status | None = None,
    ) -> None:
        self.code = code
        self.details = details
        self.reason = reason
        self.domain = domain
        self.metadata = dict(metadata or {})
        self.field = field
        self.status = status
        text = f"{code.name}: {details}"
        extra = [f"{k}={v}" for k, v in (("reason", reason), ("field", field)) if v]
        if extra:
            text += f" ({', '.join(extra)})"
        super().__init__(text)


class StateNotFound(DrafterError):
    """NOT_FOUND: unknown (or expired) state, or unknown KV handle."""


NotFound = StateNotFound


class StateLost(StateNotFound):
    """NOT_FOUND, reason STATE_LOST: the state's KV is gone (its replica restarted or is
    gone, the call reached another replica, or its lease expired). Allocate a new state and
    prefill it again from the verifier's own tokens and hiddens
    (``mtpdraft.client.recovery.reprefill``), or import its exported KV."""


#: The reason of a state whose KV is gone (see StateLost).
STATE_LOST = "STATE_LOST"


class InvalidArgument(DrafterError):
    """INVALID_ARGUMENT: malformed tensor, bad token / position / K; see ``.field``."""


class FailedPrecondition(DrafterError):
    """FAILED_PRECONDITION: the call does not fit the state's step."""


class ResourceExhausted(DrafterError):
    """RESOURCE_EXHAUSTED: no free KV blocks or state slots."""


class Unavailable(DrafterError):
    """UNAVAILABLE: the server is draining or unreachable."""


class DeadlineExceeded(DrafterError):
    """DEADLINE_EXCEEDED: the call's timeout ran out."""


class DrafterRpcError(DrafterError):
    """Any other status code (INTERNAL, CANCELLED, UNKNOWN, ...)."""


_BY_CODE: dict[grpc.StatusCode, type[DrafterError]] = {
    grpc.StatusCode.NOT_FOUND: StateNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def status_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` in trailing metadata, or None (absent or unparsable)."""
    for key, value in metadata or ():
        if key == DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(bytes(value))
            except DecodeError:  # a corrupt detail must not hide the status code
                return None
    return None


def _rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    if isinstance(err, grpc.aio.AioRpcError):
        return status_from_metadata(err.trailing_metadata())
    if not callable(getattr(err, "trailing_metadata", None)):
        return None
    try:
        return rpc_status.from_call(err)
    except (ValueError, DecodeError):  # disagrees with the call, or corrupt: best effort
        return status_from_metadata(err.trailing_metadata())


def error_from_status(
    code: grpc.StatusCode, details: str, status: status_pb2.Status | None = None
) -> DrafterError:
    """The typed exception for a status code, message and optional rich status."""
    kwargs: dict[str, Any] = {"status": status}
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and "reason" not in kwargs:
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            kwargs.update(
                reason=info.reason or None,
                domain=info.domain or None,
                metadata=dict(info.metadata),
            )
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and "field" not in kwargs:
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                kwargs["field"] = bad.field_violations[0].field or None
    return _error_class(code, kwargs.get("reason"))(code, details, **kwargs)


def _error_class(code: grpc.StatusCode, reason: str | None) -> type[DrafterError]:
    if code == grpc.StatusCode.NOT_FOUND and reason == STATE_LOST:
        return StateLost
    return _BY_CODE.get(code, DrafterRpcError)


def from_rpc_error(err: grpc.RpcError) -> DrafterError:
    """Maps a sync or asyncio ``grpc.RpcError`` to its typed :class:`DrafterError`."""
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    details = (details_fn() if callable(details_fn) else None) or str(err)
    return error_from_status(code, details, _rich_status(err))


class _TypedErrors:
    """``with TYPED_ERRORS:`` raises a ``grpc.RpcError`` from within as its typed
    :class:`DrafterError` (a class, not a generator: it stands on every call's path)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, err: BaseException | None, trace: object) -> bool:
        if isinstance(err, grpc.RpcError):
            raise from_rpc_error(err) from err
        return False


TYPED_ERRORS = _TypedErrors()


def error_from_value(error: pb.Error) -> DrafterError:
    """The typed exception for an error carried as a value (a failed ProposeBatch row, or a
    ProposeStream message that failed as a whole)."""
    code = _CODE_BY_VALUE.get(error.code, grpc.StatusCode.UNKNOWN)
    return _error_class(code, error.reason or None)(
        code,
        error.message,
        reason=error.reason or None,
        domain="mtpdraft.v1",
        field=error.field or None,
    )


_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
