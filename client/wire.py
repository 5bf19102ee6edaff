"""Tensors on the wire: numpy / torch arrays <-> ``mtpdraft.v1.Tensor``.

A ``Tensor`` is raw little-endian bytes in row-major order plus a dtype and a
shape (the KServe ``raw_input_contents`` convention). numpy has no bfloat16, so
a bf16 tensor travels, and is held here, as its 16-bit pattern (``<u2``).

Accepted inputs:
  hiddens  numpy float32 / float16 (and ml_dtypes bfloat16), torch bfloat16 /
           float16 / float32, on any device;
  bitmask  numpy or torch int32 (uint32 is reinterpreted bit for bit).
Anything else is a ``TypeError``; a wrong rank is a ``ValueError``. torch is
never imported here unless the caller already did: a torch tensor is detected
by looking for the loaded ``torch`` module.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from mtpdraft.v1 import drafter_pb2 as pb

if TYPE_CHECKING:
    import torch

Array: TypeAlias = "np.ndarray | torch.Tensor"

BF16: int = pb.DTYPE_BF16
FP16: int = pb.DTYPE_FP16
FP32: int = pb.DTYPE_FP32
INT32: int = pb.DTYPE_INT32

#: Wire dtype -> its name (torch spelling, as GetInfo.compute_dtype uses).
DTYPE_NAMES: dict[int, str] = {
    BF16: "bfloat16",
    FP16: "float16",
    FP32: "float32",
    INT32: "int32",
}

#: Wire dtype -> the little-endian numpy dtype that holds its raw bytes.
STORAGE: dict[int, np.dtype] = {
    BF16: np.dtype("<u2"),
    FP16: np.dtype("<f2"),
    FP32: np.dtype("<f4"),
    INT32: np.dtype("<i4"),
}

#: Wire dtype -> bytes per element.
ITEMSIZE: dict[int, int] = {dt: s.itemsize for dt, s in STORAGE.items()}

HIDDEN_DTYPES: frozenset[int] = frozenset({BF16, FP16, FP32})
BITMASK_DTYPES: frozenset[int] = frozenset({INT32})


def dtype_name(dtype: int) -> str:
    """The name of a wire dtype ("bfloat16", ...); "unspecified" for unknown values."""
    return DTYPE_NAMES.get(dtype, "unspecified")


def is_torch_tensor(x: object) -> bool:
    """True when ``x`` is a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_raw(t: Any) -> tuple[np.ndarray, int]:
    import torch  # already imported by the caller, since t is a tensor

    t = t.detach()
    if t.dtype == torch.bfloat16:
        dtype, t = BF16, t.view(torch.int16)
    elif t.dtype == torch.float16:
        dtype = FP16
    elif t.dtype == torch.float32:
        dtype = FP32
    elif t.dtype == torch.int32:
        dtype = INT32
    elif t.dtype == getattr(torch, "uint32", None):
        dtype, t = INT32, t.view(torch.int32)
    else:
        raise TypeError(f"unsupported torch dtype {t.dtype}")
    arr = t.cpu().contiguous().numpy()
    if dtype == BF16:
        arr = arr.view(np.uint16)
    return arr, dtype


def _numpy_raw(a: np.ndarray) -> tuple[np.ndarray, int]:
    native = a.dtype.newbyteorder("=")
    if native == np.float32:
        dtype = FP32
    elif native == np.float16:
        dtype = FP16
    elif native == np.int32:
        dtype = INT32
    elif native == np.uint32:
        dtype, a = INT32, a.view(a.dtype.str.replace("u", "i"))  # same bits, same byte order
    elif a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        dtype, a = BF16, a.view(np.uint16)
    else:
        raise TypeError(f"unsupported numpy dtype {a.dtype}")
    return a, dtype


