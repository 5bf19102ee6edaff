"""Shared helpers of the client tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from secured_servers import SecuredServers, start_secured_servers


def rich_status(
    code: grpc.StatusCode, message: str, *, reason: str | None = None, field: str | None = None
) -> status_pb2.Status:
    details = []
    if reason is not None:
        info = error_details_pb2.ErrorInfo(
            reason=reason, domain="mtpdraft.v1", metadata={"state_id": "7"}
        )
        details.append(_pack(info))
    if field is not None:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description="bad"),
                error_details_pb2.BadRequest.FieldViolation(field="other", description="x"),
            ]
        )
        details.append(_pack(bad))
    return status_pb2.Status(code=code.value[0], message=message, details=details)


def _pack(msg: Any) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


@pytest.fixture
def make_status() -> Callable[..., status_pb2.Status]:
    """Builds a google.rpc.Status with an ErrorInfo and a BadRequest, as the server sends."""
    return rich_status


@pytest.fixture(scope="module")
def secured_servers(
    mimo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecuredServers]:
    with start_secured_servers(mimo_checkpoint, tmp_path_factory.mktemp("secured")) as servers:
        yield servers
