"""Tensor encoding round trips (numpy / torch -> Tensor -> numpy / torch) and rejections."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mtpdraft.client import wire
from mtpdraft.v1 import drafter_pb2 as pb


@pytest.mark.parametrize(
    ("dtype", "wire_dtype"), [(np.float32, pb.DTYPE_FP32), (np.float16, pb.DTYPE_FP16)]
)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (0, 4), (1, 1)])
def test_numpy_float_round_trip(dtype: type, wire_dtype: int, shape: tuple[int, ...]) -> None:
    a = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    t = wire.encode_hidden(a)
    assert t.dtype == wire_dtype
    assert tuple(t.shape) == shape
    assert t.data == a.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    back = wire.decode(t)
    assert back.dtype == dtype and back.shape == shape
    np.testing.assert_array_equal(back, a)


def test_numpy_big_endian_and_strided_are_sent_little_endian_row_major() -> None:
    a = np.arange(12, dtype=">f4").reshape(3, 4)
    t = wire.encode_hidden(a.T)
    assert tuple(t.shape) == (4, 3)
    assert t.data == np.ascontiguousarray(a.T).astype("<f4").tobytes()
    np.testing.assert_array_equal(wire.decode(t), a.T)


@pytest.mark.parametrize("shape", [(16,), (2, 8), (0, 8)])
def test_torch_bf16_round_trip_is_exact(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape).to(torch.bfloat16)
    t = wire.encode_hidden(x)
    assert t.dtype == pb.DTYPE_BF16
    assert tuple(t.shape) == shape
    assert len(t.data) == 2 * x.numel()
    assert t.data == x.contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    back = wire.decode_torch(t)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, x)
    np.testing.assert_array_equal(wire.decode(t), x.float().numpy())


@pytest.mark.parametrize(
    ("dtype", "wire_dtype"), [(torch.float32, pb.DTYPE_FP32), (torch.float16, pb.DTYPE_FP16)]
)
def test_torch_float_round_trip(dtype: torch.dtype, wire_dtype: int) -> None:
    x = torch.randn(4, 6, dtype=dtype, requires_grad=dtype == torch.float32)
    strided = x[:, ::2]  # non-contiguous
    t = wire.encode_hidden(strided)
    assert t.dtype == wire_dtype and tuple(t.shape) == (4, 3)
    assert torch.equal(wire.decode_torch(t), strided.detach())
    np.testing.assert_array_equal(wire.decode(t), strided.detach().numpy())


def test_torch_bf16_strided() -> None:
    x = torch.randn(5, 6).to(torch.bfloat16).t()
    assert torch.equal(wire.decode_torch(wire.encode_hidden(x)), x)


@pytest.mark.parametrize("shape", [(5,), (3, 5)])
def test_bitmask_int32_round_trip(shape: tuple[int, ...]) -> None:
    a = np.random.default_rng(1).integers(-(2**31), 2**31, size=shape, dtype=np.int64)
    a = a.astype(np.int32)
    a.flat[0] = -1  # all 32 bits set
    for x in (a, torch.from_numpy(a.copy())):
        t = wire.encode_bitmask(x)
        assert t.dtype == pb.DTYPE_INT32 and tuple(t.shape) == shape
        assert t.data == a.astype("<i4").tobytes()
        np.testing.assert_array_equal(wire.decode(t), a)


def test_bitmask_uint32_is_reinterpreted_bit_for_bit() -> None:
    u = np.array([0xFFFFFFFF, 1, 0x80000000], dtype=np.uint32)
    t = wire.encode_bitmask(u)
    assert t.dtype == pb.DTYPE_INT32
    np.testing.assert_array_equal(wire.decode(t), u.view(np.int32))


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(4, dtype=np.float64),
        np.zeros(4, dtype=np.int64),
        np.zeros(4, dtype=np.int32),
        np.zeros(4, dtype=bool),
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(4, dtype=torch.int32),
        [0.0, 1.0],
        b"\x00\x00",
    ],
    ids=str,
)
def test_hidden_rejects_wrong_dtype_or_type(x: object) -> None:
    with pytest.raises(TypeError):
        wire.encode_hidden(x)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(4, dtype=np.float32),
        np.zeros(4, dtype=np.int64),
        np.zeros(4, dtype=np.int16),
        torch.zeros(4, dtype=torch.int64),
        torch.zeros(4, dtype=torch.bfloat16),
        [1, 2, 3],
    ],
    ids=str,
)
def test_bitmask_rejects_wrong_dtype_or_type(x: object) -> None:
    with pytest.raises(TypeError):
        wire.encode_bitmask(x)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "x", [np.zeros((), np.float32), np.zeros((1, 2, 3), np.float32), torch.zeros(1, 2, 3)]
)
def test_hidden_rejects_wrong_rank(x: object) -> None:
    with pytest.raises(ValueError):
        wire.encode_hidden(x)  # type: ignore[arg-type]


def test_bitmask_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError):
        wire.encode_bitmask(np.zeros((1, 2, 3), np.int32))


def test_decode_rejects_bad_byte_count_and_dtype() -> None:
    with pytest.raises(ValueError):
        wire.decode(pb.Tensor(dtype=pb.DTYPE_FP32, shape=[2, 2], data=b"\x00" * 15))
    with pytest.raises(ValueError):
        wire.decode(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\x00" * 4))


def test_dtype_names() -> None:
    assert wire.dtype_name(pb.DTYPE_BF16) == "bfloat16"
    assert wire.dtype_name(pb.DTYPE_FP32) == "float32"
    assert wire.dtype_name(99) == "unspecified"


def test_client_imports_and_encodes_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from mtpdraft.client import DrafterClient, wire\n"
        "t = wire.encode_hidden(np.ones((2, 3), np.float16))\n"
        "assert wire.decode(t).shape == (2, 3)\n"
        "assert not wire.is_torch_tensor(np.ones(1))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
