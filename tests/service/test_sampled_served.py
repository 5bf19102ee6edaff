"""Sampled drafts over gRPC: the parameters travel in AllocState, Propose, ProposeBatch and
ProposeStream, q comes back with the drafts, and bad parameters are refused by name.

The drafts and q are checked against the float64 oracle and the reference uniforms of
tests/sampling_reference.py, as the engine's own tests check them.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from draft_count_reference import chosen
from mtp_reference import Reference
from sampling_reference import check_chain
from servers import SERVER_ARGS, start_server

from mtpdraft.client import (
    DrafterClient,
    InvalidArgument,
    ProposeArgs,
    SamplingParams,
    Verdict,
)
from mtpdraft.client import messages as m
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

SUPPORT = 16
K = 3
PROMPT = 9
HOT = SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.01, seed=123)
COLD = SamplingParams(temperature=1.2, top_k=6, seed=2**64 - 1)


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


@pytest.fixture(
    scope="module",
    params=[(), pytest.param(("--device", "cuda", "--dtype", "float32"), marks=pytest.mark.gpu)],
    ids=["cpu", "cuda"],
)
def client(mimo_checkpoint, request):
    """A server on the CPU; on a GPU (marked gpu), its sampled chains are CUDA graphs."""
    server = start_server(
        mimo_checkpoint, *SERVER_ARGS, "--max-sample-top-k", str(SUPPORT), *request.param
    )
    with DrafterClient(server.address, timeout=30.0) as c:
        yield c
    server.stop()


def prompt(client: DrafterClient, ref: Reference, seed: int, sampling=None):
    """A state with PROMPT rows; (state, the proposed token and its hidden appended)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(ref.cfg["vocab_size"], (PROMPT + 1,), generator=gen).tolist()
    hiddens = torch.randn(PROMPT + 1, ref.cfg["hidden_size"], generator=gen)
    state = client.alloc_state(sampling=sampling)
    client.prefill(state, tokens[:PROMPT], hiddens[:PROMPT], 1)
    return state, tokens, hiddens


def test_info_says_how_wide_q_is(client) -> None:
    assert client.info().max_sample_top_k == SUPPORT


def test_propose_and_its_verdicts_draw_as_the_oracle_says(client, ref) -> None:
    state, tokens, hiddens = prompt(client, ref, 1, HOT)
    p = client.propose(state, tokens[-1], hiddens[-1], PROMPT + 1, K)
    check_chain(ref, HOT, state, tokens, hiddens, p, SUPPORT, K)
    refeed, hidden = torch.randn(2, hiddens.shape[1]), torch.randn(hiddens.shape[1])
    # The fused verdict, and new parameters from this step on.
    q = client.propose(
        state, 7, hidden, p.first_position + 2, K, previous=Verdict(2, refeed), sampling=COLD
    )
    tokens += [*p.tokens[:2], 7]
    hiddens = torch.cat([hiddens, refeed, hidden[None]])
    check_chain(ref, COLD, state, tokens, hiddens, q, SUPPORT, K)
    client.free_state(state)


