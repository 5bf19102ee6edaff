"""CUDA graphs of one decode step (one row per sequence, then its draft), per batch bucket.

A draft step at decode batch sizes is a few dozen short kernels; launched one by
one from Python they cost more than the step itself (measured: the eager step is
5-6x the HBM roofline at batch 1, DESIGN.md). Captured once per batch-size
bucket and replayed, the whole step is one launch. Inputs are copied into the
graph's static buffers; rows past the live batch are padding whose KV writes are
skipped (slot -1) and whose outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import RowBatch
from .kv_cache import KVCache

# Buckets double so that a batch pads by less than 2x; 64 is the default max batch.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: RowBatch
    bitmask: torch.Tensor | None
    hidden: torch.Tensor  # outputs
    tokens: torch.Tensor
    probs: torch.Tensor


class DecodeGraphs:
    """Replays `forward + draft` of one row per sequence from captured CUDA graphs."""

    def __init__(
        self,
        head,
        kv: KVCache,
        max_batch: int,
        *,
        buckets: tuple[int, ...] | None = None,
        masks: tuple[bool, ...] = (False, True),
    ) -> None:
        self.head, self.kv = head, kv
        c = head.config
        self.max_blocks = -(-c.max_position_embeddings // kv.block_size)
        self.words = (c.vocab_size + 31) // 32
        if buckets is None:
            buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        self.buckets = sorted(buckets)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        for size in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            for masked in masks:
                self._graphs[size, masked] = self._capture(size, masked)

    def _static_batch(self, size: int) -> RowBatch:
        device = self.head.device
        return RowBatch(
            tokens=torch.zeros(size, dtype=torch.int64, device=device),
            hiddens=torch.zeros(size, self.head.config.hidden_size, dtype=self.head.dtype,
                                device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            seq_ids=torch.arange(size, dtype=torch.int32, device=device),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device),
        )  # fmt: skip

    def _capture(self, size: int, masked: bool) -> _Captured:
        batch = self._static_batch(size)
        bitmask = (
            torch.full((size, self.words), -1, dtype=torch.int32, device=self.head.device)
            if masked
            else None
        )

        def step():
            hidden = self.head.forward(batch, self.kv)
            tokens, probs = self.head.draft(hidden, bitmask)
            return hidden, tokens, probs

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, tokens, probs = step()
        return _Captured(graph, batch, bitmask, hidden, tokens, probs)

    def fits(self, rows: int, widest_table: int) -> bool:
        return rows <= self.buckets[-1] and widest_table <= self.max_blocks

    def run(
        self, batch: RowBatch, bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward + draft of `batch` (one row per sequence, seq_ids = arange)."""
        n = len(batch)
        size = next(b for b in self.buckets if b >= n)
        g = self._graphs[size, bitmask is not None]
        s = g.batch
        s.tokens[:n].copy_(batch.tokens)
        s.hiddens[:n].copy_(batch.hiddens)
        s.positions[:n].copy_(batch.positions)
        s.slot_mapping[:n].copy_(batch.slot_mapping)
        s.slot_mapping[n:].fill_(-1)
        s.positions[n:].fill_(0)
        s.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        if g.bitmask is not None:
            g.bitmask[:n].copy_(bitmask)
        g.graph.replay()
        return g.hidden[:n], g.tokens[:n], g.probs[:n]
