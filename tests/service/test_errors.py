"""Every error of DESIGN.md ("Errors") over the wire: its status code, its reason, and no change.

Each bad request is followed by a check that the state is as it was: the next
valid proposal equals the oracle's over the rows the state held before, and
the pool holds the same number of free blocks.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch
from drafting import Expected, H, V, hiddens, tokens
from mtp_reference import Reference
from servers import PATIENCE

from mtpdraft.client import (
    DrafterClient,
    DrafterError,
    FailedPrecondition,
    InvalidArgument,
    ProposeArgs,
    ResourceExhausted,
    StateNotFound,
    Verdict,
)
from mtpdraft.client.errors import from_rpc_error
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

UNKNOWN = 123456789


def T(dtype: str | int, shape: list[int], data: bytes) -> pb.Tensor:
    """A wire tensor with a chosen dtype, shape and payload, valid or not."""
    code = dtype if isinstance(dtype, int) else pb.DType.Value(f"DTYPE_{dtype}")
    return pb.Tensor(dtype=code, shape=shape, data=data)


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.DrafterStub(channel)


class Prepared:
    """A state with 5 prompt rows and a pending 3-draft proposal at position 6."""

    def __init__(self, client: DrafterClient, ref: Reference) -> None:
        self.client, self.exp = client, Expected(ref)
        self.state = client.alloc_state()
        toks, hid = tokens(5, 1), hiddens(5, 1)
        client.prefill(self.state, toks, hid, 1)
        self.exp.add(toks, hid)
        self.x, self.h = tokens(1, 2)[0], hiddens(1, 2)
        self.proposal = client.propose(self.state, self.x, self.h, 6, 3)
        self.exp.propose(self.x, self.h, 3)
        self.free_blocks = client.info().kv_blocks_free

    def assert_unchanged_then_free(self) -> None:
        """Still pending with the same proposal, same pool; then settles it and frees."""
        assert self.client.info().kv_blocks_free == self.free_blocks
        self.client.after_verify(self.state, 1)
        self.exp.verdict(1)
        y, hy = tokens(1, 3)[0], hiddens(1, 3)
        got = self.client.propose(self.state, y, hy, 8, 2)
        drafts, probs = self.exp.propose(y, hy, 2)
        assert got.tokens == drafts and got.probs == pytest.approx(probs, abs=2e-4)
        self.client.after_verify(self.state, 0)
        self.client.free_state(self.state)


@pytest.fixture
def prepared(client: DrafterClient, ref: Reference):
    p = Prepared(client, ref)
    yield p
    p.assert_unchanged_then_free()


def expect(exc_type: type[DrafterError], reason: str, call, *args, **kwargs) -> DrafterError:
    with pytest.raises(exc_type) as info:
        call(*args, **kwargs)
    assert info.value.reason == reason, info.value.details
    assert info.value.details  # a message a person can read
    return info.value


def raw(call, request):
    """Calls the stub directly (bypassing the client's own checks); returns the typed error."""
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return from_rpc_error(info.value)


# ---- NOT_FOUND --------------------------------------------------------------


def test_unknown_state_is_not_found(client: DrafterClient) -> None:
    h = hiddens(1, 0)
    for call, args in [
        (client.propose, (UNKNOWN, 1, h, 1, 2)),
        (client.after_verify, (UNKNOWN, 0)),
        (client.take_kv, (UNKNOWN,)),
        (client.install_kv, (UNKNOWN, 1)),
        (client.prefill, (UNKNOWN, [1], h, 1)),
    ]:
        err = expect(StateNotFound, "STATE_NOT_FOUND", call, *args)
        assert err.code == grpc.StatusCode.NOT_FOUND
    assert client.free_state(UNKNOWN) is False  # FreeState is idempotent, not an error


def test_unknown_handle_is_not_found(client: DrafterClient) -> None:
    state = client.alloc_state()
    expect(StateNotFound, "HANDLE_NOT_FOUND", client.install_kv, state, UNKNOWN)
    client.free_state(state)


# ---- INVALID_ARGUMENT -------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"hidden": T("INT32", [H], bytes(4 * H))}, "BAD_DTYPE", "hidden"),
        ({"hidden": T("FP32", [H], bytes(4 * H - 1))}, "BAD_BYTE_COUNT", "hidden"),
        ({"hidden": T("FP32", [H + 1], bytes(4 * H + 4))}, "BAD_SHAPE", "hidden"),
        ({"hidden": T("FP32", [2, H], bytes(8 * H))}, "BAD_SHAPE", "hidden"),
        ({"hidden": T(99, [H], bytes(4 * H))}, "BAD_DTYPE", "hidden"),
        # NaN and inf, little-endian, in fp32 and bf16: the engine refuses both.
        (
            {"hidden": T("FP32", [H], bytes(4 * H - 4) + b"\x00\x00\xc0\x7f")},
            "NOT_FINITE",
            "hidden",
        ),
        ({"hidden": T("BF16", [H], b"\x80\xff" + bytes(2 * H - 2))}, "NOT_FINITE", "hidden"),
        ({"token": V}, "TOKEN_OUT_OF_RANGE", "token"),
        ({"token": -1}, "TOKEN_OUT_OF_RANGE", "token"),
        ({"position": 9}, "POSITION_MISMATCH", "position"),
        ({"num_drafts": -1}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": 9}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": 0, "draft_cap": 9}, "DRAFT_CAP_OUT_OF_RANGE", "draft_cap"),
        (
            {"num_drafts": 0, "verify_token_cost": -0.5},
            "VERIFY_TOKEN_COST_OUT_OF_RANGE",
            "verify_token_cost",
        ),
        ({"min_confidence": 1.5}, "MIN_CONFIDENCE_OUT_OF_RANGE", "min_confidence"),
        ({"bitmask": T("FP32", [7], bytes(28))}, "BAD_DTYPE", "bitmask"),
        ({"bitmask": T("INT32", [8], bytes(32))}, "BAD_SHAPE", "bitmask"),
        ({"bitmask": T("INT32", [3, 7], b"\xff" * 84)}, "BAD_SHAPE", "bitmask"),
        ({"bitmask": T("INT32", [7], bytes(28))}, "EMPTY_BITMASK", "bitmask"),
        (
            {"previous": pb.Verdict(num_accepted=4)},
            "NUM_ACCEPTED_OUT_OF_RANGE",
            "previous.num_accepted",
        ),
        (
            {
                "previous": pb.Verdict(
                    num_accepted=1, refeed_hiddens=T("FP16", [1, H], bytes(2 * H - 2) + b"\x00\x7c")
                )
            },
            "NOT_FINITE",
            "previous.refeed_hiddens",
        ),
    ],
)
def test_malformed_propose_is_invalid_argument(
    stub, prepared: Prepared, change: dict, reason: str, field: str
) -> None:
    """Against a state whose proposal is pending, so `previous` is valid unless changed."""
    hidden = pb.Tensor(dtype=pb.DTYPE_FP32, shape=[H], data=hiddens(1, 4).numpy().tobytes())
    request = {"state_id": prepared.state, "token": 5, "hidden": hidden, "position": 8}
    request |= {"num_drafts": 2, "previous": pb.Verdict(num_accepted=1)} | change
    err = raw(stub.Propose, pb.ProposeRequest(**request))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.reason, err.field) == (reason, field), err.details


