"""Argument checks shared by the kernel launchers (they raise ``ValueError``)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kind(
    name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] | None
) -> torch.Tensor:
    """Require ``t`` to be an ``ndim``-D tensor with one of ``dtypes``; returns it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def check_tensor(
    name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None
) -> None:
    """Require ``t`` to be a contiguous ``ndim``-D tensor with one of ``dtypes``."""
    t = check_kind(name, t, ndim, dtypes)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_rows(
    name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None
) -> None:
    """Like ``check_tensor``, but rows may be strided: only each row must be contiguous.

    For views such as q, k and v split out of one fused projection, whose rows sit
    ``stride(0)`` elements apart.
    """
    t = check_kind(name, t, ndim, dtypes)
    if t.shape[0] and not t[0].is_contiguous():
        raise ValueError(f"{name} must have contiguous rows, got strides {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) < t[0].numel():
        raise ValueError(f"{name}'s rows must not overlap, got strides {t.stride()}")


# A sampler's per-row parameters (top_support, sample_top): each column's name and dtype.
SAMPLING_PARAMS = (
    ("temperature", torch.float32),
    ("top_k", torch.int64),
    ("top_p", torch.float32),
    ("min_p", torch.float32),
)


def check_columns(
    columns: tuple[torch.Tensor, ...], spec: tuple[tuple[str, torch.dtype], ...], n: int
) -> None:
    """Require each column to be a contiguous [n] tensor of its (name, dtype) in ``spec``."""
    for t, (name, dtype) in zip(columns, spec, strict=True):
        check_tensor(name, t, 1, (dtype,))
        check_shape(name, t, (n,))


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Require ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Require all tensors to share one dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtypes must match, got {dtypes}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Require all tensors to live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")
