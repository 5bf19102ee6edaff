"""CUDA graphs of chained decode steps, per batch-size bucket: a chain of K drafts is one replay.

A draft step at decode batch sizes is a couple dozen short kernels; launched one
by one from Python they cost more than the step itself (measured: the eager step
is 5-6x the HBM roofline at batch 1, DESIGN.md, "The draft step"). So the step is captured once per
batch-size bucket, and it advances itself: it reads its step's positions, slots
and mask from tables staged for the whole chain (indexed by a step counter on the
device), writes its draft, probability and hidden into per-step outputs, and feeds
the draft and hidden to the next step (two small kernels: mtpdraft.kernels.chain_step).
K such steps are captured in one graph, one graph per K up to max_steps (as SGLang
captures all draft steps of EAGLE in one), so a chain of K drafts is three host to
device copies, one replay and one wait, with no launch from the host in between.
Rows past the live batch are padding: they write no KV (slot -1) and their outputs
are ignored.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import numpy as np
import torch

from mtpdraft import kernels

from .batch import RowBatch
from .decode_chain import BeforeWait, ChainInputs, ChainOutputs
from .kv_cache import KVCache

# Buckets double so that a batch pads by less than 2x; 64 is the default max batch.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Bucket:
    """The static buffers of one batch size, shared by its masked and unmasked graphs."""

    def __init__(self, head, size: int, max_steps: int, max_blocks: int, words: int) -> None:
        dev, h = head.device, head.config.hidden_size
        self.size = size
        # One int64 buffer (one copy to stage it): the chain's step rows
        # [max_steps, 3, size] (positions, slots, context lengths), the first
        # tokens [size] and the step counter [1].
        rows = max_steps * 3 * size
        self.meta_host = torch.zeros(rows + size + 1, dtype=torch.int64).pin_memory()
        self.meta = torch.zeros_like(self.meta_host, device=dev)
        self.rows = self.meta[:rows].view(max_steps, 3, size)
        self.rows[:, 1] = -1  # nothing written until a chain is staged (capture runs too)
        self.rows[:, 2] = 1
        self.tokens = self.meta[rows : rows + size]
        self.step = self.meta[rows + size :]
        self.cur = torch.zeros(1, dtype=torch.int64, device=dev)  # the running step's index
        self.now = torch.empty(3, size, dtype=torch.int64, device=dev)  # this step's rows
        self.hiddens = torch.zeros(size, h, dtype=head.dtype, device=dev)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=dev)
        self.seq_ids = torch.arange(size, dtype=torch.int32, device=dev)
        self.masks_host = torch.full((max_steps, size, words), -1, dtype=torch.int32).pin_memory()
        self.masks = torch.full_like(self.masks_host, -1, device=dev)
        self.mask_now = torch.full((size, words), -1, dtype=torch.int32, device=dev)
        self.out_h = torch.zeros(max_steps, size, h, dtype=head.dtype, device=dev)
        self.out_t = torch.zeros(max_steps, size, dtype=torch.int64, device=dev)
        self.out_p = torch.zeros(max_steps, size, dtype=torch.float32, device=dev)
        self.out_t_host = torch.zeros_like(self.out_t, device="cpu").pin_memory()
        self.out_p_host = torch.zeros_like(self.out_p, device="cpu").pin_memory()
        self.done = torch.cuda.Event()
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}  # (masked, steps)

    def step_fn(self, head, kv: KVCache, masked: bool):
        """The step the graph records: read this step's rows, compute, record, feed forward."""

        def step() -> None:
            if masked:
                kernels.select_step(
                    self.step, self.cur, self.rows, self.now, self.masks, self.mask_now
                )
            else:
                kernels.select_step(self.step, self.cur, self.rows, self.now)
            positions, slots, context_lens = self.now
            batch = RowBatch(
                self.tokens, self.hiddens, positions, self.seq_ids, slots, self.block_tables,
                context_lens,
            )  # fmt: skip
            hidden = head.forward(batch, kv)
            tokens, probs = head.draft(hidden, self.mask_now if masked else None)
            kernels.record_step(
                self.cur, self.step, hidden, tokens, probs, self.out_h, self.out_t, self.out_p,
                self.hiddens, self.tokens,
            )  # fmt: skip

        return step


