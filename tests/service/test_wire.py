"""Reading Propose and ProposeBatch requests into the engine's arguments: the checks, and the
tensors."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.client import messages as m
from mtpdraft.client.types import Verdict as ClientVerdict
from mtpdraft.service import wire
from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.v1 import drafter_pb2 as pb

_WIRE = {torch.bfloat16: pb.DTYPE_BF16, torch.float16: pb.DTYPE_FP16, torch.float32: pb.DTYPE_FP32}


def _tensor(values: torch.Tensor) -> pb.Tensor:
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=_WIRE[values.dtype], shape=list(values.shape), data=raw)


def test_malformed_tensors_are_refused_with_their_field() -> None:
    good = m.propose_request(1, 2, torch.randn(8), 3, 2, previous=ClientVerdict(1))
    cases = {
        "BAD_DTYPE": lambda r: setattr(r.hidden, "dtype", pb.DTYPE_INT32),
        "BAD_BYTE_COUNT": lambda r: setattr(r.hidden, "data", r.hidden.data[:-1]),
        "BAD_SHAPE": lambda r: r.hidden.shape.append(2**31),
        "MISSING_FIELD": lambda r: r.ClearField("hidden"),
    }
    for reason, spoil in cases.items():
        bad = pb.ProposeRequest()
        bad.CopyFrom(good)
        spoil(bad)
        with pytest.raises(InvalidArgument) as refused:
            wire.propose_args(bad)
        assert (refused.value.reason, refused.value.field) == (reason, "hidden")
    bad_refeed = pb.ProposeRequest()
    bad_refeed.CopyFrom(good)
    bad_refeed.previous.refeed_hiddens.CopyFrom(_tensor(torch.randn(1, 8)))
    bad_refeed.previous.refeed_hiddens.dtype = pb.DTYPE_INT32
    with pytest.raises(InvalidArgument) as refused:
        wire.propose_args(bad_refeed)
    assert refused.value.field == "previous.refeed_hiddens"


def test_a_batchs_malformed_tensors_are_refused_with_their_column() -> None:
    good = m.batch_request(
        [1, 2], [3, 4], [5, 6], torch.randn(2, 8), 2,
        num_accepted=[1, -1], refeed_rows=[1, 0], refeed_hiddens=torch.randn(1, 8),
        bitmask_rows=[0, 1], bitmasks=torch.tensor([[5, -1]], dtype=torch.int32),
    )  # fmt: skip
    read = wire.batch(good)
    assert read.state_ids == [1, 2] and read.num_accepted == [1, -1]
    assert read.refeed_hiddens.shape == (1, 8) and read.bitmasks.tolist() == [[5, -1]]
    for column in ("hiddens", "refeed_hiddens", "bitmasks"):
        for reason, spoil in {
            "BAD_DTYPE": lambda t: setattr(t, "dtype", pb.DTYPE_UNSPECIFIED),
            "BAD_BYTE_COUNT": lambda t: setattr(t, "data", t.data[:-1]),
        }.items():
            bad = pb.ProposeBatchRequest()
            bad.CopyFrom(good)
            spoil(getattr(bad, column))
            with pytest.raises(InvalidArgument) as refused:
                wire.batch(bad)
            assert (refused.value.reason, refused.value.field) == (reason, column)
    good.ClearField("hiddens")
    with pytest.raises(InvalidArgument) as refused:
        wire.batch(good)
    assert (refused.value.reason, refused.value.field) == ("MISSING_FIELD", "hiddens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tensors_keep_their_bits_and_shape(dtype: torch.dtype) -> None:
    values = torch.randn(2, 32).to(dtype)
    values[1, 3] = float("nan")  # read as it came: the engine checks a batch's at once
    for shaped in (values, values[0], torch.empty(0, 32, dtype=dtype)):
        back = wire.read_tensor(_tensor(shaped), "hidden", wire.HIDDEN_DTYPES)
        assert back.dtype == dtype and back.shape == shaped.shape  # and the same bits:
        assert torch.equal(back.view(torch.uint8), shaped.contiguous().view(torch.uint8))


def test_a_request_becomes_the_engines_arguments() -> None:
    hidden = torch.randn(8).to(torch.bfloat16)
    refeed = torch.randn(2, 8)
    refeed[1, 3] = float("inf")
    mask = torch.tensor([5, -1], dtype=torch.int32)
    request = m.propose_request(
        7, 2, hidden, 3, 4, bitmask=mask, min_confidence=0.25, previous=ClientVerdict(2, refeed)
    )
    args, again = wire.propose_args(request), wire.propose_args(request)
    assert (args.state_id, args.token, args.position, args.num_drafts) == (7, 2, 3, 4)
    assert args.min_confidence == 0.25
    assert torch.equal(args.hidden, hidden)
    assert torch.equal(args.bitmask, mask)
    assert args.previous.num_accepted == 2
    assert torch.equal(args.previous.refeed_hiddens, refeed)
    args.hidden += 1  # writable, and a buffer of its own: the engine may use it as it is
    assert torch.equal(again.hidden, hidden)
    assert wire.propose_args(pb.ProposeRequest(hidden=_tensor(hidden))).previous is None