def test_bad_verdicts_are_invalid_argument(client: DrafterClient, prepared: Prepared) -> None:
    s = prepared.state
    expect(InvalidArgument, "NUM_ACCEPTED_OUT_OF_RANGE", client.after_verify, s, 4)
    bad_refeed = hiddens(3, 5)  # 3 rows for 2 accepted
    err = expect(InvalidArgument, "BAD_SHAPE", client.after_verify, s, 2, refeed_hiddens=bad_refeed)
    assert err.field == "verdict.refeed_hiddens"
    nan = hiddens(2, 5)
    nan[1, 3] = float("nan")
    expect(InvalidArgument, "NOT_FINITE", client.after_verify, s, 2, refeed_hiddens=nan)


def test_bad_prefill_is_invalid_argument_and_changes_nothing(
    client: DrafterClient, stub, ref: Reference
) -> None:
    state, exp = client.alloc_state(), Expected(ref)
    toks, hid = tokens(4, 6), hiddens(4, 6)
    client.prefill(state, toks, hid, 1)
    exp.add(toks, hid)
    free = client.info().kv_blocks_free
    expect(InvalidArgument, "POSITION_MISMATCH", client.prefill, state, [1], hiddens(1, 7), 4)
    expect(InvalidArgument, "TOKEN_OUT_OF_RANGE", client.prefill, state, [1, V], hiddens(2, 7), 5)
    # A good chunk, then a bad one: the good chunk's rows are rolled back too.
    good = hiddens(6, 8).numpy()
    chunks = [
        pb.PrefillChunk(
            state_id=state,
            start_position=5,
            tokens=[1, 2, 3, 4, 5, 6],
            hiddens=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[6, H], data=good.tobytes()),
        ),
        pb.PrefillChunk(
            tokens=[7],
            hiddens=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[1, H], data=bytes(10)),
        ),
    ]
    err = raw(stub.Prefill, iter(chunks))
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_BYTE_COUNT")
    assert client.info().kv_blocks_free == free
    x, h = tokens(1, 9)[0], hiddens(1, 9)
    got = client.propose(state, x, h, 5, 3)  # position 5: the 4 prompt rows only
    drafts, probs = exp.propose(x, h, 3)
    assert got.tokens == drafts and got.probs == pytest.approx(probs, abs=2e-4)
    client.after_verify(state, 0)
    client.free_state(state)


