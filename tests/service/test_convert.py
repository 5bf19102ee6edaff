"""Reading Propose and ProposeBatch requests straight into the engine's Step: the checks,
and the tensors."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.client import messages as m
from mtpdraft.client.types import Verdict as ClientVerdict
from mtpdraft.service import convert
from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.engine.step import StepShape
from mtpdraft.v1 import drafter_pb2 as pb

SHAPE = StepShape(hidden_size=8, vocab_size=64, max_batch=4)  # bitmasks of 2 words
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
            convert.propose(bad, SHAPE)
        assert (refused.value.reason, refused.value.field) == (reason, "hidden")
    bad_refeed = pb.ProposeRequest()
    bad_refeed.CopyFrom(good)
    bad_refeed.previous.refeed_hiddens.CopyFrom(_tensor(torch.randn(1, 8)))
    bad_refeed.previous.refeed_hiddens.dtype = pb.DTYPE_INT32
    with pytest.raises(InvalidArgument) as refused:
        convert.propose(bad_refeed, SHAPE)
    assert refused.value.field == "previous.refeed_hiddens"


def test_a_batchs_malformed_tensors_are_refused_with_their_column() -> None:
    good = m.batch_request(
        [1, 2], [3, 4], [5, 6], torch.randn(2, 8), 2,
        num_accepted=[1, -1], refeed_rows=[1, 0], refeed_hiddens=torch.randn(1, 8),
        bitmask_rows=[0, 1], bitmasks=torch.tensor([[5, -1]], dtype=torch.int32),
    )  # fmt: skip
    read = convert.batch(good, SHAPE)
    assert read.state_ids.tolist() == [1, 2] and read.num_accepted.tolist() == [1, -1]
    assert read.refeed_hiddens.shape == (1, 8) and read.bitmasks.tolist() == [[5, -1]]
    assert read.refeed_counts.tolist() == [1, 0] and read.mask_counts.tolist() == [0, 1]
    for column in ("hiddens", "refeed_hiddens", "bitmasks"):
        for reason, spoil in {
            "BAD_DTYPE": lambda t: setattr(t, "dtype", pb.DTYPE_UNSPECIFIED),
            "BAD_BYTE_COUNT": lambda t: setattr(t, "data", t.data[:-1]),
        }.items():
            bad = pb.ProposeBatchRequest()
            bad.CopyFrom(good)
            spoil(getattr(bad, column))
            with pytest.raises(InvalidArgument) as refused:
                convert.batch(bad, SHAPE)
            assert (refused.value.reason, refused.value.field) == (reason, column)
    good.ClearField("hiddens")
    with pytest.raises(InvalidArgument) as refused:
        convert.batch(good, SHAPE)
    assert (refused.value.reason, refused.value.field) == ("MISSING_FIELD", "hiddens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tensors_keep_their_bits_and_shape(dtype: torch.dtype) -> None:
    values = torch.randn(2, 32).to(dtype)
    values[1, 3] = float("nan")  # read as it came: the engine checks a batch's at once
    for shaped in (values, values[0], torch.empty(0, 32, dtype=dtype)):
        back = convert.read_tensor(_tensor(shaped), "hidden", convert.HIDDEN_DTYPES)
        assert back.dtype == dtype and back.shape == shaped.shape  # and the same bits:
        assert torch.equal(back.view(torch.uint8), shaped.contiguous().view(torch.uint8))


def test_a_request_becomes_a_step_of_one_row() -> None:
    hidden = torch.randn(8).to(torch.bfloat16)
    refeed = torch.randn(2, 8)
    refeed[1, 3] = float("inf")  # read as it came: the engine checks a batch's at once
    mask = torch.tensor([5, -1], dtype=torch.int32)
    request = m.propose_request(
        7, 2, hidden, 3, 4, bitmask=mask, min_confidence=0.25, previous=ClientVerdict(2, refeed)
    )
    step, again = convert.propose(request, SHAPE), convert.propose(request, SHAPE)
    assert len(step) == 1
    assert step.state_ids.tolist() == [7] and step.tokens.tolist() == [2]
    assert step.positions.tolist() == [3] and step.num_drafts.tolist() == [4]
    assert step.min_confidence.tolist() == [0.25]
    assert torch.equal(step.hiddens, hidden.reshape(1, 8))
    assert step.mask_counts.tolist() == [1] and torch.equal(step.bitmasks, mask.reshape(1, 2))
    assert step.num_accepted.tolist() == [2] and step.refeed_counts.tolist() == [2]
    assert torch.equal(step.refeed_hiddens, refeed)
    step.hiddens += 1  # writable, and a buffer of its own: the engine may use it as it is
    assert torch.equal(again.hiddens, hidden.reshape(1, 8))
    bare = convert.propose(pb.ProposeRequest(hidden=_tensor(hidden)), SHAPE)
    assert bare.num_accepted.tolist() == [-1] and bare.refeed_hiddens is None
    assert bare.mask_counts.tolist() == [0] and bare.bitmasks is None
