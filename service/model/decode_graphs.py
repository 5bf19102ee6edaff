"""CUDA graphs of chained decode steps, per batch-size bucket: a chain of K drafts is one replay.

A draft step at decode batch sizes is a couple dozen short kernels; launched one
by one from Python they cost more than the step itself (measured: the eager step
is 5-6x the HBM roofline at batch 1, DESIGN.md, "The draft step"). So the step is captured once per
batch-size bucket, and it advances itself: it works out its step's positions, slots
and context lengths from each sequence's first position and limit (indexed by a step
counter on the device) and reads its step's mask, writes its draft, probability and
hidden into per-step outputs, and feeds the draft and hidden to the next step (two
small kernels: mtpdraft.kernels.chain_step). K such steps are captured in one graph,
one graph per K up to max_steps (as SGLang captures all draft steps of EAGLE in one),
so a chain of K drafts is one host to device copy of its inputs (one pinned buffer:
tokens, positions, limits, hiddens and block tables), one replay and one wait, with
no launch from the host in between.
Rows past the live batch are padding: they write no KV (slot -1) and their outputs
are ignored.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from mtpdraft import kernels

from .batch import RowBatch
from .decode_chain import BeforeWait, ChainInputs, ChainOutputs
from .kv_cache import KVCache

# Buckets double so that a batch pads by less than 2x; 64 is the default max batch.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


class _Bucket:
    """The static buffers of one batch size, shared by its masked and unmasked graphs."""

    def __init__(self, head, size: int, max_steps: int, max_blocks: int, words: int) -> None:
        dev, h = head.device, head.config.hidden_size
        self.size = size
        # A chain's inputs are staged in one pinned buffer and copied in one piece: int64
        # first tokens, first positions and limits [size] each, the compact tables' shape
        # [2] and the step counter [1]; the first hiddens [size, H]; then the block tables,
        # compact ([n, w], read at [size, max_blocks] once expanded on the device).
        meta = _aligned((3 * size + 3) * 8)
        self.tables_at = meta + _aligned(size * h * head.dtype.itemsize)
        nbytes = self.tables_at + size * max_blocks * 4
        self.staged_host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
        self.staged = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        self.meta_host = self.staged_host[:meta].view(torch.int64).numpy()
        self.hiddens_host = self.staged_host[meta : self.tables_at].view(head.dtype)
        self.hiddens_host = self.hiddens_host[: size * h].view(size, h)
        self.tables_host = self.staged_host[self.tables_at :].view(torch.int32).numpy()
        ints = self.staged[:meta].view(torch.int64)
        self.tokens, self.first, self.limits = (
            ints[:size],
            ints[size : 2 * size],
            ints[2 * size : 3 * size],
        )
        self.shape, self.step = ints[3 * size : 3 * size + 2], ints[3 * size + 2 : 3 * size + 3]
        self.hiddens = self.staged[meta : self.tables_at].view(head.dtype)[: size * h].view(size, h)
        self.compact = self.staged[self.tables_at :].view(torch.int32)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=dev)
        self.cur = torch.zeros(1, dtype=torch.int64, device=dev)  # the running step's index
        self.now = torch.empty(3, size, dtype=torch.int64, device=dev)  # this step's rows
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

    def begin(self) -> None:
        """The chain's head, once per replay: the staged block tables at their full width."""
        kernels.expand_block_tables(self.shape, self.compact, self.block_tables)

    def step_fn(self, head, kv: KVCache, masked: bool):
        """The step the graph records: this step's rows, compute, record, feed forward."""
        masks = (self.masks, self.mask_now) if masked else ()
        rows = (self.first, self.limits, self.block_tables, kv.block_size, self.now)

        def step() -> None:
            kernels.select_step(self.step, self.cur, *rows, *masks)
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

    def stage(self, chain: ChainInputs) -> None:
        """The chain's inputs into the pinned buffer, then to the device in one copy. The
        buffer is free: the previous chain's wait covered its copy."""
        n, (_, width) = len(chain), chain.block_tables.shape
        meta, size = self.meta_host, self.size
        meta[:n], meta[size : size + n], meta[2 * size : 2 * size + n] = (
            chain.tokens, chain.positions, chain.limits
        )  # fmt: skip
        meta[n:size] = meta[size + n : 2 * size] = meta[2 * size + n : 3 * size] = 0  # padding
        meta[3 * size : 3 * size + 3] = (n, width, 0)  # the compact tables' shape; the step counter
        self.tables_host[: n * width] = chain.block_tables.reshape(-1)
        on_host = chain.hiddens.device.type == "cpu"
        if on_host:
            self.hiddens_host[:n].copy_(chain.hiddens)
        end = self.tables_at + n * width * 4
        self.staged[:end].copy_(self.staged_host[:end], non_blocking=True)
        if not on_host:  # after the copy above, which wrote the rows it replaces
            self.hiddens[:n].copy_(chain.hiddens)


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
                        bucket.graphs[masked, steps] = self._capture(bucket, step, steps)
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
                bucket.begin()
                step()
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, bucket: _Bucket, step, steps: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.begin()
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

    def run(self, chain: ChainInputs, before_wait: BeforeWait | None = None) -> ChainOutputs:
        """The chain (see ChainInputs); `before_wait` runs while the device replays it."""
        self.stage(chain).replay()
        if before_wait is not None:
            b = self._bucket(len(chain))
            before_wait(b.out_h[: chain.steps, : len(chain)])
        return self.collect(chain)

    def stage(self, chain: ChainInputs) -> torch.cuda.CUDAGraph:
        """Copies the chain's inputs to its bucket; returns the graph that runs the chain."""
        n, steps = len(chain), chain.steps
        b = self._bucket(n)
        b.stage(chain)
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
