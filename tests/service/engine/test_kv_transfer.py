"""State ids that name their server instance (STATE_LOST), and KV export / import between
engines: identical next drafts, and every refused import leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from proposing import ProposeArgs, propose, step_of

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine import ids
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.errors import (
    DrafterError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from mtpdraft.service.engine.kv_transfer import KVChunk, KVHeader, KVImport, model_fingerprint
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

H = 64  # the test checkpoint's hidden size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), "mimo", seed=3)


@pytest.fixture(scope="module")
def head(checkpoint: Path) -> MTPHead:
    return MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))


def engine_of(head: MTPHead, clock=None, epoch: int | None = None, **options) -> DraftEngine:
    limits = {"kv_blocks": 64, "block_size": 4, "max_drafts": 8, "state_ttl": 10} | options
    timing = {} if clock is None else {"clock": clock}
    return DraftEngine(head, ServeConfig(**limits), epoch=epoch, **timing)


def h(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def prefilled(engine: DraftEngine, rows: int, seed: int) -> int:
    state = engine.alloc_state()
    session = engine.begin_prefill(state, 1)
    session.append([(seed * 7 + i) % 97 + 1 for i in range(rows)], h(rows, seed))
    session.finish()
    return state


def exported(engine: DraftEngine, state: int, chunk_rows: int = 3):
    """(header, [(first_row, k, v)]) of the state's KV, taken and exported; the handle freed."""
    handle = engine.take_kv(state).handle_id
    export = engine.export_kv(handle)
    n = export.header.num_rows
    chunks = [(lo, *export.rows(lo, chunk_rows)) for lo in range(0, n, chunk_rows)]
    export.finish(keep_handle=False)
    return export.header, chunks


def opened(engine: DraftEngine, state: int, header: KVHeader) -> KVImport:
    """An import into `state` opened with a first chunk of no rows (rows follow by write)."""
    return engine.import_kv(KVChunk(header, 0, None, None, state_id=state))


def imported(engine: DraftEngine, header: KVHeader, chunks) -> int:
    state = engine.alloc_state()
    session = opened(engine, state, header)
    for first, k, v in chunks:
        session.write(first, k, v)
    session.finish()
    return state


def assert_all_free(engine: DraftEngine) -> None:
    held = sum(len(s.blocks) for s in engine.states.values())
    assert held == 0 and not engine.handles
    assert engine.pool.num_free == engine.pool.num_total


# ---- ids ---------------------------------------------------------------------------


def test_ids_carry_the_instance_epoch(head: MTPHead) -> None:
    engine = engine_of(head, epoch=12345)
    state = engine.alloc_state()
    assert ids.epoch_of(state) == 12345 == engine.info().instance_epoch
    assert 0 < state < 2**63
    handle = engine.take_kv(state).handle_id
    assert ids.epoch_of(handle) == 12345
    with pytest.raises(ValueError):
        ids.Ids(0)


def reason_of(call, *args) -> DrafterError:
    with pytest.raises(DrafterError) as info:
        call(*args)
    return info.value


def test_another_instances_state_is_lost_a_freed_or_never_issued_one_not_found(
    head: MTPHead,
) -> None:
    one, two = engine_of(head, epoch=1), engine_of(head, epoch=2)
    theirs = one.alloc_state()
    ours = two.alloc_state()
    two.free_state(ours)
    lost = reason_of(two.after_verify, theirs, Verdict(0))
    assert isinstance(lost, NotFound) and lost.reason == "STATE_LOST"
    assert "instance 1" in lost.message and "prefill it again" in lost.message
    for gone in (ours, 123456789):  # freed here; epoch 0, never issued by anyone
        err = reason_of(two.take_kv, gone)
        assert (type(err), err.reason) == (NotFound, "STATE_NOT_FOUND")
    handle = one.take_kv(theirs).handle_id
    err = reason_of(two.install_kv, two.alloc_state(), handle)
    assert err.reason == "HANDLE_NOT_FOUND" and "instance 1" in err.message


def test_a_state_whose_lease_expired_is_lost(head: MTPHead) -> None:
    clock = Clock()
    engine = engine_of(head, clock=clock)
    state = prefilled(engine, 5, 1)
    clock.now = 11
    assert engine.reap_expired() == (1, 0)
    err = reason_of(propose, engine, ProposeArgs(state, 1, h(1, 2), 6, 2))
    assert err.reason == "STATE_LOST" and "lease expired" in err.message
    assert_all_free(engine)


