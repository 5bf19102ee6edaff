"""Sampled drafts in the engine, every family, against the float64 oracles.

Each draft's q must be the oracle's logits processed as vLLM does (tests/
sampling_reference.py) after the same chain of tokens, and each draft the token that
q and the uniform of its key (seed, state, position, draft index) draw, as the contract
says; a verdict with refeed (the recompute path's first draft) and one without both
feed the next proposal. fp32 on the CPU, q within sampling_reference.Q_ATOL of
float64's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_checkpoints import write_deepseek_checkpoint
from deepseek_reference import DeepseekReference
from family_checkpoints import write_family_checkpoint
from family_reference import FamilyReference
from mtp_reference import Reference
from proposing import ProposeArgs, propose, propose_batch
from sampling_reference import check_chain, dense_q, drawn, uniform

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

SUPPORT = 12
K = 3
PROMPT = 10
CASES = [  # temperature, top_k, top_p, min_p, seed
    Sampling(1.0, 0, 1.0, 0.0, 7),
    Sampling(0.7, 5, 0.9, 0.0, 2**63 + 5),
    Sampling(1.5, 0, 0.8, 0.05, 11),
]


def _oracle(folder: Path, family: str):
    if family == "mimo":
        return Reference(write_random_checkpoint(folder, "mimo", seed=4))
    if family == "deepseek-v3":
        write_deepseek_checkpoint(folder, "deepseek-v3", seed=4)
        return DeepseekReference(folder)
    write_family_checkpoint(folder, family, seed=4)
    return FamilyReference(folder)


@pytest.fixture(scope="module", params=["mimo", "glm-4.5", "qwen3-next", "deepseek-v3"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = _oracle(folder, request.param)
    head = MTPHead(load_mtp_weights(folder), torch.device("cpu"))
    config = ServeConfig(kv_blocks=96, block_size=4, max_drafts=4, max_sample_top_k=SUPPORT)
    return ref, DraftEngine(head, config)


def test_sampled_drafts_are_the_oracles_q_drawn_at_their_keys(family) -> None:
    ref, engine = family
    h = ref.cfg["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    vocab = ref.cfg["vocab_size"]
    for sampling in CASES:
        state = engine.alloc_state(sampling=sampling)
        tokens = torch.randint(vocab, (PROMPT + 1,), generator=gen).tolist()
        hiddens = torch.randn(PROMPT + 1, h, generator=gen)
        session = engine.begin_prefill(state, 1)
        session.append(tokens[:PROMPT], hiddens[:PROMPT])
        session.finish()
        p = propose(engine, ProposeArgs(state, tokens[-1], hiddens[-1], PROMPT + 1, K))
        check_chain(ref, sampling, state, tokens, hiddens, p, SUPPORT, K)
        # A verdict of 2 with refeed: the first draft comes from the recomputed rows.
        refeed = torch.randn(2, h, generator=gen)
        token, hidden = (
            int(torch.randint(vocab, (1,), generator=gen)),
            torch.randn(h, generator=gen),
        )
        position = p.first_position + 2
        q = propose(
            engine,
            ProposeArgs(state, token, hidden, position, K, previous=Verdict(2, refeed)),
        )
        tokens += [*p.tokens[:2], token]
        hiddens = torch.cat([hiddens, refeed, hidden[None]])
        check_chain(ref, sampling, state, tokens, hiddens, q, SUPPORT, K)
        # A verdict of 1 without refeed: the accepted draft's row keeps the chain's hidden.
        kept = ref.rows(tokens, hiddens.double(), step=0)[-1].float()
        token, hidden = 3, torch.randn(h, generator=gen)
        r = propose(
            engine, ProposeArgs(state, token, hidden, q.first_position + 1, K, previous=Verdict(1))
        )
        tokens += [q.tokens[0], token]
        hiddens = torch.cat([hiddens, kept[None], hidden[None]])
        check_chain(ref, sampling, state, tokens, hiddens, r, SUPPORT, K)
        engine.free_state(state)


def test_a_draw_depends_on_its_key_alone(family) -> None:
    """The same state drafts the same whether alone or in a batch with others, greedy
    and sampled ones; a greedy state's q is its draft alone."""
    ref, engine = family
    h, vocab = ref.cfg["hidden_size"], ref.cfg["vocab_size"]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(vocab, (PROMPT,), generator=gen).tolist()
    hiddens = torch.randn(PROMPT + 1, h, generator=gen)

    def fresh(sampling: Sampling) -> int:
        state = engine.alloc_state(sampling=sampling)
        session = engine.begin_prefill(state, 1)
        session.append(tokens[:-1], hiddens[: PROMPT - 1])
        session.finish()
        return state

    def args(state: int) -> ProposeArgs:
        return ProposeArgs(state, tokens[-1], hiddens[-1], PROMPT, K)

    alone = fresh(CASES[0])
    one = propose(engine, args(alone))
    others = [fresh(CASES[1]), fresh(Sampling()), fresh(CASES[2])]
    again = fresh(CASES[0])
    # The state's id is a key word: another state with its seed draws otherwise, so its
    # drafts are compared with the draws of its own key.
    batch = propose_batch(engine, [args(s) for s in [others[0], again, *others[1:]]])
    greedy = batch[2]
    assert greedy.q_probs == [[1.0] + [0.0] * (len(greedy.q_probs[0]) - 1)] * K
    assert [row[0] for row in greedy.q_ids] == greedy.tokens
    for j in range(K):
        for p, state in ((one, alone), (batch[1], again)):
            q = dense_q(p, j, vocab)
            if j == 0:  # the same chain so far: the same q
                torch.testing.assert_close(
                    torch.tensor(batch[1].q_probs[0]), torch.tensor(one.q_probs[0])
                )
            expected = drawn(q, uniform(CASES[0].seed, state, p.first_position + j, j), 1e-6)
            assert expected is None or p.tokens[j] == expected


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(temperature=-0.5), "temperature"),
        (Sampling(temperature=float("nan")), "temperature"),
        (Sampling(1.0, top_k=-2), "top_k"),
        (Sampling(1.0, top_p=1.5), "top_p"),
        (Sampling(1.0, min_p=-0.1), "min_p"),
    ],
)
def test_bad_sampling_is_refused_by_name_and_changes_nothing(family, sampling, field) -> None:
    _, engine = family
    live = len(engine.states)
    with pytest.raises(InvalidArgument, match=f"sampling.{field}") as err:
        engine.alloc_state(sampling=sampling)
    assert err.value.reason == "BAD_SAMPLING" and len(engine.states) == live


