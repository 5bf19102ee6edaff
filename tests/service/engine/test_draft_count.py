"""Drafts chosen by count (num_drafts 0): the count kept is DESIGN's rule, computed again
here by brute force, over the probabilities of the chain drafted to the cap and each
state's calibration from its verdicts.

The rule (DESIGN.md, "Drafts chosen by count") is tests/draft_count_reference.py's.
"""

from __future__ import annotations

import pytest
import torch
from draft_count_reference import Calibration, chosen
from proposing import ProposeArgs, propose

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

CAP = 5


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), "mimo", seed=8)
    return MTPHead(load_mtp_weights(folder), torch.device("cpu"))


@pytest.fixture
def engine(head) -> DraftEngine:
    return DraftEngine(head, ServeConfig(kv_blocks=128, block_size=4, max_drafts=CAP))


def twins(engine: DraftEngine, seed: int) -> tuple[int, int, list[int], torch.Tensor]:
    """Two states with the same rows."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(200, (8,), generator=gen).tolist()
    hiddens = torch.randn(8, 64, generator=gen)
    states = []
    for _ in range(2):
        state = engine.alloc_state()
        session = engine.begin_prefill(state, 1)
        session.append(tokens[:-1], hiddens[:-1])
        session.finish()
        states.append(state)
    return *states, tokens, hiddens


@pytest.mark.parametrize("cost", [0.0, 0.05, 0.3, 1.0, 50.0])
def test_the_count_kept_is_the_rules(engine: DraftEngine, cost: float) -> None:
    fixed, auto, tokens, hiddens = twins(engine, 1)
    full = propose(engine, ProposeArgs(fixed, tokens[-1], hiddens[-1], 8, CAP))
    args = dict(draft_cap=0, verify_token_cost=cost)
    got = propose(engine, ProposeArgs(auto, tokens[-1], hiddens[-1], 8, 0, **args))
    n = chosen(full.probs, 1.0, cost)
    assert got.tokens == full.tokens[:n] and got.probs == full.probs[:n]
    if cost == 0.0:
        assert n == CAP  # a free token is always worth drafting
    if cost == 50.0:
        assert n == 0


def test_a_cap_bounds_the_count(engine: DraftEngine) -> None:
    fixed, auto, tokens, hiddens = twins(engine, 2)
    full = propose(engine, ProposeArgs(fixed, tokens[-1], hiddens[-1], 8, 2))
    got = propose(engine, ProposeArgs(auto, tokens[-1], hiddens[-1], 8, 0, draft_cap=2))
    assert got.tokens == full.tokens  # cost 0: the whole cap


@pytest.mark.parametrize("cost", [0.1, 0.2, 0.4])
def test_verdicts_calibrate_the_count(engine: DraftEngine, cost: float) -> None:
    """A state whose verifier accepts every draft comes to keep more than the
    probabilities alone say; one that accepts none, fewer; each as the rule says with the
    calibration its verdicts make."""
    for accept_all in (True, False):
        fixed, auto, tokens, hiddens = twins(engine, 3)
        calibration = Calibration(CAP)
        position, token, hidden = 8, tokens[-1], hiddens[-1]
        verdict = None
        for step in range(10):
            full = propose(
                engine,
                ProposeArgs(fixed, token, hidden, position, CAP, previous=verdict),
            )
            b = calibration.b()
            got = propose(
                engine,
                ProposeArgs(auto, token, hidden, position, 0, previous=verdict,
                            verify_token_cost=cost),
            )  # fmt: skip
            n = chosen(full.probs, b, cost)
            assert got.tokens == full.tokens[:n], f"step {step}"
            a = n if accept_all else 0
            calibration.verdict(got.probs, a)
            # Both states take the same verdict (the fixed one: as many of its drafts).
            verdict = Verdict(a)
            token, hidden = 7 + step, torch.randn(64, generator=torch.Generator().manual_seed(step))
            position += a + 1
        if accept_all:
            assert calibration.b()[0] > 1  # depths never reached stay at 1
        else:
            assert calibration.b()[0] < 1


def test_verdicts_on_a_fixed_k_calibrate_a_count_chosen_later(engine: DraftEngine) -> None:
    """Verdicts on proposals of a fixed K count too (off the launch's path): a state that
    turns to num_drafts 0 keeps the count its whole history of verdicts says, not the
    count its last verdict alone (carried by the step that chooses) would say."""
    fixed, turning, tokens, hiddens = twins(engine, 4)
    calibration, last_only = Calibration(CAP), Calibration(CAP)
    position, token, hidden, verdict = 8, tokens[-1], hiddens[-1], None
    for step in range(6):
        args = dict(previous=verdict)
        full = propose(engine, ProposeArgs(fixed, token, hidden, position, CAP, **args))
        got = propose(engine, ProposeArgs(turning, token, hidden, position, CAP, **args))
        assert got.tokens == full.tokens
        calibration.verdict(got.probs, CAP)  # every draft accepted
        verdict = Verdict(CAP)
        token, hidden = 7 + step, torch.randn(64, generator=torch.Generator().manual_seed(step))
        position += CAP + 1
    last_only.verdict(got.probs, CAP)
    full = propose(engine, ProposeArgs(fixed, token, hidden, position, CAP, previous=verdict))
    b = calibration.b()
    # A cost at which the whole history gives another count than the last verdict alone.
    cost = next(
        c for c in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
        if chosen(full.probs, b, c) != chosen(full.probs, last_only.b(), c)
    )  # fmt: skip
    got = propose(
        engine,
        ProposeArgs(turning, token, hidden, position, 0, previous=verdict, verify_token_cost=cost),
    )
    assert got.tokens == full.tokens[: chosen(full.probs, b, cost)]