def test_a_columns_step_names_each_rows_loss(head: MTPHead) -> None:
    """The admission's vectorised check fails unknown rows; each says lost or not found."""
    engine, other = engine_of(head, epoch=7), engine_of(head, epoch=8)
    live = prefilled(engine, 4, 1)
    freed = engine.alloc_state()
    engine.free_state(freed)
    foreign = other.alloc_state()
    requests = [ProposeArgs(s, 3, h(1, i), 5 if s == live else 1, 2) for i, s in
                enumerate([live, foreign, freed])]  # fmt: skip
    result = engine.step(step_of(requests, engine.step_shape))
    assert result.counts[0] == 2
    assert {row: e.reason for row, e in result.errors.items()} == {
        1: "STATE_LOST",
        2: "STATE_NOT_FOUND",
    }


# ---- export / import ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_imported_kv_drafts_as_the_original(head: MTPHead, block_size: int) -> None:
    """Rows exported in chunks and imported into an engine of another block size (rows,
    not blocks) draft exactly what the original state drafts next."""
    source, reference = engine_of(head), engine_of(head)
    destination = engine_of(head, block_size=block_size)
    state, twin = prefilled(source, 10, 5), prefilled(reference, 10, 5)
    for engine, s in ((source, state), (reference, twin)):  # a verdict, then settled
        propose(engine, ProposeArgs(s, 9, h(1, 6), 11, 4))
        engine.after_verify(s, Verdict(2, h(2, 7)))
    header, chunks = exported(source, state)
    assert (header.num_rows, header.model_family, header.dtype) == (13, "mimo", torch.float32)
    assert header.model_fingerprint == source.model_fingerprint
    assert [c[0] for c in chunks] == [0, 3, 6, 9, 12]
    assert not source.handles and source.pool.num_free == source.pool.num_total
    moved = imported(destination, header, chunks)
    assert destination.states[moved].next_position == 14
    want = propose(reference, ProposeArgs(twin, 4, h(1, 8), 14, 5))
    got = propose(destination, ProposeArgs(moved, 4, h(1, 8), 14, 5))
    assert got.tokens == want.tokens and got.probs == want.probs


def test_export_keeps_the_handle_when_asked(head: MTPHead) -> None:
    engine = engine_of(head)
    state = prefilled(engine, 6, 2)
    handle = engine.take_kv(state).handle_id
    export = engine.export_kv(handle)
    export.rows(0, 6)
    export.finish(keep_handle=True)
    assert engine.install_kv(state, handle).num_rows == 6  # still there: installed back
    engine.free_state(state)
    assert_all_free(engine)
    err = reason_of(engine.export_kv, handle)
    assert err.reason == "HANDLE_NOT_FOUND"


def refused(engine: DraftEngine, state: int, header: KVHeader, chunks, finish=True):
    """The error of an import, and the engine left as it was: the state empty, no
    block held, the state usable again."""
    with pytest.raises(DrafterError) as info:
        session = opened(engine, state, header)
        try:
            for first, k, v in chunks:
                session.write(first, k, v)
            if finish:
                session.finish()
        except DrafterError:
            session.abort()  # as the backend does on any error
            raise
    assert engine.states[state].num_rows == 0 and not engine.states[state].prefilling
    assert engine.pool.num_free == engine.pool.num_total
    return info.value


def test_mismatched_or_broken_imports_install_nothing(head: MTPHead, tmp_path: Path) -> None:
    source, destination = engine_of(head), engine_of(head)
    header, chunks = exported(source, prefilled(source, 9, 3))
    state = destination.alloc_state()

    def changed(**fields) -> KVHeader:
        return KVHeader(**(vars(header) | fields))

    cases = [
        (changed(dtype=torch.bfloat16), chunks, FailedPrecondition, "KV_DTYPE_MISMATCH"),
        (changed(head_dim=8), chunks, FailedPrecondition, "KV_SHAPE_MISMATCH"),
        (changed(model_fingerprint="0" * 32), chunks, FailedPrecondition, "KV_MODEL_MISMATCH"),
        (header, chunks[:2], InvalidArgument, "INCOMPLETE_KV"),  # cut short
        (header, [chunks[1], *chunks], InvalidArgument, "CHUNK_MISMATCH"),  # out of order
        (changed(num_rows=4), chunks, InvalidArgument, "CHUNK_MISMATCH"),  # more than announced
        (changed(num_rows=5000), [], InvalidArgument, "POSITION_TOO_LARGE"),
        (changed(num_rows=300), [], DrafterError, "KV_BLOCKS_EXHAUSTED"),  # 75 blocks of 64
    ]
    first, k, v = chunks[0]
    bad_k = k.clone()
    bad_k[1, 0, 3] = float("nan")
    cases += [
        (header, [(first, bad_k, v)], InvalidArgument, "NOT_FINITE"),
        (header, [(first, k[:, :1], v[:, :1])], InvalidArgument, "BAD_SHAPE"),
        (header, [(first, k, v[:2])], InvalidArgument, "BAD_SHAPE"),
        (header, [(first, k.double(), v.double())], InvalidArgument, "BAD_DTYPE"),
    ]
    for bad_header, bad_chunks, kind, reason in cases:
        err = refused(destination, state, bad_header, bad_chunks)
        assert isinstance(err, kind) and err.reason == reason, (reason, err.message)
    # Another checkpoint of the same shape: the fingerprint tells them apart.
    other = MTPHead(load_mtp_weights(write_random_checkpoint(tmp_path, "mimo", seed=4)), "cpu")
    elsewhere = engine_of(other)
    err = refused(elsewhere, elsewhere.alloc_state(), header, chunks)
    assert err.reason == "KV_MODEL_MISMATCH" and header.model_fingerprint in err.message
    # After all that, the state takes the KV.
    session = opened(destination, state, header)
    for chunk in chunks:
        session.write(*chunk)
    assert session.finish().num_rows == 9
    destination.free_state(state)
    assert_all_free(destination)


