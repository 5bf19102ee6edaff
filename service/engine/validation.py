"""Checks of request values against the model's shape; each failure names its field."""

from __future__ import annotations

import math

import torch

from .errors import InvalidArgument


def check_tokens(tokens: list[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            where = field if len(tokens) == 1 else f"{field}[{i}]"
            raise InvalidArgument(
                f"{where}: token {token} is outside the vocabulary [0, {vocab_size})",
                reason="TOKEN_OUT_OF_RANGE",
                field=field,
            )


def finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is free of NaN and inf, found in a few calls for them all.

    A batch's hiddens are checked together: on the engine thread every torch call lets
    go of the GIL, and getting it back from a busy event loop can take a whole switch
    interval, so three calls per request (64 a batch) cost far more served than alone.
    """
    flags = [True] * len(tensors)
    alike: dict[tuple[torch.dtype, torch.Size, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            alike.setdefault((t.dtype, t.shape, t.device), []).append(i)
    for members in alike.values():
        # Same shape: stacked as they are, one row per tensor (a reshape per tensor
        # first would cost a torch call each, 2 us on a slow CPU); a lone one, a
        # Prefill chunk say, is read in place, not copied.
        group = [tensors[i] for i in members]
        rows = (group[0] if len(group) == 1 else torch.stack(group)).reshape(len(group), -1)
        for i, ok in zip(members, _finite_rows(rows), strict=True):
            flags[i] = ok
    return flags


# An IEEE float is NaN or inf exactly when its exponent bits are all set: (the same-sized
# integer view, those bits). Read as integers, 64 rows of 4096 are checked in 120 us on a
# CPU where abs().amax().isfinite() took 315 us in bf16 and 915 us in fp32. A front-end
# process reads the same bits with numpy (wire_values.py), having no torch.
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def _finite_rows(rows: torch.Tensor) -> list[bool]:
    """Whether each row of a 2-D float tensor is free of NaN and inf."""
    bits = _EXPONENT_BITS.get(rows.dtype)
    if bits is None:  # NaN and inf survive abs().amax(), faster than isfinite().all()
        return rows.abs().amax(dim=1).isfinite().tolist()
    as_int, exponent = bits
    return rows.view(as_int).bitwise_and(exponent).amax(dim=1).ne(exponent).tolist()


def check_hiddens(
    hiddens: torch.Tensor, rows: int, hidden_size: int, field: str, finite: bool | None = None
) -> torch.Tensor:
    """Returns hiddens as [rows, hidden_size]; a single row may also come as [hidden_size].
    `finite`: their finite_flags() value where already known."""
    if rows == 1 and tuple(hiddens.shape) == (hidden_size,):
        hiddens = hiddens.reshape(1, hidden_size)
    shape = tuple(hiddens.shape)
    if shape != (rows, hidden_size):
        raise InvalidArgument(
            f"{field}: expected shape [{rows}, {hidden_size}], got {list(shape)}",
            reason="BAD_SHAPE",
            field=field,
        )
    _check_values(hiddens, field, finite)
    return hiddens


def check_row(
    hidden: torch.Tensor, hidden_size: int, field: str, finite: bool | None
) -> torch.Tensor:
    """One row of hiddens, [hidden_size] or [1, hidden_size], returned as it came: on the
    engine thread a reshape per request would be a torch call each, every one a hand-off
    of the GIL (64 a batch of 64, two thirds of the batch's torch calls)."""
    if tuple(hidden.shape) != (hidden_size,):
        return check_hiddens(hidden, 1, hidden_size, field, finite)
    _check_values(hidden, field, finite)
    return hidden


def _check_values(hiddens: torch.Tensor, field: str, finite: bool | None) -> None:
    if not hiddens.is_floating_point():
        raise InvalidArgument(
            f"{field}: expected a floating-point tensor, got {hiddens.dtype}",
            reason="BAD_DTYPE",
            field=field,
        )
    if finite is None:
        finite = finite_flags([hiddens])[0]
    if not finite:
        raise InvalidArgument(
            f"{field}: holds NaN or infinite values", reason="NOT_FINITE", field=field
        )


def check_num_drafts(num_drafts: int, max_drafts: int) -> None:
    if not 1 <= num_drafts <= max_drafts:
        raise InvalidArgument(
            f"num_drafts: {num_drafts} is outside [1, {max_drafts}]",
            reason="NUM_DRAFTS_OUT_OF_RANGE",
            field="num_drafts",
        )


def check_batch_size(size: int, max_batch: int) -> None:
    if not 1 <= size <= max_batch:
        raise InvalidArgument(
            f"requests: {size} requests, expected 1 to {max_batch}",
            reason="BATCH_SIZE_OUT_OF_RANGE",
            field="requests",
        )


def check_min_confidence(value: float) -> None:
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise InvalidArgument(
            f"min_confidence: {value} is outside [0, 1]",
            reason="MIN_CONFIDENCE_OUT_OF_RANGE",
            field="min_confidence",
        )


def check_bitmask(
    bitmask: torch.Tensor | None, num_drafts: int, vocab_size: int
) -> torch.Tensor | None:
    """Returns the mask as int32 [n, ceil(vocab / 32)], padded with disallowing zeros."""
    if bitmask is None:
        return None
    words = (vocab_size + 31) // 32
    mask = bitmask.reshape(1, -1) if bitmask.dim() == 1 else bitmask
    if bitmask.dtype != torch.int32:
        raise InvalidArgument(
            f"bitmask: expected int32, got {bitmask.dtype}", reason="BAD_DTYPE", field="bitmask"
        )
    if mask.dim() != 2 or not 1 <= mask.shape[0] <= num_drafts or not 1 <= mask.shape[1] <= words:
        raise InvalidArgument(
            f"bitmask: expected shape [words] or [n, words] with 1 <= n <= num_drafts "
            f"({num_drafts}) and 1 <= words <= {words}, got {list(bitmask.shape)}",
            reason="BAD_SHAPE",
            field="bitmask",
        )
    if mask.shape[1] < words:
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], words - mask.shape[1])], dim=1)
    tail_bits = vocab_size - 32 * (words - 1)  # bits of the last word that name real tokens
    if tail_bits < 32:
        mask = mask.clone()
        mask[:, -1] &= (1 << tail_bits) - 1
    empty = (mask == 0).all(dim=1)
    if bool(empty.any()):
        row = int(empty.nonzero()[0])
        raise InvalidArgument(
            f"bitmask: row {row} allows no token of the vocabulary",
            reason="EMPTY_BITMASK",
            field="bitmask",
        )
    return mask.contiguous()
