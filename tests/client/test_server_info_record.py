"""ServerInfo is GetInfoResponse field for field, read generically from the message's
descriptor: a field the server adds reaches the client's ServerInfo with no client edit.
Values are plain Python (dtypes by name), never protobuf containers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from mtpdraft.client import ServerInfo, messages
from mtpdraft.client.proto_record import record_type, record_values
from mtpdraft.v1 import drafter_pb2 as pb


def test_server_info_has_a_field_for_each_of_get_info_response() -> None:
    names = [f.name for f in dataclasses.fields(ServerInfo)]
    assert names == [f.name for f in pb.GetInfoResponse.DESCRIPTOR.fields]


def test_the_types_users_read() -> None:
    types = {f.name: f.type for f in dataclasses.fields(ServerInfo)}
    assert types["model_family"] is str and types["hidden_size"] is int
    assert types["state_ttl_seconds"] is float and types["draining"] is bool
    assert types["hidden_dtypes"] == tuple[str, ...] == types["grammar_kinds"]
    assert types["batch_size_counts"] == dict[int, int]


def test_every_field_is_read() -> None:
    info = messages.parse_info(
        pb.GetInfoResponse(
            model_family="deepseek",
            hidden_size=7168,
            vocab_size=129280,
            num_attention_heads=128,
            num_key_value_heads=1,
            head_dim=576,
            compute_dtype="bfloat16",
            hidden_dtypes=[pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32],
            device="cuda:0",
            max_drafts=8,
            max_batch=64,
            max_states=512,
            live_states=3,
            kv_block_size=16,
            kv_blocks_total=1000,
            kv_blocks_free=990,
            kv_handles=2,
            state_ttl_seconds=120.5,
            max_message_bytes=1 << 33,
            bitmask_words=4040,
            draining=True,
            batch_size_counts={1: 2**40, 64: 3},
            queued_calls=5,
            instance_epoch=2**20 - 1,
            model_fingerprint="ds-abc",
            max_sample_top_k=64,
            grammar_kinds=["json_schema", "regex"],
        )
    )
    assert info == ServerInfo(
        "deepseek", 7168, 129280, 128, 1, 576, "bfloat16", ("bfloat16", "float16", "float32"),
        "cuda:0", 8, 64, 512, 3, 16, 1000, 990, 2, 120.5, 1 << 33, 4040, True,
        {1: 2**40, 64: 3}, 5, 2**20 - 1, "ds-abc", 64, ("json_schema", "regex"),
    )  # fmt: skip
    assert type(info.batch_size_counts) is dict and type(info.grammar_kinds) is tuple
    assert pickle.loads(pickle.dumps(info)) == info  # the load test's workers get it so
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.draining = False  # type: ignore[misc]


def test_an_empty_answer_reads_as_the_wire_defaults() -> None:
    info = messages.parse_info(pb.GetInfoResponse())
    assert info == ServerInfo()
    assert (info.model_family, info.hidden_size, info.draining) == ("", 0, False)
    assert (info.hidden_dtypes, info.batch_size_counts) == ((), {})


def test_a_message_of_any_shape_is_a_record() -> None:
    """Nested messages, enums and repeated messages: the kinds of field GetInfo may gain."""
    chunk = pb.KVChunk(
        state_id=4,
        header=pb.KVHeader(model_family="mimo", dtype=pb.DTYPE_BF16, num_rows=3),
        k=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[1, 2], data=b"\0" * 8),
    )
    values = record_values(chunk)
    assert values["header"]["dtype"] == "bfloat16" and values["header"]["num_rows"] == 3
    assert values["k"] == {"dtype": "float32", "shape": (1, 2), "data": b"\0" * 8}
    assert values["v"] == {"dtype": "unspecified", "shape": (), "data": b""}
    record = record_type(pb.KVChunk.DESCRIPTOR)
    assert record(**values).header["model_family"] == "mimo"
    rows = record_values(pb.ProposeBatchResponse(errors=[pb.RowError(row=2)]))
    assert rows["errors"] == ({"row": 2, "error": {"code": 0, "message": "", "reason": "",
                                                    "field": ""}},)  # fmt: skip
