"""A batch's Step joined from its calls' Steps: rows and groups in order."""

from __future__ import annotations

import torch

from mtpdraft.service.engine.step import Step
from mtpdraft.service.engine.types import ProposeArgs, Verdict

H, V = 8, 100


def _step(state_id: int, hiddens: torch.Tensor, refeed: torch.Tensor) -> Step:
    requests = [
        ProposeArgs(state_id + i, 3, row, 10, 2, previous=Verdict(2, refeed))
        for i, row in enumerate(hiddens)
    ]
    return Step.from_requests(requests, H, V)


def test_joined_steps_keep_their_rows() -> None:
    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, H).to(torch.bfloat16)

    a, b = rows(2), rows(3)
    refeed_a, refeed_b = rows(2), rows(2)
    joined = Step.concat([_step(1, a, refeed_a), _step(10, b, refeed_b)])
    assert joined.state_ids.tolist() == [1, 2, 10, 11, 12]
    assert joined.groups.tolist() == [0, 0, 1, 1, 1]
    assert torch.equal(joined.hiddens, torch.cat([a, b]))
    assert torch.equal(joined.refeed_hiddens, torch.cat([refeed_a] * 2 + [refeed_b] * 3))


def test_rows_of_different_dtypes_meet_in_fp32() -> None:
    a, b = torch.randn(1, H).to(torch.bfloat16), torch.randn(1, H)
    refeed = torch.randn(2, H)
    joined = Step.concat([_step(1, a, refeed), _step(5, b, refeed)])
    assert joined.hiddens.dtype == torch.float32
    assert torch.equal(joined.hiddens, torch.cat([a.float(), b]))
