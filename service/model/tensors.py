"""Where a checkpoint's tensors are: safetensors files (one, or shards listed by
model.safetensors.index.json) or a dict in memory; and block-scaled FP8 matrices.

Tensors are read one by one, by name, so that a full target checkpoint costs only
what the MTP layer reads. Every error names the file at fault.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError


@contextmanager
def _open(file: Path) -> Iterator:
    """safe_open, its errors (a truncated or corrupt file, an unreadable one) named by file."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


class TensorFiles:
    """Maps tensor names to the safetensors file that holds them, and reads them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {name: folder / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a weight map ({exc!r})") from exc
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files")
            self.where = {}
            for file in files:
                with _open(file) as f:
                    self.where.update(dict.fromkeys(f.keys(), file))

    def read(self, name: str) -> torch.Tensor:
        file = self.where[name]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the index puts {name} in this shard)")
        with _open(file) as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise CheckpointError(f"{file}: no {name}, which the index puts there")
            return f.get_tensor(name)


class TensorDict:
    """Tensors already in memory under their published names (benchmarks build these)."""

    def __init__(self, tensors: dict[str, torch.Tensor], label: str = "memory") -> None:
        self.folder = Path(label)
        self.tensors = tensors
        self.where = dict.fromkeys(tensors, self.folder)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """FP8 weight [..., rows, cols] times its block scales [..., rows / br, cols / bc], fp32."""
    (rows, cols), (br, bc) = weight.shape[-2:], block
    scale = scale.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return weight.float() * scale


@dataclass(frozen=True)
class FP8Matrix:
    """A block-scaled FP8 matrix kept as its checkpoint stores it, for the kernels that read
    it so (half the bytes of bf16): e4m3 values [N, K] and fp32 scales [ceil(N / bn),
    ceil(K / bk)], (bn, bk) = block."""

    values: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.values, self.scale, self.block).to(dtype)

    @staticmethod
    def stacked(parts: Sequence[FP8Matrix]) -> FP8Matrix | None:
        """The parts' rows one after another (q, k, v; gate, up), when each part but the
        last ends on a block boundary (else its last scale row would be shared): else None."""
        block = parts[0].block
        if any(p.block != block for p in parts) or any(p.shape[0] % block[0] for p in parts[:-1]):
            return None
        return FP8Matrix(
            torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), block
        )