def test_a_batch_changes_the_rows_it_names_and_answers_q_as_columns(client, ref) -> None:
    greedy, tg, hg = prompt(client, ref, 2)
    hot, th, hh = prompt(client, ref, 3, HOT)
    cold, tc, hc = prompt(client, ref, 4)  # greedy until the batch says otherwise
    result = client.propose_batch(
        [greedy, hot, cold],
        [tg[-1], th[-1], tc[-1]],
        [PROMPT + 1] * 3,
        torch.stack([hg[-1], hh[-1], hc[-1]]),
        K,
        sampling={2: COLD},
    )
    assert not result.errors and result.q_ids.shape[:2] == (3, K)
    # The greedy row: its drafts, each its q alone.
    assert (result.q_ids[0, :, 0] == result.drafts[0]).all()
    assert (result.q_probs[0, :, 0] == 1).all() and not result.q_probs[0, :, 1:].any()
    check_chain(ref, HOT, hot, th, hh, result.proposal(1), SUPPORT, K)
    check_chain(ref, COLD, cold, tc, hc, result.proposal(2), SUPPORT, K)
    # The same over the stream, a state's new parameters in ProposeArgs.
    with client.stream() as stream:
        row = stream.propose(greedy, 5, hg[-1], result.first_positions[0], K, previous=0,
                             sampling=HOT)  # fmt: skip
    check_chain(ref, HOT, greedy, [*tg, 5], torch.cat([hg, hg[-1:]]), row, SUPPORT, K)
    for state in (greedy, hot, cold):
        client.free_state(state)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(1.0, top_k=-5), "top_k"),
        (SamplingParams(1.0, top_p=-0.5), "top_p"),
        (SamplingParams(1.0, min_p=2.0), "min_p"),
    ],
)
def test_bad_parameters_are_refused_by_name_and_change_nothing(
    client, ref, sampling, field
) -> None:
    live = client.info().live_states
    with pytest.raises(InvalidArgument, match=f"sampling.{field}") as err:
        client.alloc_state(sampling=sampling)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == "BAD_SAMPLING" and err.value.field == "sampling"
    assert client.info().live_states == live
    # In a batch the row fails alone, its state unchanged: it drafts greedily after.
    state, tokens, hiddens = prompt(client, ref, 5)
    args = ProposeArgs(state, tokens[-1], hiddens[-1], PROMPT + 1, K, sampling=sampling)
    failed = client.propose_many([args])
    assert failed.errors[0].reason == "BAD_SAMPLING" and failed.q_ids is None
    p = client.propose(state, tokens[-1], hiddens[-1], PROMPT + 1, K)
    assert p.q_ids is None
    client.free_state(state)


@pytest.mark.parametrize("rows", [[1], [-1], [0, 0], []])
def test_sampling_rows_that_do_not_fit_refuse_the_message(client, ref, rows) -> None:
    """Rows past the batch, repeated, or not one per value: INVALID_ARGUMENT for the whole
    message, naming sampling_rows; nothing changes."""
    state, tokens, hiddens = prompt(client, ref, 6)
    req = m.batch_request([state], [tokens[-1]], [PROMPT + 1], hiddens[-1:], K)
    req.sampling_rows.extend(rows)
    for _ in range(len(rows) or 1):
        m.sampling_message(HOT, into=req.sampling.add())
    with grpc.insecure_channel(client.target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.DrafterStub(channel).ProposeBatch(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_rows" in err.value.details()
    assert client.propose(state, tokens[-1], hiddens[-1], PROMPT + 1, K).q_ids is None
    client.free_state(state)
    np.testing.assert_equal(client.info().live_states, 0)


def test_the_drafter_chooses_k_over_every_path(client, ref) -> None:
    """num_drafts 0: the count kept is the rule's over the chain drafted to the cap (a
    twin state asks for the cap), through Propose, ProposeBatch and the stream."""
    cost, cap = 0.15, 4
    for path in ("propose", "batch", "stream"):
        fixed, tokens, hiddens = prompt(client, ref, 7)
        auto, _, _ = prompt(client, ref, 7)
        full = client.propose(fixed, tokens[-1], hiddens[-1], PROMPT + 1, cap)
        args = (auto, tokens[-1], hiddens[-1], PROMPT + 1, 0)
        if path == "propose":
            got = client.propose(*args, draft_cap=cap, verify_token_cost=cost)
        elif path == "batch":
            got = client.propose_batch(
                [auto], [tokens[-1]], [PROMPT + 1], hiddens[-1:], 0, draft_caps=cap,
                verify_token_costs=cost,
            ).proposal(0)  # fmt: skip
        else:
            with client.stream() as stream:
                got = stream.propose(*args, draft_cap=cap, verify_token_cost=cost)
        n = chosen(full.probs, 1.0, cost)
        assert got.tokens == full.tokens[:n], path
        client.free_state(fixed)
        client.free_state(auto)
