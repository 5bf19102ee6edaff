"""One rule for a tensor of rows in every RPC: one row may come flat.

A tensor of rows (hiddens and refeeds [n, H], bitmask words [n, W]) that holds one row
may be sent as [H] ([W]) and means the same as [1, H]; a flat tensor never stands for
more than one row. Checked over the shared server for every field that carries rows,
against the float64 oracle.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from drafting import Expected, H, V, hiddens, tokens
from mtp_reference import Reference
from servers import PATIENCE

from mtpdraft.client import DrafterClient
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

WORDS = (V + 31) // 32
ALLOWED = list(range(0, V, 3))  # a grammar's tokens: every third


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.DrafterStub(channel)


def one_row(t: torch.Tensor, flat: bool) -> pb.Tensor:
    """A tensor of one row on the wire: [X] when `flat`, else [1, X]."""
    dtype = pb.DTYPE_INT32 if t.dtype == torch.int32 else pb.DTYPE_FP32
    shape = [t.numel()] if flat else [1, t.numel()]
    return pb.Tensor(dtype=dtype, shape=shape, data=t.contiguous().numpy().tobytes())


def mask() -> tuple[torch.Tensor, torch.Tensor]:
    """(the bitmask words of ALLOWED, [W] int32; the oracle's [1, V] mask)."""
    bits = [0] * WORDS
    for t in ALLOWED:
        bits[t // 32] |= 1 << (t % 32)
    words = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)
    allow = torch.zeros(1, V, dtype=torch.bool)
    allow[0, ALLOWED] = True
    return words, allow


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "1-row"])
def test_one_row_may_come_flat_in_every_rpc(
    client: DrafterClient, stub, ref: Reference, flat: bool
) -> None:
    """Prefill's hiddens, Propose's hidden, a verdict's refeed (AfterVerify and
    Propose.previous), a bitmask, and ProposeBatch's hiddens, refeed and bitmask rows:
    each one row, flat or not, drafts what the oracle says."""
    state, exp = client.alloc_state(), Expected(ref)
    words, allow = mask()

    def check(got_tokens, expected) -> None:
        assert list(got_tokens) == expected[0]

    try:
        toks, hid = tokens(1, 1), hiddens(1, 1)
        chunk = pb.PrefillChunk(
            state_id=state, start_position=1, tokens=toks, hiddens=one_row(hid, flat)
        )
        assert stub.Prefill(iter([chunk]), timeout=PATIENCE).num_rows == 1
        exp.add(toks, hid)

        x, h = 7, hiddens(1, 2)
        request = pb.ProposeRequest(
            state_id=state, token=x, hidden=one_row(h, flat), position=2, num_drafts=3
        )
        check(stub.Propose(request, timeout=PATIENCE).tokens, exp.propose(x, h, 3))

        refeed = hiddens(1, 3)
        verdict = pb.Verdict(num_accepted=1, refeed_hiddens=one_row(refeed, flat))
        stub.AfterVerify(pb.AfterVerifyRequest(state_id=state, verdict=verdict), timeout=PATIENCE)
        exp.verdict(1, refeed)

        x, h, refeed = 9, hiddens(1, 4), hiddens(1, 5)
        request = pb.ProposeRequest(
            state_id=state,
            token=x,
            hidden=one_row(h, flat),
            position=exp.next_position,
            num_drafts=3,
            bitmask=one_row(words, flat),
        )
        check(stub.Propose(request, timeout=PATIENCE).tokens, exp.propose(x, h, 3, allow))
        x, h = 11, hiddens(1, 6)
        request.token = x
        request.hidden.CopyFrom(one_row(h, flat))
        request.previous.CopyFrom(pb.Verdict(num_accepted=1, refeed_hiddens=one_row(refeed, flat)))
        exp.verdict(1, refeed)
        request.position = exp.next_position
        check(stub.Propose(request, timeout=PATIENCE).tokens, exp.propose(x, h, 3, allow))

        x, h, refeed = 13, hiddens(1, 7), hiddens(1, 8)
        exp.verdict(1, refeed)
        request = pb.ProposeBatchRequest(
            state_ids=[state],
            tokens=[x],
            positions=[exp.next_position],
            hiddens=one_row(h, flat),
            num_drafts=[2],
            num_accepted=[1],
            refeed_rows=[1],
            refeed_hiddens=one_row(refeed, flat),
            bitmask_rows=[1],
            bitmasks=one_row(words, flat),
        )
        answer = stub.ProposeBatch(request, timeout=PATIENCE)
        assert not answer.errors, answer.errors
        check(answer.drafts[: answer.draft_counts[0]], exp.propose(x, h, 2, allow))
        client.after_verify(state, 0)
    finally:
        client.free_state(state)


def test_a_flat_tensor_is_never_more_than_one_row(client: DrafterClient, stub) -> None:
    state = client.alloc_state()
    flat = one_row(hiddens(1, 9), flat=True)
    try:
        chunk = pb.PrefillChunk(state_id=state, start_position=1, tokens=[1, 2], hiddens=flat)
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(iter([chunk]), timeout=PATIENCE)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"expected shape [2, {H}], got [{H}]" in err.value.details()
        client.prefill(state, tokens(2, 9), hiddens(2, 9), 1)
        client.propose(state, 1, hiddens(1, 10), 3, 3)
        verdict = pb.Verdict(num_accepted=2, refeed_hiddens=flat)
        with pytest.raises(grpc.RpcError) as err:
            stub.AfterVerify(pb.AfterVerifyRequest(state_id=state, verdict=verdict))
        assert f"expected shape [2, {H}], got [{H}]" in err.value.details()
        request = pb.ProposeBatchRequest(
            state_ids=[state, 12345], tokens=[1, 1], positions=[4, 4], hiddens=flat, num_drafts=[1]
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.ProposeBatch(request, timeout=PATIENCE)
        assert f"expected shape [2, {H}], got [{H}]" in err.value.details()
        client.after_verify(state, 0)
    finally:
        client.free_state(state)


def test_the_python_client_takes_one_row_flat_too(client: DrafterClient, ref: Reference) -> None:
    """Its eager checks follow the same rule: Prefill's hiddens, a verdict's refeed and
    ProposeBatch's hiddens, refeed and bitmask rows, each one row given as [X]."""
    state, exp = client.alloc_state(), Expected(ref)
    words, allow = mask()
    try:
        toks, hid = tokens(1, 11), hiddens(1, 11)
        assert client.prefill(state, toks, hid[0], 1).num_rows == 1
        exp.add(toks, hid)
        x, h = 5, hiddens(1, 12)
        assert client.propose(state, x, h[0], 2, 3).tokens == exp.propose(x, h, 3)[0]
        refeed = hiddens(1, 13)
        client.after_verify(state, 1, refeed_hiddens=refeed[0])
        exp.verdict(1, refeed)
        x, h = 6, hiddens(1, 14)
        step = client.propose_batch(
            [state], [x], [exp.next_position], h[0], 2, bitmask_rows=[1], bitmasks=words
        )
        assert step.drafts[0, : step.counts[0]].tolist() == exp.propose(x, h, 2, allow)[0]
        x, h, refeed = 8, hiddens(1, 15), hiddens(1, 16)
        exp.verdict(1, refeed)
        step = client.propose_batch(
            [state], [x], [exp.next_position], h[0], 2,
            num_accepted=[1], refeed_rows=[1], refeed_hiddens=refeed[0],
        )  # fmt: skip
        assert step.drafts[0, : step.counts[0]].tolist() == exp.propose(x, h, 2)[0]
        client.after_verify(state, 0)
    finally:
        client.free_state(state)
