"""The batch-wide finiteness check against a per-tensor torch.isfinite."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.engine.validation import check_hiddens, finite_flags


def _rows(value: float, dtype: torch.dtype, shape: tuple[int, ...] = (1, 8)) -> torch.Tensor:
    out = torch.randn(shape).to(dtype)
    out.view(-1)[3] = value
    return out


def test_finite_flags_match_isfinite_across_dtypes_and_shapes() -> None:
    tensors = [
        _rows(1.0, torch.bfloat16),
        _rows(float("nan"), torch.bfloat16),
        _rows(float("inf"), torch.float16),
        _rows(-float("inf"), torch.float32, (8,)),
        _rows(2.0, torch.float32, (2, 8)),  # another size: checked in its own stack
        _rows(float("nan"), torch.float32, (2, 8)),
        torch.empty(0, 8),  # nothing to be infinite
        torch.tensor([1, 2, 3]),  # not floating point: check_hiddens refuses it for that
    ]
    expected = [True, False, False, False, True, False, True, True]
    assert [bool(torch.isfinite(t).all()) for t in tensors] == expected
    assert finite_flags(tensors) == expected
    assert finite_flags([]) == []


def test_check_hiddens_takes_a_known_flag_or_finds_it() -> None:
    good, bad = _rows(1.0, torch.bfloat16), _rows(float("nan"), torch.bfloat16)
    assert check_hiddens(good, 1, 8, "hidden").shape == (1, 8)
    for hiddens, flag in ((bad, None), (good, False)):
        with pytest.raises(InvalidArgument) as refused:
            check_hiddens(hiddens, 1, 8, "hidden", flag)
        assert (refused.value.reason, refused.value.field) == ("NOT_FINITE", "hidden")
