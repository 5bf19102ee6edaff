"""ExportKV / ImportKV over gRPC (a handle's KV as bytes, into another state), and states
whose KV is gone answering STATE_LOST: on the shared server, which must end every test
holding nothing (the `client` fixture checks)."""

from __future__ import annotations

import grpc
import pytest
from drafting import hiddens, tokens
from servers import PATIENCE, InProcessServer, small_engine

from mtpdraft.client import (
    DrafterClient,
    FailedPrecondition,
    InvalidArgument,
    StateLost,
    StateNotFound,
    is_state_lost,
    move_state,
)
from mtpdraft.client import messages as m
from mtpdraft.v1 import drafter_pb2 as pb


def prefilled(c: DrafterClient, rows: int, seed: int) -> int:
    state = c.alloc_state()
    c.prefill(state, tokens(rows, seed), hiddens(rows, seed), 1)
    return state


def next_drafts(c: DrafterClient, state: int, position: int) -> tuple[list[int], list[float]]:
    p = c.propose(state, 7, hiddens(1, 99)[0], position, 5)
    c.after_verify(state, 0)
    return p.tokens, p.probs


def test_getinfo_names_the_instance_its_ids_carry_and_the_model(client: DrafterClient) -> None:
    info = client.info()
    assert 0 < info.instance_epoch < 2**20 and len(info.model_fingerprint) == 32
    state = client.alloc_state()
    assert state >> 43 == info.instance_epoch
    client.free_state(state)


def test_a_state_of_another_instance_is_lost(client: DrafterClient) -> None:
    """What a verifier sees when its key reaches a replica that never held its state."""
    epoch = client.info().instance_epoch
    foreign = ((epoch % (2**20 - 1)) + 1) << 43 | 12345  # another instance's epoch
    with pytest.raises(StateLost) as err:
        client.propose(foreign, 1, hiddens(1, 1)[0], 5, 2)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.reason == "STATE_LOST"
    assert is_state_lost(err.value) and isinstance(err.value, StateNotFound)
    with client.stream() as stream, pytest.raises(StateLost):  # as an error value too
        stream.propose(foreign, 1, hiddens(1, 1)[0], 5, 2)
    answer = client.propose_batch([foreign], [1], [5], hiddens(1, 1), 2)
    assert isinstance(answer.errors[0], StateLost)
    # One of its own the server freed, or an id no instance issued: not found, not lost.
    state = client.alloc_state()
    client.free_state(state)
    for gone in (state, 12345):
        with pytest.raises(StateNotFound) as err:
            client.after_verify(gone, 0)
        assert err.value.reason == "STATE_NOT_FOUND" and not is_state_lost(err.value)