def test_a_batch_too_large_fails_whole_and_a_bad_row_alone(
    client: DrafterClient, prepared: Prepared
) -> None:
    other = client.alloc_state()
    h = hiddens(1, 10)
    too_many = [ProposeArgs(client.alloc_state(), 1, h, 1, 1) for _ in range(9)]
    err = expect(InvalidArgument, "BATCH_SIZE_OUT_OF_RANGE", client.propose_many, too_many)
    assert err.field == "state_ids"
    # A state twice, a verdict past the proposal's drafts: those rows fail, the first drafts.
    got = client.propose_many(
        [
            ProposeArgs(other, 1, h, 1, 2),
            ProposeArgs(other, 2, h, 1, 2),
            ProposeArgs(prepared.state, 1, h, 8, 2, previous=Verdict(5)),
        ]
    )
    errors = {row: (e.code, e.reason, e.field) for row, e in got.errors.items()}
    assert errors == {
        1: (grpc.StatusCode.INVALID_ARGUMENT, "DUPLICATE_STATE", "state_ids"),
        2: (grpc.StatusCode.INVALID_ARGUMENT, "NUM_ACCEPTED_OUT_OF_RANGE", "num_accepted"),
    }
    assert got.proposal(0).first_position == 2
    client.after_verify(other, 0)
    for args in too_many:
        client.free_state(args.state)
    client.free_state(other)


# ---- arguments before the state ----------------------------------------------
# A value no state accepts is INVALID_ARGUMENT naming its field, whatever the state the
# request names: an unknown one, one with a proposal pending, one without.

INT32_MIN = -(2**31)
NAN_ROW = T("FP32", [H], bytes(4 * H - 4) + b"\x00\x00\xc0\x7f")


def _row(seed: int, rows: int | None = None) -> pb.Tensor:
    """A wire tensor of target hiddens: [H], or [rows, H]."""
    shape = [H] if rows is None else [rows, H]
    return T("FP32", shape, hiddens(rows or 1, seed).numpy().tobytes())


