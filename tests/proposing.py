"""A state's Propose as tests write it, through the engine's one entry point, `step`.

`ProposeArgs` holds one state's arguments (those of `step.single`); `step_of` makes
requests one Step, `proposals` reads its answer, and `propose` / `propose_batch` do
both around `engine.step`. A failed row's error is raised (the first, where several
fail; the other rows of the step were drafted all the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.engine.step import Step, StepResult, StepShape, single
from mtpdraft.service.engine.types import Proposal, Verdict
from mtpdraft.service.grammar.spec import GrammarChange


@dataclass
class ProposeArgs:
    state_id: int
    token: int
    hidden: torch.Tensor  # [H] or [1, H]: target hidden at position - 1
    position: int
    num_drafts: int
    bitmask: torch.Tensor | None = None  # int32 [W] or [n, W], xgrammar layout
    min_confidence: float = 0.0
    previous: Verdict | None = None
    sampling: Sampling | None = None
    draft_cap: int = 0  # with num_drafts 0 (the drafter chooses K)
    verify_token_cost: float = 0.0
    step_number: int = 0  # 0: not numbered
    grammar: GrammarChange | None = None  # the state's grammar from this step on


def step_of(requests: list[ProposeArgs], shape: StepShape) -> Step:
    """The requests as one Step, a row each."""
    return Step.concat([single(**vars(args), shape=shape) for args in requests])


def proposals(step: Step, result: StepResult) -> list[Proposal]:
    """Each row's Proposal; the first failed row's error raised instead."""
    if result.errors:
        raise result.errors[min(result.errors)]
    return [result.proposal(i, state) for i, state in enumerate(step.state_ids.tolist())]


def propose_batch(engine, requests: list[ProposeArgs]) -> list[Proposal]:
    step = step_of(requests, engine.step_shape)
    return proposals(step, engine.step(step))


def propose(engine, args: ProposeArgs) -> Proposal:
    return propose_batch(engine, [args])[0]
