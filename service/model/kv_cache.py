"""Storage of the paged MTP KV cache: fixed-size blocks in one pool."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of one attention layer as [num_blocks, block_size, kv_heads, head_dim].

    Which blocks belong to which sequence is the engine's business; this only
    holds the memory and writes rows into slots. An MLA layer's cache (`latent`) holds
    per token its latent and its rotated k_pe side by side in one tensor; `k` and `v`
    are then views of the two parts ([.., 1, R] and [.., 1, P]), so everything that
    moves rows (take / install, export / import) moves them the same way.
    """

    latent: torch.Tensor | None = None  # [num_blocks, block_size, R + P]: MLA only

    @classmethod
    def for_latent(
        cls, num_blocks: int, block_size: int, rank: int, rope_dim: int, dtype, device
    ) -> KVCache:
        kv = cls.__new__(cls)
        kv.latent = torch.zeros(num_blocks, block_size, rank + rope_dim, dtype=dtype, device=device)
        kv.k, kv.v = kv.latent[..., None, :rank], kv.latent[..., None, rank:]
        kv.block_size = block_size
        return kv

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
    def bytes_per_block(block_size: int, row_values: int, dtype: torch.dtype) -> int:
        """One block's bytes, a row holding `row_values` values (K and V, or latent)."""
        return block_size * row_values * torch.empty((), dtype=dtype).element_size()

    def _planes(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding rows, each [num_blocks * block_size, ...] (views)."""
        if self.latent is not None:
            return (self.latent.view(-1, 1, self.latent.shape[-1]),)
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores k, v ([N, kv_heads, head_dim] each; MLA: [N, 1, R] and [N, 1, P]) at the
        flat slots [N]."""
        values = (torch.cat([k, v], dim=-1),) if self.latent is not None else (k, v)
        for plane, rows in zip(self._planes(), values, strict=True):
            plane[slots] = rows

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k, v rows at the flat slots [N], as `write` takes them."""
        if self.latent is not None:
            rows = self._planes()[0][slots]
            return rows[..., : self.k.shape[-1]], rows[..., self.k.shape[-1] :]
        k, v = self._planes()
        return k[slots], v[slots]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        index_src = torch.tensor(src, device=self.k.device)
        index_dst = torch.tensor(dst, device=self.k.device)
        for blocks in (self.latent,) if self.latent is not None else (self.k, self.v):
            blocks[index_dst] = blocks[index_src]