def _verdict(accepted: int, refeed: pb.Tensor | None = None) -> pb.Verdict:
    return pb.Verdict(num_accepted=accepted, refeed_hiddens=refeed)


def assert_refused(err: DrafterError, reason: str, field: str) -> None:
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT, reason, field
    ), err.details  # fmt: skip


@pytest.fixture
def states(client: DrafterClient, prepared: Prepared):
    """An unknown state, one with a proposal pending, one without (freed after)."""
    fresh = client.alloc_state()
    yield UNKNOWN, prepared.state, fresh
    client.free_state(fresh)


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"previous": _verdict(-1)}, "NUM_ACCEPTED_OUT_OF_RANGE", "previous.num_accepted"),
        ({"previous": _verdict(INT32_MIN)}, "NUM_ACCEPTED_OUT_OF_RANGE", "previous.num_accepted"),
        ({"previous": _verdict(1, NAN_ROW)}, "NOT_FINITE", "previous.refeed_hiddens"),
        ({"previous": _verdict(2, _row(5, 3))}, "BAD_SHAPE", "previous.refeed_hiddens"),
        ({"position": 0}, "POSITION_OUT_OF_RANGE", "position"),
        ({"position": -3}, "POSITION_OUT_OF_RANGE", "position"),
        ({"position": 4095}, "POSITION_TOO_LARGE", "position"),  # draft 2's row: 4096, past 4095
        ({"token": -1}, "TOKEN_OUT_OF_RANGE", "token"),
        ({"token": V}, "TOKEN_OUT_OF_RANGE", "token"),
        ({"hidden": NAN_ROW}, "NOT_FINITE", "hidden"),
        ({"num_drafts": -1}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": INT32_MIN}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": 9}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": 0, "draft_cap": -1}, "DRAFT_CAP_OUT_OF_RANGE", "draft_cap"),
        (
            {"num_drafts": 0, "verify_token_cost": float("nan")},
            "VERIFY_TOKEN_COST_OUT_OF_RANGE",
            "verify_token_cost",
        ),
        ({"min_confidence": -0.5}, "MIN_CONFIDENCE_OUT_OF_RANGE", "min_confidence"),
        ({"min_confidence": float("nan")}, "MIN_CONFIDENCE_OUT_OF_RANGE", "min_confidence"),
        ({"bitmask": T("INT32", [7], bytes(28))}, "EMPTY_BITMASK", "bitmask"),
        ({"bitmask": T("INT32", [3, 7], b"\xff" * 84)}, "BAD_SHAPE", "bitmask"),  # 3 rows, K 2
    ],
)
def test_a_propose_value_no_state_accepts_is_refused_whatever_the_state(
    stub, states, change: dict, reason: str, field: str
) -> None:
    """Once, `previous.num_accepted = -1` on a state with a proposal pending answered
    FAILED_PRECONDITION (PROPOSAL_PENDING): the verdict was read as none."""
    for state in states:
        request = {"state_id": state, "token": 5, "hidden": _row(4), "position": 8}
        request = pb.ProposeRequest(**request | {"num_drafts": 2} | change)
        assert_refused(raw(stub.Propose, request), reason, field)


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"num_accepted": [-2]}, "NUM_ACCEPTED_OUT_OF_RANGE", "num_accepted"),
        ({"num_accepted": [INT32_MIN]}, "NUM_ACCEPTED_OUT_OF_RANGE", "num_accepted"),
        (
            {"num_accepted": [1], "refeed_rows": [1], "refeed_hiddens": NAN_ROW},
            "NOT_FINITE",
            "refeed_hiddens",
        ),
        ({"positions": [0]}, "POSITION_OUT_OF_RANGE", "positions"),
        ({"positions": [-3]}, "POSITION_OUT_OF_RANGE", "positions"),
        ({"positions": [4095]}, "POSITION_TOO_LARGE", "positions"),
        ({"tokens": [-1]}, "TOKEN_OUT_OF_RANGE", "tokens"),
        ({"tokens": [V]}, "TOKEN_OUT_OF_RANGE", "tokens"),
        ({"hiddens": NAN_ROW}, "NOT_FINITE", "hiddens"),
        ({"num_drafts": [-1]}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": [INT32_MIN]}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": [9]}, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
        ({"num_drafts": [0], "draft_caps": [9]}, "DRAFT_CAP_OUT_OF_RANGE", "draft_caps"),
        (
            {"num_drafts": [0], "verify_token_costs": [-1.0]},
            "VERIFY_TOKEN_COST_OUT_OF_RANGE",
            "verify_token_costs",
        ),
        ({"min_confidence": [-0.5]}, "MIN_CONFIDENCE_OUT_OF_RANGE", "min_confidence"),
        ({"min_confidence": [float("nan")]}, "MIN_CONFIDENCE_OUT_OF_RANGE", "min_confidence"),
        (
            {"bitmask_rows": [1], "bitmasks": T("INT32", [7], bytes(28))},
            "EMPTY_BITMASK",
            "bitmasks",
        ),
        (
            {"bitmask_rows": [3], "bitmasks": T("INT32", [3, 7], b"\xff" * 84)},
            "BAD_SHAPE",
            "bitmasks",
        ),  # 3 rows, K 2
    ],
)
def test_a_batch_value_no_state_accepts_fails_its_row_whatever_the_state(
    stub, states, change: dict, reason: str, field: str
) -> None:
    """A batch of one row, unary and on the stream: the row fails with the value's column."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for state in states:
        columns = {"state_ids": [state], "tokens": [5], "positions": [8], "hiddens": _row(4)}
        request = pb.ProposeBatchRequest(**columns | {"num_drafts": [2]} | change)
        (streamed,) = stub.ProposeStream(iter([request]), timeout=PATIENCE)
        for answer in (stub.ProposeBatch(request, timeout=PATIENCE), streamed):
            (failed,) = answer.errors
            error = (failed.row, failed.error.code, failed.error.reason, failed.error.field)
            assert error == (0, invalid, reason, field)


def test_values_no_state_accepts_fail_their_rows_alone_whatever_the_state(
    stub, states, client: DrafterClient
) -> None:
    unknown, pending, fresh = states
    request = pb.ProposeBatchRequest(
        state_ids=[pending, unknown, fresh],
        tokens=[5, 5, 5],
        positions=[8, 0, 8],  # the unknown state's position is before any state's first
        hiddens=_row(6, 3),
        num_drafts=[2, 2, -1],  # the state without a proposal asks for no drafts
        num_accepted=[-2, -1, -1],  # the pending one's verdict is neither none nor a count
    )
    answer = stub.ProposeBatch(request, timeout=PATIENCE)
    errors = {e.row: (e.error.code, e.error.reason, e.error.field) for e in answer.errors}
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors == {
        0: (invalid, "NUM_ACCEPTED_OUT_OF_RANGE", "num_accepted"),
        1: (invalid, "POSITION_OUT_OF_RANGE", "positions"),
        2: (invalid, "NUM_DRAFTS_OUT_OF_RANGE", "num_drafts"),
    }
    assert not client.info().queued_calls


@pytest.mark.parametrize(
    ("verdict", "reason", "field"),
    [
        (_verdict(-1), "NUM_ACCEPTED_OUT_OF_RANGE", "verdict.num_accepted"),
        (_verdict(INT32_MIN), "NUM_ACCEPTED_OUT_OF_RANGE", "verdict.num_accepted"),
        (_verdict(1, NAN_ROW), "NOT_FINITE", "verdict.refeed_hiddens"),
        (_verdict(2, _row(7, 3)), "BAD_SHAPE", "verdict.refeed_hiddens"),
    ],
)
def test_an_after_verify_value_no_state_accepts_is_refused_whatever_the_state(
    stub, states, verdict: pb.Verdict, reason: str, field: str
) -> None:
    for state in states:
        request = pb.AfterVerifyRequest(state_id=state, verdict=verdict)
        assert_refused(raw(stub.AfterVerify, request), reason, field)


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"start_position": 0}, "POSITION_OUT_OF_RANGE", "start_position"),
        ({"start_position": -4}, "POSITION_OUT_OF_RANGE", "start_position"),
        (
            {"start_position": 4096, "tokens": [3, 4], "hiddens": _row(8, 2)},
            "POSITION_TOO_LARGE",
            "start_position",
        ),
        ({"total_rows": -1}, "BAD_SHAPE", "total_rows"),
        ({"tokens": [V]}, "TOKEN_OUT_OF_RANGE", "tokens"),
        ({"hiddens": T("FP32", [1, H], NAN_ROW.data)}, "NOT_FINITE", "hiddens"),
        ({"hiddens": _row(8, 2)}, "BAD_SHAPE", "hiddens"),
    ],
)
def test_a_prefill_value_no_state_accepts_is_refused_whatever_the_state(
    stub, states, change: dict, reason: str, field: str
) -> None:
    """The first chunk's values, before the state it names is looked at."""
    for state in states:
        chunk = {"state_id": state, "start_position": 1, "tokens": [3], "hiddens": _row(8, 1)}
        assert_refused(raw(stub.Prefill, iter([pb.PrefillChunk(**chunk | change)])), reason, field)