def as_raw(
    x: Array,
    *,
    allowed: Collection[int],
    ndims: Collection[int],
    name: str = "tensor",
) -> tuple[np.ndarray, int]:
    """A C-contiguous little-endian numpy array holding ``x``'s wire bytes, and its dtype.

    bf16 comes back as its ``<u2`` bit pattern. Raises TypeError for a type or
    dtype outside ``allowed``, ValueError for a rank outside ``ndims``.
    """
    if is_torch_tensor(x):
        arr, dtype = _torch_raw(x)
    elif isinstance(x, np.ndarray):
        arr, dtype = _numpy_raw(x)
    else:
        raise TypeError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")
    if dtype not in allowed:
        names = ", ".join(DTYPE_NAMES[d] for d in sorted(allowed))
        raise TypeError(f"{name}: dtype {DTYPE_NAMES[dtype]} not accepted (use {names})")
    if arr.ndim not in ndims:
        ranks = " or ".join(str(n) for n in sorted(ndims))
        raise ValueError(f"{name}: expected {ranks} dims, got shape {tuple(arr.shape)}")
    arr = np.ascontiguousarray(arr.astype(STORAGE[dtype], copy=False))
    return arr, dtype


def tensor_from_raw(arr: np.ndarray, dtype: int, into: pb.Tensor | None = None) -> pb.Tensor:
    """A ``Tensor`` message from an array returned by :func:`as_raw` (or a slice of one).

    ``into``: a request's Tensor field, filled in place and returned. A large Tensor handed
    to a message's constructor or CopyFrom is copied again, slowly; set in place, its
    bytes are copied once.
    """
    msg = pb.Tensor() if into is None else into
    msg.dtype = dtype
    del msg.shape[:]
    msg.shape.extend(arr.shape)
    msg.data = np.ascontiguousarray(arr).tobytes()
    return msg


def encode(
    x: Array,
    *,
    allowed: Collection[int] = HIDDEN_DTYPES,
    ndims: Collection[int] = (1, 2),
    name: str = "tensor",
    into: pb.Tensor | None = None,
) -> pb.Tensor:
    """Encodes ``x`` as a ``Tensor`` message, or ``into`` one (see :func:`as_raw` for the
    checks, :func:`tensor_from_raw` for ``into``)."""
    arr, dtype = as_raw(x, allowed=allowed, ndims=ndims, name=name)
    return tensor_from_raw(arr, dtype, into)


def encode_hidden(
    x: Array,
    *,
    ndims: Collection[int] = (1, 2),
    name: str = "hidden",
    into: pb.Tensor | None = None,
) -> pb.Tensor:
    """A hidden state (bf16 / fp16 / fp32) as a ``Tensor`` (or ``into`` one)."""
    return encode(x, allowed=HIDDEN_DTYPES, ndims=ndims, name=name, into=into)


def encode_bitmask(x: Array, into: pb.Tensor | None = None) -> pb.Tensor:
    """An xgrammar packed int32 bitmask, shape [W] or [n, W], as a ``Tensor`` (or ``into`` one)."""
    return encode(x, allowed=BITMASK_DTYPES, ndims=(1, 2), name="bitmask", into=into)


def _raw_view(t: pb.Tensor) -> np.ndarray:
    if t.dtype not in STORAGE:
        raise ValueError(f"tensor has unknown dtype {t.dtype}")
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor has a negative dim: {shape}")
    expected = math.prod(shape) * ITEMSIZE[t.dtype]
    if len(t.data) != expected:
        raise ValueError(
            f"tensor of shape {shape} {dtype_name(t.dtype)} needs {expected} bytes, "
            f"got {len(t.data)}"
        )
    return np.frombuffer(t.data, dtype=STORAGE[t.dtype]).reshape(shape)


def decode(t: pb.Tensor) -> np.ndarray:
    """A ``Tensor`` as a new numpy array in native byte order; bf16 widens exactly to float32."""
    raw = _raw_view(t)
    if t.dtype == BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(STORAGE[t.dtype].newbyteorder("="))


def decode_torch(t: pb.Tensor) -> torch.Tensor:
    """A ``Tensor`` as a new CPU torch tensor of its own dtype (bf16 stays bf16). Needs torch."""
    import torch

    raw = _raw_view(t).astype(STORAGE[t.dtype].newbyteorder("="))
    if t.dtype == BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)
