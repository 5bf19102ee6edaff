"""The served GPU path against the float64 oracle: `mtpdraft serve --device cuda` over gRPC.

The server runs the Triton kernels under CUDA graphs at MiMo-7B's MTP shape
(random weights), and every draft it serves is checked against the oracle
(tests/mtp_reference.py), which recomputes the chain in float64 on the CPU from
the same checkpoint files. The oracle is teacher-forced with the served drafts:
each served draft must be the oracle's top-1 at that step, or within the
compute dtype's rounding of it (a tie, where either token is right), and the
chain goes on from the served token, so one tie does not end the comparison.

Tolerances (tests/precision.py), from the compute dtype's unit roundoff u (bf16 2**-8,
fp32 2**-24): every stored activation is rounded once (u), and the kernels accumulate
their dot products in fp32, n terms at most (the MLP's intermediate size), whose error
grows as sqrt(n) * 2**-24. The served logits may then differ from float64 by a few such
errors of the largest logit: gap = TIE_ROUNDINGS * (u + sqrt(n) * 2**-24) * max|logit|,
under which two tokens tie; a probability, softmax of logits each off by at most the
gap, by a factor exp(2 * gap). (On the H200 the worst seen was a third of that in bf16,
a tenth in fp32.) tests/served_chains.py drives the states and checks the drafts.
"""

from __future__ import annotations

import math

import pytest
import torch
from mtp_reference import Reference
from precision import rounding
from served_chains import Sequence
from servers import start_server

from mtpdraft.client import DrafterClient, ProposeArgs, Verdict
from mtpdraft.service.model.synthetic import write_random_checkpoint

pytestmark = pytest.mark.gpu

# MiMo-7B's MTP layer (service/model/config.py reads these keys from config.json).
REAL_SHAPE = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=11008,
    vocab_size=151680,
)
K = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("mimo7b"), "mimo", dtype=torch.bfloat16, seed=5, **REAL_SHAPE
    )


@pytest.fixture(scope="module")
def ref(checkpoint) -> Reference:
    return Reference(checkpoint)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def served(request, checkpoint):
    """A GPU server of the checkpoint (Triton ops, CUDA graphs) in the given compute dtype."""
    proc = start_server(
        checkpoint, "--device", "cuda", "--dtype", request.param,
        "--kv-blocks", "64", "--block-size", "16", "--max-drafts", "8", "--max-batch", "8",
    )  # fmt: skip
    try:
        with DrafterClient(proc.address, timeout=120.0) as client:
            info = client.info()
            assert info.device.startswith("cuda") and info.compute_dtype == request.param
            yield client, request.param, rounding(request.param, REAL_SHAPE["intermediate_size"])
            assert client.info().live_states == 0
    finally:
        proc.stop()


def test_served_chains_match_the_oracle_through_every_verdict(served, ref) -> None:
    """Multi-step chains; a = 0, 0 < a < K, a = K; refeed and own hiddens; fused verdicts."""
    client, dtype, u = served
    seq = Sequence(ref, client, 21, 1, dtype, u)
    try:
        verdicts = [(0, False), (2, False), (K, False), (1, True), (K, True), (3, False)]
        previous = None
        for accepted, refeed in verdicts:
            token, hidden = seq.next_input()
            got = client.propose(seq.state, token, hidden, seq.position, K, previous=previous)
            assert len(got.tokens) == K
            seq.check(token, hidden, got)
            assert got.confidence == pytest.approx(min(got.probs))
            hiddens = seq.random_hiddens(accepted) if refeed else None
            seq.verdict(accepted, hiddens)
            previous = Verdict(accepted, hiddens)
        token, hidden = seq.next_input()
        got = client.propose(seq.state, token, hidden, seq.position, 2, previous=previous)
        seq.check(token, hidden, got)
        client.after_verify(seq.state, 0)
    finally:
        client.free_state(seq.state)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's packed int32 words: bit t % 32 of word t // 32 allows token t."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return words.to(torch.int32)  # bit 31 wraps into the sign, as in xgrammar