def test_import_only_into_an_empty_idle_state(head: MTPHead) -> None:
    source, destination = engine_of(head), engine_of(head)
    header, chunks = exported(source, prefilled(source, 5, 3))
    full = prefilled(destination, 2, 4)
    free = destination.pool.num_free
    with pytest.raises(FailedPrecondition) as err:
        opened(destination, full, header)
    assert err.value.reason == "STATE_NOT_EMPTY" and destination.pool.num_free == free
    empty = destination.alloc_state()
    session = opened(destination, empty, header)
    with pytest.raises(FailedPrecondition) as err:  # busy until the import ends
        propose(destination, ProposeArgs(empty, 1, h(1, 1), 1, 2))
    assert err.value.reason == "PREFILL_IN_PROGRESS"
    destination.free_state(empty)  # freed mid-import: the rest fails, nothing leaks
    with pytest.raises(NotFound):
        session.write(*chunks[0])
    session.abort()
    destination.free_state(full)
    assert_all_free(destination)


def test_the_fingerprint_names_the_checkpoint_not_the_process_or_dtype(
    checkpoint: Path, head: MTPHead
) -> None:
    again = MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))
    in_bf16 = MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"), torch.bfloat16)
    fingerprint = model_fingerprint(head)
    assert len(fingerprint) == 32 and int(fingerprint, 16) >= 0
    assert model_fingerprint(again) == fingerprint == model_fingerprint(in_bf16)
    # bf16 KV into an fp32 engine: the dtype differs (said first), not the model.
    bf16_engine, fp32_engine = engine_of(in_bf16), engine_of(head)
    header, chunks = exported(bf16_engine, prefilled(bf16_engine, 3, 1))
    err = refused(fp32_engine, fp32_engine.alloc_state(), header, chunks)
    assert err.reason == "KV_DTYPE_MISMATCH" and "bfloat16" in err.message
    assert np.isfinite(float(chunks[0][1].float().sum()))


def test_the_fingerprint_samples_a_tensor_past_float32_indices_up_to_its_last_element(
    checkpoint: Path,
) -> None:
    """2**24 + 4 elements: evenly spaced float32 indices would overshoot the last one (an
    LM head is far larger)."""
    head = MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))
    head.large = torch.zeros(2**24 + 4, dtype=torch.bfloat16)
    before = model_fingerprint(head)
    head.large[-1] = 1.0
    assert model_fingerprint(head) != before


def test_the_fingerprint_reads_fp8_weights_kept_or_dequantized_alike(tmp_path: Path) -> None:
    """The Triton ops keep DeepSeek's FP8 matrices and experts as FP8 with their scales; the
    torch ops dequantize them at load. One checkpoint, one fingerprint."""
    from deepseek_checkpoints import write_deepseek_checkpoint

    weights = load_mtp_weights(write_deepseek_checkpoint(tmp_path, fp8=True, seed=2))
    kept = MTPHead(weights, torch.device("cpu"), ops="triton")
    plain = MTPHead(weights, torch.device("cpu"), torch.bfloat16, ops="torch")
    assert kept.moe.scales and not plain.moe.scales
    assert model_fingerprint(kept) == model_fingerprint(plain)
    kept.moe.scales["down_scale"][3, 0, 0] *= 2  # one expert's block scale: another model
    assert model_fingerprint(kept) != model_fingerprint(plain)
