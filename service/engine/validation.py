"""Checks of request values against the model's shape; each failure names its field."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.finite import finite_rows
from .errors import InvalidArgument


def check_tokens(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            where = field if len(tokens) == 1 else f"{field}[{i}]"
            raise InvalidArgument(
                f"{where}: token {token} is outside the vocabulary [0, {vocab_size})",
                reason="TOKEN_OUT_OF_RANGE",
                field=field,
            )


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor (any shape; an integer or empty one is) is free of NaN and inf."""
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    return bool(finite_rows(tensor.reshape(1, -1))[0])


def as_rows(tensor: torch.Tensor, rows: int, width: int, field: str) -> torch.Tensor:
    """`tensor` as [rows, width]. One row may also come flat, as [width]: the rule of every
    tensor of rows the wire carries (hiddens here; bitmasks in step.padded_mask)."""
    if rows == 1 and tuple(tensor.shape) == (width,):
        return tensor.reshape(1, width)
    if tuple(tensor.shape) != (rows, width):
        flat = f" (or [{width}])" if rows == 1 else ""
        raise InvalidArgument(
            f"{field}: expected shape [{rows}, {width}]{flat}, got {list(tensor.shape)}",
            reason="BAD_SHAPE",
            field=field,
        )
    return tensor


def check_floating(tensor: torch.Tensor, field: str) -> None:
    if not tensor.is_floating_point():
        raise InvalidArgument(
            f"{field}: expected a floating-point tensor, got {tensor.dtype}",
            reason="BAD_DTYPE",
            field=field,
        )


def check_hiddens(hiddens: torch.Tensor, rows: int, hidden_size: int, field: str) -> torch.Tensor:
    """Returns hiddens as [rows, hidden_size] (see as_rows), floating-point and finite."""
    hiddens = as_rows(hiddens, rows, hidden_size, field)
    check_floating(hiddens, field)
    if not is_finite(hiddens):
        raise InvalidArgument(
            f"{field}: holds NaN or infinite values", reason="NOT_FINITE", field=field
        )
    return hiddens