def test_served_bitmask_matches_the_oracle(served, ref) -> None:
    client, dtype, u = served
    seq = Sequence(ref, client, 9, 2, dtype, u)
    try:
        vocab = ref.cfg["vocab_size"]
        gen = torch.Generator().manual_seed(3)
        allowed = torch.rand(K, vocab, generator=gen) < 1 / 16
        token, hidden = seq.next_input()
        got = client.propose(seq.state, token, hidden, seq.position, K, bitmask=_bitmask(allowed))
        seq.check(token, hidden, got, allowed)
        assert all(allowed[j, t] for j, t in enumerate(got.tokens))
        client.after_verify(seq.state, 2)
        seq.verdict(2)
        token, hidden = seq.next_input()  # one row of mask for all drafts: the last row repeats
        got = client.propose(
            seq.state, token, hidden, seq.position, K, bitmask=_bitmask(allowed[2:3])
        )
        seq.check(token, hidden, got, allowed[2:3])
        assert all(allowed[2, t] for t in got.tokens)
        client.after_verify(seq.state, 0)
    finally:
        client.free_state(seq.state)


def test_served_min_confidence_cuts_the_chain_where_the_oracle_does(served, ref) -> None:
    """Twin states take the same step: the full chain, then with a threshold between two
    of its running minima, which must cut the chain right where the minimum falls below.

    The first three steps allow two tokens each, the rest all: the chain's confidence
    falls at the fourth draft by far more than rounding could move it."""
    client, dtype, u = served
    full_seq, short_seq = (Sequence(ref, client, 9, 4, dtype, u) for _ in range(2))
    try:
        vocab = ref.cfg["vocab_size"]
        gen = torch.Generator().manual_seed(5)
        shaped = torch.ones(8, vocab, dtype=torch.bool)
        shaped[:3] = False
        shaped[torch.arange(3)[:, None], torch.randperm(vocab, generator=gen)[:6].view(3, 2)] = True
        mask = _bitmask(shaped)
        token, hidden = full_seq.next_input()
        assert short_seq.next_input()[0] == token
        full = client.propose(full_seq.state, token, hidden, full_seq.position, 8, bitmask=mask)
        probs, gaps = full_seq.check(token, hidden, full, shaped)
        client.after_verify(full_seq.state, 0)
        # A drop of the running minimum wider than twice the probability tolerance on each
        # side (2 * gap, in log terms) leaves room for a threshold no rounding can cross.
        running = [min(probs[: i + 1]) for i in range(8)]
        drops = [
            i for i in range(1, 8) if math.log(running[i - 1] / running[i]) > 4 * max(gaps[: i + 1])
        ]
        assert drops, f"no clear drop of the chain's confidence: {running}"
        cut = drops[0]
        tau = math.sqrt(running[cut] * running[cut - 1])
        seq = short_seq
        short = client.propose(
            seq.state, token, hidden, seq.position, 8, bitmask=mask, min_confidence=tau
        )
        assert short.tokens == full.tokens[:cut]  # the draft below tau is not returned
        seq.check(token, hidden, short, shaped)
        assert min(short.probs) >= tau > short.confidence
        # Accepting every returned draft keeps their rows, the stopping row included.
        client.after_verify(seq.state, len(short.tokens))
        seq.verdict(len(short.tokens))
        token, hidden = seq.next_input()
        seq.check(token, hidden, client.propose(seq.state, token, hidden, seq.position, 3))
        client.after_verify(seq.state, 3)
    finally:
        client.free_state(full_seq.state)
        client.free_state(short_seq.state)


def test_served_batch_matches_the_oracle(served, ref) -> None:
    """One ProposeBatch over states of different lengths, K and verdicts."""
    client, dtype, u = served
    seqs = [Sequence(ref, client, n, 10 + n, dtype, u) for n in (1, 17, 40)]
    try:
        for step in range(2):
            inputs = [seq.next_input() for seq in seqs]
            ks = [K, 2, 6][step:] + [K, 2, 6][:step]
            requests = [
                ProposeArgs(seq.state, tok, hid, seq.position, k, previous=(step and 1) or None)
                for seq, (tok, hid), k in zip(seqs, inputs, ks, strict=True)
            ]
            got = client.propose_many(requests).proposals()
            for seq, (tok, hid), proposal, k in zip(seqs, inputs, got, ks, strict=True):
                assert len(proposal.tokens) == k
                seq.check(tok, hid, proposal)
                seq.verdict(1)
        for seq in seqs:
            client.after_verify(seq.state, 1)
    finally:
        for seq in seqs:
            client.free_state(seq.state)
