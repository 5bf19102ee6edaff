"""Over a served wire, with raw stubs: a batch row's grammar (compiled in the serving
loop, off the engine's thread) masks its drafts and a bad one fails its row alone, named
by column; a state's grammar leaves with ExportKV's header and comes back by ImportKV."""

from __future__ import annotations

import grpc
import pytest
import torch
from drafting import hiddens
from grammars import EOS, unpacked
from servers import PATIENCE, SERVER_ARGS, start_server

from mtpdraft.service import convert
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(checkpoint):
    proc = start_server(checkpoint, *SERVER_ARGS, "--grammar-compile-timeout", "20")
    with grpc.insecure_channel(proc.address) as channel:
        yield pb_grpc.DrafterStub(channel)
    proc.stop()


def fresh(stub) -> int:
    state = stub.AllocState(pb.AllocStateRequest(), timeout=PATIENCE).state_id
    chunk = pb.PrefillChunk(state_id=state, start_position=1, tokens=[1, 2, 3])
    chunk.hiddens.CopyFrom(convert.tensor(hiddens(3, state % 1000)))
    stub.Prefill(iter([chunk]), timeout=PATIENCE)
    return state


def test_grammar_rows_over_the_wire_and_the_kv_header(stub):
    a, b = fresh(stub), fresh(stub)
    msg = pb.ProposeBatchRequest(
        request_id=7, state_ids=[a, b], tokens=[ord("1"), ord("1")], positions=[4, 4],
        num_drafts=[4], return_bitmasks=True, grammar_rows=[0, 1],
        grammars=[pb.Grammar(regex="[0-3]{4}"), pb.Grammar(regex="[0-")],
    )  # fmt: skip
    msg.hiddens.CopyFrom(convert.tensor(hiddens(2, 9)))
    answer = stub.ProposeBatch(msg, timeout=PATIENCE)
    (error,) = answer.errors
    assert error.row == 1 and error.error.reason == "GRAMMAR_INVALID"
    assert error.error.field == "grammars"
    drafts = answer.drafts[: answer.draft_counts[0]]
    # Three digits more, then the stop token: all the grammar allows after "1".
    assert len(drafts) == 4 and all(ord("0") <= d <= ord("3") for d in drafts[:3])
    assert drafts[3] == EOS and list(answer.bitmask_rows) == [5, 0]
    stub.AfterVerify(
        pb.AfterVerifyRequest(state_id=a, verdict=pb.Verdict(num_accepted=1)), timeout=PATIENCE
    )
    handle = stub.TakeKV(pb.TakeKVRequest(state_id=a), timeout=PATIENCE).handle_id
    chunks = list(stub.ExportKV(pb.ExportKVRequest(handle_id=handle), timeout=PATIENCE))
    header = chunks[0].header
    assert header.grammar.regex == "[0-3]{4}" and list(header.grammar_tokens) == [
        ord("1"),
        drafts[0],
    ]
    c = stub.AllocState(pb.AllocStateRequest(), timeout=PATIENCE).state_id
    chunks[0].state_id = c
    stub.ImportKV(iter(chunks), timeout=PATIENCE)
    # Two digits committed of four: after one more, one digit, then the stop token only.
    ask = pb.ProposeRequest(state_id=c, token=ord("2"), position=6, num_drafts=4,
                            return_bitmasks=True)  # fmt: skip
    ask.hidden.CopyFrom(convert.tensor(hiddens(1, 11)[0]))
    got = stub.Propose(ask, timeout=PATIENCE)
    masks = unpacked(torch.frombuffer(bytearray(got.bitmasks.data), dtype=torch.int32))
    assert masks[0, ord("0") : ord("4")].all() and masks[0].sum() == 4
    assert len(got.tokens) == 2 and not masks[1, ord("0") : ord("4")].any()
