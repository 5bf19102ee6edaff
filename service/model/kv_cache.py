"""Storage of the paged MTP KV cache: fixed-size blocks in one pool."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of one attention layer as [num_blocks, block_size, kv_heads, head_dim].

    Which blocks belong to which sequence is the engine's business; this only
    holds the memory and writes rows into slots.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[0])

    @staticmethod
    def bytes_per_block(
        block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * num_kv_heads * head_dim * itemsize

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores k, v ([N, kv_heads, head_dim]) at the flat slots [N]."""
        flat = (-1, *self.k.shape[2:])
        self.k.view(flat)[slots] = k
        self.v.view(flat)[slots] = v

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        index_src = torch.tensor(src, device=self.k.device)
        index_dst = torch.tensor(dst, device=self.k.device)
        self.k[index_dst] = self.k[index_src]
        self.v[index_dst] = self.v[index_src]
