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
tokens, positions, limits, sampling parameters, hiddens and block tables), one replay
and one wait, with no launch from the host in between. A sampled chain has graphs of
its own: the LM head writes its logits as it drafts, and the draw (top_support, then one
kernel: mtpdraft.kernels.sample_top) writes each step's q beside its draft.
Rows past the live batch are padding: they write no KV (slot -1), draft greedily, and
their outputs are ignored.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from itertools import product

import torch

from mtpdraft import kernels

from .batch import RowBatch
from .decode_chain import BeforeWait, ChainInputs, ChainOutputs
from .kv_cache import KVCache
from .sampling import RowSampling, SamplingParams

# Buckets double so that a batch pads by less than 2x; 64 is the default max batch.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


# A chain's inputs, one row per sequence: int64 columns, then float32 columns (the
# sampling ones are read by the sampled graphs only).
_INTS = ("tokens", "first", "limits", "top_k", "seeds", "states", "first_index")
_FLOATS = ("temperature", "top_p", "min_p")


def _layout(size: int, h: int, itemsize: int, max_blocks: int):
    """Each piece's (offset, bytes) in a staging buffer, 16-byte aligned; and the total."""
    pieces = {
        "ints": (len(_INTS) * size + 3) * 8,
        "floats": len(_FLOATS) * size * 4,
        "hiddens": size * h * itemsize,
        "tables": size * max_blocks * 4,
    }
    at, where = 0, {}
    for name, nbytes in pieces.items():
        where[name] = (at, nbytes)
        at += _aligned(nbytes)
    return where, at


class _Staged:
    """Named views of one staging buffer, host or device, laid out alike: the int64 and
    float32 columns [size] each, the compact tables' shape [2] and the step counter [1];
    the first hiddens [size, H]; then the block tables, compact ([n, w])."""

    def __init__(self, buffer: torch.Tensor, size: int, h: int, dtype, max_blocks: int) -> None:
        where, _ = _layout(size, h, dtype.itemsize, max_blocks)
        at, nbytes = zip(*where.values(), strict=True)
        ints, floats, hiddens, tables = (buffer[a : a + b] for a, b in zip(at, nbytes, strict=True))
        self.ints, self.floats = ints.view(torch.int64), floats.view(torch.float32)
        for i, name in enumerate(_INTS):
            setattr(self, name, self.ints[i * size : (i + 1) * size])
        for i, name in enumerate(_FLOATS):
            setattr(self, name, self.floats[i * size : (i + 1) * size])
        self.shape = self.ints[len(_INTS) * size :][:2]
        self.step = self.ints[len(_INTS) * size + 2 :]
        self.hiddens = hiddens.view(dtype).view(size, h)
        self.tables_at = where["tables"][0]
        self.tables = tables.view(torch.int32)


