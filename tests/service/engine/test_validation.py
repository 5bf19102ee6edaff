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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_finite_flags_read_the_exponent_bits_right_at_the_edges(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0]  # all finite
    nonfinite = [float("inf"), -float("inf"), float("nan"), -float("nan")]
    tensors = [_rows(v, dtype) for v in edges + nonfinite]
    tensors.append(_rows(float("nan"), dtype, (8, 2)).t())  # a lone, non-contiguous one
    expected = [bool(torch.isfinite(t).all()) for t in tensors]
    assert expected == [True] * len(edges) + [False] * (len(nonfinite) + 1)
    assert finite_flags(tensors) == expected
    assert finite_flags(tensors[-1:]) == [False]


def test_check_hiddens_takes_a_known_flag_or_finds_it() -> None:
    good, bad = _rows(1.0, torch.bfloat16), _rows(float("nan"), torch.bfloat16)
    assert check_hiddens(good, 1, 8, "hidden").shape == (1, 8)
    for hiddens, flag in ((bad, None), (good, False)):
        with pytest.raises(InvalidArgument) as refused:
            check_hiddens(hiddens, 1, 8, "hidden", flag)
        assert (refused.value.reason, refused.value.field) == ("NOT_FINITE", "hidden")


def test_finite_flags_take_scalars_alongside_rows() -> None:
    # A 0-d hidden is refused later for its shape; checking it must not fail first.
    tensors = [
        torch.tensor(1.0),
        torch.tensor(float("nan")),
        torch.tensor(2.0),
        _rows(1.0, torch.float32),
    ]
    assert finite_flags(tensors) == [True, False, True, True]