def _greedy_q(p) -> bool:
    """A greedy proposal's q: each draft alone, probability 1."""
    return all(ids[0] == t and probs[0] == 1.0 and not any(probs[1:])
               for t, ids, probs in zip(p.tokens, p.q_ids, p.q_probs, strict=True))  # fmt: skip


def test_greedy_and_sampled_rows_on_different_paths_each_get_their_q(family) -> None:
    """In one batch, a row whose verdict accepted every draft recomputes that draft's row
    while the other row chains on, one greedy and one sampled, each way round: a greedy
    row's q is its drafts alone, a sampled row's q holds its draft and sums to 1."""
    ref, engine = family
    h, vocab = ref.cfg["hidden_size"], ref.cfg["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(vocab, (PROMPT,), generator=gen).tolist()
    hiddens = torch.randn(PROMPT, h, generator=gen)
    states = []
    for sampling in (Sampling(), CASES[0]):
        state = engine.alloc_state(sampling=sampling)
        session = engine.begin_prefill(state, 1)
        session.append(tokens[:-1], hiddens[:-1])
        session.finish()
        states.append(state)
    greedy, sampled = states
    batch = propose_batch(
        engine, [ProposeArgs(s, tokens[-1], hiddens[-1], PROMPT, 1) for s in states]
    )
    for accepted in ((1, 0), (0, K)):  # greedy recomputes, then the sampled one does
        args = [
            ProposeArgs(s, 5, torch.randn(h, generator=gen), p.first_position + a, K,
                        previous=Verdict(a))
            for s, p, a in zip(states, batch, accepted, strict=True)
        ]  # fmt: skip
        batch = propose_batch(engine, args)
        assert _greedy_q(batch[0])
        for j, t in enumerate(batch[1].tokens):
            ids, probs = batch[1].q_ids[j], batch[1].q_probs[j]
            assert t in ids and abs(sum(probs) - 1) < 1e-5
    for state in (greedy, sampled):
        engine.free_state(state)
