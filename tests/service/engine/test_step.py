"""A batch's Step joined from its calls' Steps: rows in order."""

from __future__ import annotations

import torch

from mtpdraft.service.engine.step import Step, StepShape, single
from mtpdraft.service.engine.types import Verdict

SHAPE = StepShape(hidden_size=8, vocab_size=100, max_batch=8)


def _step(state_id: int, hiddens: torch.Tensor, refeed: torch.Tensor) -> Step:
    rows = [
        single(state_id + i, 3, row, 10, 2, previous=Verdict(2, refeed), shape=SHAPE)
        for i, row in enumerate(hiddens)
    ]
    return Step.concat(rows)


def test_joined_steps_keep_their_rows() -> None:
    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, SHAPE.hidden_size).to(torch.bfloat16)

    a, b = rows(2), rows(3)
    refeed_a, refeed_b = rows(2), rows(2)
    joined = Step.concat([_step(1, a, refeed_a), _step(10, b, refeed_b)])
    assert joined.state_ids.tolist() == [1, 2, 10, 11, 12]
    assert joined.refeed_counts.tolist() == [2] * 5
    assert torch.equal(joined.hiddens, torch.cat([a, b]))
    assert torch.equal(joined.refeed_hiddens, torch.cat([refeed_a] * 2 + [refeed_b] * 3))


def test_rows_of_different_dtypes_meet_in_fp32() -> None:
    a, b = torch.randn(1, SHAPE.hidden_size).to(torch.bfloat16), torch.randn(1, SHAPE.hidden_size)
    refeed = torch.randn(2, SHAPE.hidden_size)
    joined = Step.concat([_step(1, a, refeed), _step(5, b, refeed)])
    assert joined.hiddens.dtype == torch.float32
    assert torch.equal(joined.hiddens, torch.cat([a.float(), b]))