@contextmanager
def _collector_paused():
    """Python's garbage collector paused (after one collection): collected mid-capture, an
    earlier CUDA graph or tensor frees device memory, which invalidates the capture."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DecodeGraphs:
    """Runs chains of one-row-per-sequence decode steps from captured CUDA graphs."""

    def __init__(
        self,
        head,
        kv: KVCache,
        max_batch: int,
        max_steps: int,
        *,
        buckets: tuple[int, ...] | None = None,
        masks: tuple[bool, ...] = (False, True),
    ) -> None:
        self.head, self.kv, self.max_steps = head, kv, max_steps
        c = head.config
        self.max_blocks = -(-c.max_position_embeddings // kv.block_size)
        words = (c.vocab_size + 31) // 32
        if buckets is None:
            buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        self.pool = torch.cuda.graph_pool_handle()
        self._buckets: dict[int, _Bucket] = {}
        with _collector_paused():
            for size in sorted(buckets, reverse=True):  # largest first: the others reuse its pool
                bucket = _Bucket(head, size, max_steps, self.max_blocks, words)
                for masked in masks:
                    step = bucket.step_fn(head, kv, masked)
                    self._warm_up(step, bucket)
                    for steps in range(1, max_steps + 1):
                        bucket.graphs[masked, steps] = self._capture(step, steps)
                self._buckets[size] = bucket
        self.sizes = sorted(self._buckets)

    @staticmethod
    def _warm_up(step, bucket: _Bucket) -> None:
        """Runs the step outside a graph: Triton compiles, cuBLAS picks its kernels."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                bucket.step.zero_()
                step()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, step, steps: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for _ in range(steps):
                step()
        return graph

    def fits(self, chain: ChainInputs) -> bool:
        # A sampled chain has no graph yet: it runs the same kernels step by step.
        return (
            chain.sampling is None
            and len(chain) <= self.sizes[-1]
            and chain.block_tables.shape[1] <= self.max_blocks
            and chain.steps <= self.max_steps
        )

    def run(
        self, chain: ChainInputs, step_rows: np.ndarray, before_wait: BeforeWait | None = None
    ) -> ChainOutputs:
        """The chain (see ChainInputs), given its step rows [steps, 3, n] on the host;
        `before_wait` runs while the device replays it."""
        self.stage(chain, step_rows).replay()
        if before_wait is not None:
            b = self._bucket(len(chain))
            before_wait(b.out_h[: chain.steps, : len(chain)])
        return self.collect(chain)

    def stage(self, chain: ChainInputs, step_rows: np.ndarray) -> torch.cuda.CUDAGraph:
        """Copies the chain's inputs to its bucket; returns the graph that runs the chain."""
        n, steps, width = len(chain), chain.steps, chain.block_tables.shape[1]
        b = self._bucket(n)
        # Staged in pinned host buffers and copied without waiting. The buffers are
        # free: the previous chain's wait covered its copies.
        rows = b.meta_host[: self.max_steps * 3 * b.size].view(self.max_steps, 3, b.size)
        rows[:steps, :, :n] = torch.from_numpy(step_rows)
        rows[:steps, 0, n:], rows[:steps, 1, n:], rows[:steps, 2, n:] = 0, -1, 1
        tokens = b.meta_host[self.max_steps * 3 * b.size :]
        tokens[:n] = torch.from_numpy(chain.tokens)
        tokens[n:] = 0  # padding rows' tokens, and the step counter
        b.meta.copy_(b.meta_host, non_blocking=True)
        b.hiddens[:n].copy_(chain.hiddens, non_blocking=True)
        b.block_tables[:n, :width].copy_(torch.from_numpy(chain.block_tables), non_blocking=True)
        if chain.bitmasks is not None:
            b.masks_host[:steps, :n] = chain.bitmasks
            b.masks_host[:steps, n:] = -1  # padding rows allow every token (no -1 drafts)
            b.masks[:steps].copy_(b.masks_host[:steps], non_blocking=True)
        return b.graphs[chain.bitmasks is not None, steps]

    def collect(self, chain: ChainInputs) -> ChainOutputs:
        """Waits for the replayed chain and returns its outputs."""
        n, steps = len(chain), chain.steps
        b = self._bucket(n)
        b.out_t_host[:steps].copy_(b.out_t[:steps], non_blocking=True)
        b.out_p_host[:steps].copy_(b.out_p[:steps], non_blocking=True)
        b.done.record()
        b.done.synchronize()  # the chain's one wait; releases the GIL meanwhile
        return ChainOutputs(
            b.out_h[:steps, :n],  # read before the next chain overwrites it
            b.out_t_host[:steps, :n].numpy().copy(),
            b.out_p_host[:steps, :n].numpy().copy(),
        )

    def _bucket(self, n: int) -> _Bucket:
        return self._buckets[next(s for s in self.sizes if s >= n)]
