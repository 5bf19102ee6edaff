"""Decodes the wire's raw-bytes tensors into torch tensors, checking dtype and byte count."""

from __future__ import annotations

import math

import torch

from mtpdraft.v1 import drafter_pb2 as pb

from .engine.errors import InvalidArgument

DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_BF16: torch.bfloat16,
    pb.DTYPE_FP16: torch.float16,
    pb.DTYPE_FP32: torch.float32,
    pb.DTYPE_INT32: torch.int32,
}
HIDDEN_DTYPES = (pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32)
# No real tensor here has a dimension past 2**31; an empty tensor's other
# dimensions could otherwise be anything, up to sizes torch cannot represent.
_MAX_DIM = 2**31 - 1


def decode_tensor(msg: pb.Tensor, field: str, allowed: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor from raw little-endian bytes; INVALID_ARGUMENT when malformed."""
    if msg.dtype not in allowed:
        names = ", ".join(pb.DType.Name(d) for d in allowed)
        raise InvalidArgument(
            f"{field}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in DTYPES else msg.dtype} "
            f"is not accepted here (expected one of {names})",
            reason="BAD_DTYPE",
            field=field,
        )
    shape = list(msg.shape)
    if any(not 0 <= d <= _MAX_DIM for d in shape):
        raise InvalidArgument(
            f"{field}: shape {shape} has a dimension outside [0, {_MAX_DIM}]",
            reason="BAD_SHAPE",
            field=field,
        )
    dtype = DTYPES[msg.dtype]
    data = msg.data  # each read of a bytes field builds a new bytes object
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise InvalidArgument(
            f"{field}: {len(data)} bytes of data, but shape {shape} of "
            f"{pb.DType.Name(msg.dtype)} needs {expected}",
            reason="BAD_BYTE_COUNT",
            field=field,
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # A copy (bytearray): the engine gets a writable tensor that no message's memory backs.
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def decode_hiddens(msg: pb.Tensor, field: str) -> torch.Tensor:
    return decode_tensor(msg, field, HIDDEN_DTYPES)


def decode_bitmask(msg: pb.Tensor, field: str = "bitmask") -> torch.Tensor:
    return decode_tensor(msg, field, (pb.DTYPE_INT32,))
