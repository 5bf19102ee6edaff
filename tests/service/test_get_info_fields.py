"""GetInfo's schema is the engine's EngineInfo, the serving loop's counters and the
server's own limits, under the GetInfoResponse message's names: the converter passes them
by name, so a field added to one and not the other fails here, not in a user's GetInfo."""

from __future__ import annotations

import dataclasses
import typing

from mtpdraft.service import convert
from mtpdraft.service.engine.types import EngineInfo
from mtpdraft.service.serving.loop import ServerInfo
from mtpdraft.v1 import drafter_pb2 as pb

# What the servicer itself answers (its configuration), beside the engine and the loop.
SERVER_OWN = {"hidden_dtypes", "max_message_bytes"}


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_engine_info_and_get_info_response_have_the_same_fields() -> None:
    engine, loop = _names(EngineInfo), _names(ServerInfo) - {"engine"}
    wire = set(pb.GetInfoResponse.DESCRIPTOR.fields_by_name)
    assert not engine & loop and not (engine | loop) & SERVER_OWN
    assert engine | loop | SERVER_OWN == wire, {
        "not on the wire": sorted((engine | loop | SERVER_OWN) - wire),
        "on the wire only": sorted(wire - (engine | loop | SERVER_OWN)),
    }


def _sample(kind: typing.Any, i: int) -> typing.Any:
    """A value of `kind` that is no field's default, and differs field to field."""
    if kind is bool:
        return True
    if kind is int:
        return 10 + i
    if kind is float:
        return i + 0.5
    if kind is str:
        return f"value {i}"
    assert typing.get_origin(kind) is tuple, kind
    return ("regex", f"kind {i}")


def test_every_field_reaches_the_answer() -> None:
    hints = typing.get_type_hints(EngineInfo)
    given = {
        f.name: _sample(hints[f.name], i) for i, f in enumerate(dataclasses.fields(EngineInfo))
    }
    served = ServerInfo(EngineInfo(**given), queued_calls=3, batch_size_counts={2: 5, 8: 1})
    answer = convert.info(served, max_message_bytes=4 << 20)
    set_fields = {f.name for f, _ in answer.ListFields()}
    assert set_fields == set(pb.GetInfoResponse.DESCRIPTOR.fields_by_name)
    for name, value in given.items():
        got = getattr(answer, name)
        assert (tuple(got) if isinstance(value, tuple) else got) == value, name
    assert (answer.queued_calls, dict(answer.batch_size_counts)) == (3, {2: 5, 8: 1})
    assert list(answer.hidden_dtypes) == [pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32]
    assert answer.max_message_bytes == 4 << 20
