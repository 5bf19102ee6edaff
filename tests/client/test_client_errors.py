"""grpc.RpcError (sync and asyncio) -> typed DrafterError, with rich-status details."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, status_pb2

from mtpdraft.client import (
    DeadlineExceeded,
    DrafterError,
    DrafterRpcError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StateNotFound,
    Unavailable,
    from_rpc_error,
)
from mtpdraft.client.errors import DETAILS_KEY


class FakeCall(grpc.RpcError):
    """What a sync stub raises: an RpcError that is also a grpc.Call (duck-typed)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing


def sync_error(status: status_pb2.Status | None, code: grpc.StatusCode, msg: str) -> FakeCall:
    trailing = [(DETAILS_KEY, status.SerializeToString())] if status is not None else []
    return FakeCall(code, msg, [("x-other", "1"), *trailing])


def aio_error(
    status: status_pb2.Status | None, code: grpc.StatusCode, msg: str
) -> grpc.aio.AioRpcError:
    trailing = [(DETAILS_KEY, status.SerializeToString())] if status is not None else []
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(("x-other", "1"), *trailing), msg
    )


MAKERS = [sync_error, aio_error]


@pytest.mark.parametrize("make", MAKERS, ids=["sync", "aio"])
def test_invalid_argument_with_error_info_and_bad_request(make_status: Any, make: Any) -> None:
    code, msg = grpc.StatusCode.INVALID_ARGUMENT, "hidden has 2 bytes, want 8192"
    err = from_rpc_error(
        make(make_status(code, msg, reason="BAD_TENSOR", field="hidden"), code, msg)
    )
    assert type(err) is InvalidArgument
    assert isinstance(err, DrafterError)
    assert err.code is code and err.details == msg
    assert err.reason == "BAD_TENSOR" and err.domain == "mtpdraft.v1"
    assert err.field == "hidden" and err.metadata == {"state_id": "7"}
    assert err.status is not None and err.status.code == code_pb2.INVALID_ARGUMENT
    assert "INVALID_ARGUMENT" in str(err) and "BAD_TENSOR" in str(err) and "hidden" in str(err)


@pytest.mark.parametrize("make", MAKERS, ids=["sync", "aio"])
@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, StateNotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, DrafterRpcError),
        (grpc.StatusCode.CANCELLED, DrafterRpcError),
        (grpc.StatusCode.UNKNOWN, DrafterRpcError),
    ],
)
def test_code_maps_to_class(
    make_status: Any, make: Any, code: grpc.StatusCode, cls: type[DrafterError]
) -> None:
    err = from_rpc_error(make(make_status(code, "m", reason="R"), code, "m"))
    assert type(err) is cls and err.code is code and err.reason == "R" and err.field is None


@pytest.mark.parametrize("make", MAKERS, ids=["sync", "aio"])
def test_plain_status_without_details(make: Any) -> None:
    err = from_rpc_error(make(None, grpc.StatusCode.NOT_FOUND, "unknown state 5"))
    assert type(err) is StateNotFound and NotFound is StateNotFound
    assert err.details == "unknown state 5"
    assert err.reason is None and err.field is None and err.status is None
    assert err.metadata == {}


def test_sync_status_that_disagrees_with_the_call_still_gives_details(make_status: Any) -> None:
    status = make_status(grpc.StatusCode.NOT_FOUND, "other text", reason="STATE_NOT_FOUND")
    err = from_rpc_error(sync_error(status, grpc.StatusCode.NOT_FOUND, "unknown state 5"))
    assert type(err) is StateNotFound
    assert err.details == "unknown state 5" and err.reason == "STATE_NOT_FOUND"


@pytest.mark.parametrize("make", MAKERS, ids=["sync", "aio"])
def test_corrupt_details_keep_the_code(make: Any) -> None:
    err = make(None, grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks")
    if isinstance(err, FakeCall):
        err._trailing = ((DETAILS_KEY, b"\xff\xff\xff"),)
    else:
        err = grpc.aio.AioRpcError(
            err.code(),
            grpc.aio.Metadata(),
            grpc.aio.Metadata((DETAILS_KEY, b"\xff\xff\xff")),
            err.details(),
        )
    mapped = from_rpc_error(err)
    assert type(mapped) is ResourceExhausted and mapped.reason is None


def test_error_that_is_not_a_call() -> None:
    err = from_rpc_error(grpc.RpcError("boom"))
    assert type(err) is DrafterRpcError and err.code is grpc.StatusCode.UNKNOWN
    assert err.details == "boom"