def test_an_import_value_no_state_accepts_is_refused_whatever_the_state(
    stub, states, client: DrafterClient
) -> None:
    info = client.info()
    kv = {"num_key_value_heads": info.num_key_value_heads, "head_dim": info.head_dim}
    ours = {"model_fingerprint": info.model_fingerprint, "dtype": pb.DTYPE_FP32} | kv
    header = pb.KVHeader(**ours, num_rows=1)
    row = [1, info.num_key_value_heads, info.head_dim]
    k = T("FP32", row, bytes(4 * math.prod(row)))
    nan = T("FP32", row, k.data[:-4] + b"\x00\x00\xc0\x7f")
    cases = [
        ({"header": pb.KVHeader(**ours, num_rows=-1)}, "BAD_SHAPE", "header.num_rows"),
        ({"header": pb.KVHeader(**ours, num_rows=4097)}, "POSITION_TOO_LARGE", "header.num_rows"),
        ({"k": nan, "v": k}, "NOT_FINITE", "k"),
        ({"k": T("FP32", [1, H], bytes(4 * H)), "v": k}, "BAD_SHAPE", "k"),
        ({"k": k, "v": k, "first_row": 3}, "CHUNK_MISMATCH", "first_row"),
    ]
    for change, reason, field in cases:
        for state in states:
            chunk = pb.KVChunk(**{"state_id": state, "header": header} | change)
            assert_refused(raw(stub.ImportKV, iter([chunk])), reason, field)