@pytest.mark.parametrize("chunk_bytes", [None, 1000])
def test_exported_bytes_imported_draft_as_the_original(
    client: DrafterClient, chunk_bytes: int | None
) -> None:
    original, twin = prefilled(client, 11, 3), prefilled(client, 11, 3)
    want = next_drafts(client, twin, 12)
    handle = client.take_kv(original)
    blob = client.export_kv(handle, max_chunk_bytes=chunk_bytes)
    chunks = list(m.kv_chunks(blob))
    row_bytes = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32
    assert len(chunks) == (1 if chunk_bytes is None else -(-11 // (1000 // row_bytes)))
    header = chunks[0].header
    info = client.info()
    assert (header.num_rows, header.dtype) == (11, pb.DTYPE_FP32)
    assert header.model_fingerprint == info.model_fingerprint
    assert info.kv_handles == 0  # the export freed the handle
    moved = client.alloc_state()
    done = client.import_kv(moved, blob)
    assert (done.num_rows, done.next_position) == (11, 12)
    assert next_drafts(client, moved, 12) == want
    for s in (original, twin, moved):
        client.free_state(s)


def test_refused_imports_leave_the_state_empty(client: DrafterClient) -> None:
    handle = client.take_kv(source := prefilled(client, 9, 4))
    blob = client.export_kv(handle, max_chunk_bytes=700)  # 2 rows of 256 bytes a chunk
    chunks = list(m.kv_chunks(blob))
    state = client.alloc_state()
    free = client.info().kv_blocks_free

    def renamed(fingerprint: str) -> list[pb.KVChunk]:
        first = pb.KVChunk()
        first.CopyFrom(chunks[0])
        first.header.model_fingerprint = fingerprint
        return [first, *chunks[1:]]

    with pytest.raises(InvalidArgument) as err:  # cut at a chunk's end: the server sees it
        client.import_kv(state, m.kv_bytes(chunks[:2]))
    assert err.value.reason == "INCOMPLETE_KV" and err.value.field == "header.num_rows"
    with pytest.raises(FailedPrecondition) as err:
        client.import_kv(state, renamed("f" * 32))
    assert err.value.reason == "KV_MODEL_MISMATCH"
    with pytest.raises(InvalidArgument) as err:
        client.import_kv(state, chunks[1:])  # no header
    assert err.value.reason == "MISSING_FIELD"
    with pytest.raises(ValueError, match="cut short"):  # cut inside a chunk: the client sees it
        client.import_kv(state, blob[:-10])
    assert client.info().kv_blocks_free == free
    assert client.import_kv(state, blob).num_rows == 9  # after all that, it takes the KV
    for s in (source, state):
        client.free_state(s)


def test_an_export_cut_short_keeps_the_handle(client: DrafterClient) -> None:
    # A row a chunk: the server is still reading rows out when the verifier stops, however
    # slowly the verifier's process runs.
    rows = 160
    state = prefilled(client, rows, 5)
    handle = client.take_kv(state)
    chunks = client.export_kv_chunks(handle, max_chunk_bytes=1)
    next(chunks)
    chunks.close()  # the verifier stops reading: nothing installed, the handle still there
    assert client.info().kv_handles == 1
    again = client.export_kv(handle, keep_handle=True)
    assert client.install_kv(state, handle).num_rows == rows  # kept: installed back
    with pytest.raises(StateNotFound) as err:
        client.export_kv(handle)
    assert err.value.reason == "HANDLE_NOT_FOUND"
    moved = client.alloc_state()
    assert client.import_kv(moved, again).num_rows == rows
    for s in (state, moved):
        client.free_state(s)


def test_move_state_between_servers_and_its_refusals(client: DrafterClient, mimo_checkpoint):
    """move_state: the KV on another server, the source freed; to a server of another
    dtype, refused with the source state whole."""
    import torch

    from mtpdraft.service.config import ServeConfig
    from mtpdraft.service.engine.engine import DraftEngine
    from mtpdraft.service.model.checkpoint import load_mtp_weights
    from mtpdraft.service.model.mtp_head import MTPHead

    head = MTPHead(load_mtp_weights(mimo_checkpoint), torch.device("cpu"), torch.bfloat16)
    other = InProcessServer(
        DraftEngine(head, ServeConfig(kv_blocks=64, block_size=8, max_drafts=8))
    )
    same = InProcessServer(small_engine(mimo_checkpoint, kv_blocks=64, block_size=16))
    try:
        with (
            DrafterClient(other.address, timeout=PATIENCE) as bf16,
            DrafterClient(same.address, timeout=PATIENCE) as fp32,
        ):
            state, twin = prefilled(client, 10, 6), prefilled(client, 10, 6)
            with pytest.raises(FailedPrecondition) as err:
                move_state(client, bf16, state)
            assert err.value.reason == "KV_DTYPE_MISMATCH"
            assert bf16.info().live_states == 0 and client.info().kv_handles == 0
            moved = move_state(client, fp32, state)  # the source state whole: it moves
            assert fp32.info().live_states == 1
            with pytest.raises(StateNotFound):
                client.after_verify(state, 0)  # freed at the source
            assert next_drafts(fp32, moved, 11) == next_drafts(client, twin, 11)
            fp32.free_state(moved)
            client.free_state(twin)
    finally:
        other.stop()
        same.stop()


def test_junk_export_and_import_requests_are_refused(client: DrafterClient) -> None:
    """Bytes that do not parse: INVALID_ARGUMENT (MALFORMED_MESSAGE), nothing changed."""
    service = "/mtpdraft.v1.Drafter/"
    export = client.channel.unary_stream(service + "ExportKV")  # no serializers: raw bytes
    import_ = client.channel.stream_unary(service + "ImportKV")
    state, info = client.alloc_state(), client.info()
    header = pb.KVHeader(
        model_fingerprint=info.model_fingerprint,
        dtype=pb.DTYPE_FP32,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        num_rows=4,
    )
    good = pb.KVChunk(state_id=state, header=header).SerializeToString()
    for call in (
        lambda: list(export(b"\xff" * 16, timeout=PATIENCE)),
        lambda: import_(iter([b"\xff" * 16]), timeout=PATIENCE),
        lambda: import_(iter([good, b"\x0a\x05ab"]), timeout=PATIENCE),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "parse" in err.value.details()
    assert client.info().kv_blocks_free == client.info().kv_blocks_total
    client.free_state(state)