class _Bucket:
    """The static buffers of one batch size, shared by its graphs (masked or not, sampled
    or not, of each chain length)."""

    def __init__(
        self, head, size: int, max_steps: int, max_blocks: int, words: int, support: int
    ) -> None:
        dev, h = head.device, head.config.hidden_size
        self.size, self.support = size, support
        _, nbytes = _layout(size, h, head.dtype.itemsize, max_blocks)
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
        self.staged = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        self.host, self.dev = (
            _Staged(b, size, h, head.dtype, max_blocks) for b in (self.host_bytes, self.staged)
        )
        self.ints_host, self.floats_host = self.host.ints.numpy(), self.host.floats.numpy()
        self.tables_host = self.host.tables.numpy()
        d = self.dev
        params = SamplingParams(d.temperature, d.top_k, d.top_p, d.min_p)
        self.sampling = RowSampling(params, d.seeds, d.states, support)
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
        self.out_qi = torch.zeros(max_steps, size, support, dtype=torch.int64, device=dev)
        self.out_qp = torch.zeros(max_steps, size, support, dtype=torch.float32, device=dev)
        self.out_host = [torch.zeros_like(t, device="cpu").pin_memory()
                         for t in (self.out_t, self.out_p, self.out_qi, self.out_qp)]  # fmt: skip
        self.done = torch.cuda.Event()
        # (masked, sampled, steps)
        self.graphs: dict[tuple[bool, bool, int], torch.cuda.CUDAGraph] = {}

    def begin(self) -> None:
        """The chain's head, once per replay: the staged block tables at their full width;
        a sequence whose first hidden is not finite stopped (it writes no KV)."""
        kernels.expand_block_tables(self.dev.shape, self.dev.tables, self.block_tables)
        kernels.stop_nonfinite_rows(self.dev.hiddens, self.dev.limits)

    def step_fn(self, head, kv: KVCache, masked: bool, sampled: bool):
        """The step the graph records: this step's rows, compute, record, feed forward."""
        d = self.dev
        masks = (self.masks, self.mask_now) if masked else ()
        rows = (d.first, d.limits, self.block_tables, kv.block_size, self.now)

        def step(j: int) -> None:
            kernels.select_step(d.step, self.cur, *rows, *masks)
            positions, slots, context_lens = self.now
            batch = RowBatch(
                d.tokens, d.hiddens, positions, self.seq_ids, slots, self.block_tables,
                context_lens,
            )  # fmt: skip
            hidden = head.forward(batch, kv)
            mask = self.mask_now if masked else None
            if sampled:
                # A row at position p (its hidden's) holds the token at p + 1, drafts p + 2.
                chosen = head.select(
                    hidden, mask, self.sampling, positions, d.first_index,
                    out=(self.out_qi[j], self.out_qp[j]), key_offsets=(2, j),
                )  # fmt: skip
                tokens, probs = chosen.tokens, chosen.probs
            else:
                tokens, probs = head.draft(hidden, mask)
            kernels.record_step(
                self.cur, d.step, hidden, tokens, probs, self.out_h, self.out_t, self.out_p,
                d.hiddens, d.tokens,
            )  # fmt: skip

        return step

    def stage(self, chain: ChainInputs) -> None:
        """The chain's inputs into the pinned buffer, then to the device in one copy. The
        buffer is free: the previous chain's wait covered its copy."""
        n, (_, width) = len(chain), chain.block_tables.shape
        ints, size, host = self.ints_host, self.size, self.host
        columns = [chain.tokens, chain.positions, chain.limits]
        sampling = chain.sampling
        if sampling is not None:
            columns += [sampling.top_k, sampling.seeds, sampling.states, sampling.first_index]
            floats = self.floats_host.reshape(len(_FLOATS), size)
            floats[:, :n] = sampling.temperature, sampling.top_p, sampling.min_p
            floats[:, n:] = 0  # padding rows are greedy
        rows = ints[: len(_INTS) * size].reshape(len(_INTS), size)
        rows[: len(columns), :n] = columns
        rows[: len(columns), n:] = 0  # padding
        ints[len(_INTS) * size :] = (n, width, 0)  # the compact tables' shape; the step counter
        self.tables_host[: n * width] = chain.block_tables.reshape(-1)
        on_host = chain.hiddens.device.type == "cpu"
        if on_host:
            host.hiddens[:n].copy_(chain.hiddens)
        end = host.tables_at + n * width * 4
        self.staged[:end].copy_(self.host_bytes[:end], non_blocking=True)
        if not on_host:  # after the copy above, which wrote the rows it replaces
            self.dev.hiddens[:n].copy_(chain.hiddens)


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
        support: int = 0,
    ) -> None:
        """Graphs for every chain of up to max_steps steps of a bucket's rows, with and
        without masks (as `masks` lists), and sampled too when `support` (the most tokens
        a sampled draft's q holds) is given."""
        self.head, self.kv, self.max_steps, self.support = head, kv, max_steps, support
        c = head.config
        self.max_blocks = -(-c.max_position_embeddings // kv.block_size)
        words = (c.vocab_size + 31) // 32
        if buckets is None:
            buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        self.pool = torch.cuda.graph_pool_handle()
        self._buckets: dict[int, _Bucket] = {}
        with _collector_paused():
            for size in sorted(buckets, reverse=True):  # largest first: the others reuse its pool
                bucket = _Bucket(head, size, max_steps, self.max_blocks, words, max(support, 1))
                for masked, sampled in product(masks, (False, True) if support else (False,)):
                    step = bucket.step_fn(head, kv, masked, sampled)
                    self._warm_up(step, bucket)
                    for steps in range(1, max_steps + 1):
                        graph = self._capture(bucket, step, steps)
                        bucket.graphs[masked, sampled, steps] = graph
                self._buckets[size] = bucket
        self.sizes = sorted(self._buckets)

    @staticmethod
    def _warm_up(step, bucket: _Bucket) -> None:
        """Runs the step outside a graph: Triton compiles, cuBLAS picks its kernels."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                bucket.dev.step.zero_()
                bucket.begin()
                step(0)
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, bucket: _Bucket, step, steps: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.begin()
            for j in range(steps):
                step(j)
        return graph

    def fits(self, chain: ChainInputs) -> bool:
        # A top_k wider than the support ranks the whole vocabulary: step by step.
        sampling = chain.sampling
        return (
            (sampling is None or (sampling.support == self.support and not sampling.wide))
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
        return b.graphs[chain.bitmasks is not None, chain.sampling is not None, steps]

    def collect(self, chain: ChainInputs) -> ChainOutputs:
        """Waits for the replayed chain and returns its outputs."""
        n, steps = len(chain), chain.steps
        b = self._bucket(n)
        outputs = (b.out_t, b.out_p, b.out_qi, b.out_qp)[: 2 if chain.sampling is None else 4]
        for host, out in zip(b.out_host, outputs, strict=False):
            host[:steps].copy_(out[:steps], non_blocking=True)
        b.done.record()
        b.done.synchronize()  # the chain's one wait; releases the GIL meanwhile
        read = [host[:steps, :n].numpy().copy() for host in b.out_host[: len(outputs)]]
        return ChainOutputs(b.out_h[:steps, :n], *read)  # hiddens: read before the next chain

    def _bucket(self, n: int) -> _Bucket:
        return self._buckets[next(s for s in self.sizes if s >= n)]