def test_an_export_chunk_size_no_handle_accepts_is_refused_whatever_the_handle(stub) -> None:
    request = pb.ExportKVRequest(handle_id=UNKNOWN, max_chunk_bytes=-1)
    err = raw(lambda r: list(stub.ExportKV(r, timeout=PATIENCE)), request)
    assert_refused(err, "CHUNK_SIZE_OUT_OF_RANGE", "max_chunk_bytes")


# ---- FAILED_PRECONDITION ----------------------------------------------------


def test_steps_out_of_order_fail_precondition(client: DrafterClient, prepared: Prepared) -> None:
    s, h = prepared.state, hiddens(1, 11)
    expect(FailedPrecondition, "PROPOSAL_PENDING", client.propose, s, 1, h, 7, 2)
    expect(FailedPrecondition, "PROPOSAL_PENDING", client.prefill, s, [1], h, 7)
    expect(FailedPrecondition, "PROPOSAL_PENDING", client.take_kv, s)
    fresh = client.alloc_state()
    expect(FailedPrecondition, "NO_PENDING_PROPOSAL", client.after_verify, fresh, 0)
    got = expect(
        FailedPrecondition,
        "NO_PENDING_PROPOSAL",
        client.propose,
        fresh,
        1,
        h,
        1,
        2,
        previous=Verdict(0),
    )
    assert got.code == grpc.StatusCode.FAILED_PRECONDITION
    client.free_state(fresh)


