"""Reading Propose requests into plain values: the checks, and the NaN/inf flag against torch."""

from __future__ import annotations

import pickle

import pytest
import torch

from mtpdraft.client import messages as m
from mtpdraft.client.types import Verdict as ClientVerdict
from mtpdraft.service import wire
from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.wire_values import read_hiddens, read_propose, read_proposes
from mtpdraft.v1 import drafter_pb2 as pb

_WIRE = {torch.bfloat16: pb.DTYPE_BF16, torch.float16: pb.DTYPE_FP16, torch.float32: pb.DTYPE_FP32}


def _tensor(values: torch.Tensor) -> pb.Tensor:
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=_WIRE[values.dtype], shape=list(values.shape), data=raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finite_flag_matches_isfinite_at_the_edges(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0]
    nonfinite = [float("inf"), -float("inf"), float("nan"), -float("nan")]
    for value in edges + nonfinite:
        for where in (0, 37, 63):  # first, inner, last element
            values = torch.randn(2, 32).to(dtype)
            values.view(-1)[where] = value
            raw = read_hiddens(_tensor(values), "hidden", flag_finite=True)
            assert raw.finite == bool(torch.isfinite(values).all()), (value, where)
            back = wire.to_tensor(raw)
            assert back.dtype == dtype  # and the same bits (NaN equals nothing):
            assert torch.equal(back.view(torch.uint8), values.view(torch.uint8))
    assert read_hiddens(_tensor(torch.empty(0, 32, dtype=dtype)), "hidden", True).finite


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
            read_propose(bad, flag_finite=False)
        assert (refused.value.reason, refused.value.field) == (reason, "hidden")
        with pytest.raises(InvalidArgument) as in_batch:
            read_proposes([good, bad], batch=True, flag_finite=False)
        assert in_batch.value.message == f"requests[1].{refused.value.message}"
    bad_refeed = pb.ProposeRequest()
    bad_refeed.CopyFrom(good)
    bad_refeed.previous.refeed_hiddens.CopyFrom(_tensor(torch.randn(1, 8)))
    bad_refeed.previous.refeed_hiddens.dtype = pb.DTYPE_INT32
    with pytest.raises(InvalidArgument) as refused:
        read_propose(bad_refeed, flag_finite=True)
    assert refused.value.field == "previous.refeed_hiddens"


def test_read_values_cross_a_pickle_and_become_the_engines_arguments() -> None:
    hidden = torch.randn(8).to(torch.bfloat16)
    refeed = torch.randn(2, 8)
    refeed[1, 3] = float("inf")
    mask = torch.tensor([5, -1], dtype=torch.int32)
    request = m.propose_request(
        7, 2, hidden, 3, 4, bitmask=mask, min_confidence=0.25, previous=ClientVerdict(2, refeed)
    )
    read = read_proposes([request, request], batch=False, flag_finite=True)
    read[1:] = read_proposes([request], batch=False, flag_finite=False)
    args, unflagged = [wire.propose_args(r) for r in pickle.loads(pickle.dumps(read, protocol=5))]
    # Unflagged: the engine checks them itself (a process's loop beside the engine's thread).
    assert unflagged.hidden_finite is None and unflagged.previous.refeed_finite is None
    assert (args.state_id, args.token, args.position, args.num_drafts) == (7, 2, 3, 4)
    assert args.min_confidence == 0.25
    assert torch.equal(args.hidden, hidden) and args.hidden_finite
    assert torch.equal(args.bitmask, mask)
    assert args.previous.num_accepted == 2 and not args.previous.refeed_finite
    assert torch.equal(args.previous.refeed_hiddens, refeed)
    args.hidden += 1  # writable: the engine may use the buffer as it is
