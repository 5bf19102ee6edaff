"""The input of one MTP forward: rows of many sequences, and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowBatch:
    """N rows of S sequences. Rows of one sequence are contiguous and in order.

    A row's position is its hidden's position (one less than its token's), which
    is also its RoPE position and its index in its sequence's KV.
    """

    tokens: torch.Tensor  # [N] int64: the row's token
    hiddens: torch.Tensor  # [N, H] compute dtype: the hidden paired with the token
    positions: torch.Tensor  # [N] int64: row index in its sequence
    seq_ids: torch.Tensor  # [N] int32: which row of block_tables the row belongs to
    slot_mapping: torch.Tensor  # [N] int64: block * block_size + offset to write K/V at
    block_tables: torch.Tensor  # [S, max_blocks] int32: KV blocks of each sequence
    # [N] int32 or int64: KV rows each row attends, itself included (causal), i.e.
    # positions + 1. Given by whoever builds the batch on the host (two fewer kernels
    # per step than deriving it on the device); derived when left out.
    context_lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.context_lens is None:
            self.context_lens = (self.positions + 1).to(torch.int32)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])