def test_install_into_a_used_state_fails_precondition(
    client: DrafterClient, prepared: Prepared
) -> None:
    donor = client.alloc_state()
    client.prefill(donor, [1, 2, 3], hiddens(3, 12), 1)
    handle = client.take_kv(donor)
    expect(FailedPrecondition, "STATE_NOT_EMPTY", client.install_kv, prepared.state, handle)
    # The refused handle is still there and installs into an empty state.
    assert client.install_kv(donor, handle).num_rows == 3
    client.free_state(donor)


# ---- RESOURCE_EXHAUSTED -----------------------------------------------------


def test_kv_exhaustion_changes_nothing(client: DrafterClient, prepared: Prepared) -> None:
    info = client.info()
    rows = info.kv_blocks_free * info.kv_block_size + 1
    other = client.alloc_state()
    big = np.zeros((rows, H), dtype=np.float32)
    err = expect(
        ResourceExhausted, "KV_BLOCKS_EXHAUSTED", client.prefill, other, [0] * rows, big, 1
    )
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.info().kv_blocks_free == info.kv_blocks_free
    client.free_state(other)


def test_state_slots_exhausted(client: DrafterClient) -> None:
    states = [client.alloc_state() for _ in range(client.info().max_states)]
    expect(ResourceExhausted, "STATES_EXHAUSTED", client.alloc_state)
    client.free_state(states.pop())
    states.append(client.alloc_state())  # a freed slot is reusable
    for state in states:
        client.free_state(state)


def test_oversized_message_is_refused(client: DrafterClient, server) -> None:
    limit = client.info().max_message_bytes
    with grpc.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 2 * limit)]
    ) as channel:
        stub = pb_grpc.DrafterStub(channel)
        huge = pb.Tensor(dtype=pb.DTYPE_FP32, shape=[limit // 4], data=bytes(limit))
        err = raw(stub.Propose, pb.ProposeRequest(state_id=1, hidden=huge))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_hidden_dtypes_are_equivalent(client: DrafterClient, ref: Reference) -> None:
    """bf16 and fp32 hiddens are both accepted; bf16 rounding is the only difference."""
    h32 = hiddens(1, 13)
    h16 = h32.to(torch.bfloat16)
    results = []
    for h in (h16, h16.float().numpy()):
        state = client.alloc_state()
        results.append(client.propose(state, 3, h, 1, 3))
        client.after_verify(state, 0)
        client.free_state(state)
    assert results[0].tokens == results[1].tokens
    assert results[0].probs == pytest.approx(results[1].probs, abs=1e-6)


def test_a_prefill_shorter_than_its_declared_rows_is_rolled_back(
    client: DrafterClient, stub
) -> None:
    state = client.alloc_state()
    free = client.info().kv_blocks_free
    rows = hiddens(6, 14).numpy()
    chunk = pb.PrefillChunk(
        state_id=state, start_position=1, tokens=[1, 2, 3, 4, 5, 6], total_rows=10,
        hiddens=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[6, H], data=rows.tobytes()),
    )  # fmt: skip
    err = raw(stub.Prefill, iter([chunk]))
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INCOMPLETE_PREFILL", "total_rows"
    )  # fmt: skip
    assert client.info().kv_blocks_free == free
    assert client.prefill(state, [1], hiddens(1, 15), 1).num_rows == 1  # still empty before
    client.free_state(state)
