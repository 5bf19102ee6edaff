"""The finiteness checks (exponent bits read as integers) against torch.isfinite."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.engine.validation import check_hiddens, finite_rows, is_finite


def _rows(value: float, dtype: torch.dtype, shape: tuple[int, ...] = (1, 8)) -> torch.Tensor:
    out = torch.randn(shape).to(dtype)
    out.view(-1)[3] = value
    return out


def test_is_finite_matches_isfinite_across_dtypes_and_shapes() -> None:
    tensors = [
        _rows(1.0, torch.bfloat16),
        _rows(float("nan"), torch.bfloat16),
        _rows(float("inf"), torch.float16),
        _rows(-float("inf"), torch.float32, (8,)),
        _rows(2.0, torch.float32, (2, 8)),
        _rows(float("nan"), torch.float32, (2, 8)),
        torch.empty(0, 8),  # nothing to be infinite
        torch.tensor(float("nan")),  # a scalar
        torch.tensor([1, 2, 3]),  # not floating point: check_hiddens refuses it for that
    ]
    expected = [True, False, False, False, True, False, True, False, True]
    assert [bool(torch.isfinite(t).all()) for t in tensors] == expected
    assert [is_finite(t) for t in tensors] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_finite_rows_read_the_exponent_bits_right_at_the_edges(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0]  # all finite
    nonfinite = [float("inf"), -float("inf"), float("nan"), -float("nan")]
    rows = torch.cat([_rows(v, dtype) for v in edges + nonfinite])
    expected = torch.isfinite(rows).all(dim=1).tolist()
    assert expected == [True] * len(edges) + [False] * len(nonfinite)
    assert finite_rows(rows).tolist() == expected
    assert not is_finite(_rows(float("nan"), dtype, (8, 2)).t())  # non-contiguous


def test_check_hiddens_refuses_nonfinite_values_and_wrong_shapes() -> None:
    good, bad = _rows(1.0, torch.bfloat16), _rows(float("nan"), torch.bfloat16)
    assert check_hiddens(good, 1, 8, "hidden").shape == (1, 8)
    assert check_hiddens(good[0], 1, 8, "hidden").shape == (1, 8)
    for hiddens, reason in ((bad, "NOT_FINITE"), (good, "BAD_SHAPE")):
        with pytest.raises(InvalidArgument) as refused:
            check_hiddens(hiddens, 1 if reason == "NOT_FINITE" else 2, 8, "hidden")
        assert (refused.value.reason, refused.value.field) == (reason, "hidden")
