"""The bookkeeping of a self-advancing CUDA graph: pick this step's inputs, record its outputs.

A graph replayed once per step cannot be handed a different step index each time,
so the index lives on the device: ``select_step`` works out row ``step`` of the chain
(each sequence's position, KV slot and context length, from its first position, its
limit and its block table, so the host stages one row per sequence, not one per step)
and copies that step's mask (and notes the index in ``cur``); ``record_step`` stores
the step's outputs at row ``cur`` of the per-step outputs, feeds them back as the next
step's inputs, and advances ``step``. Two kernels where torch ops took seven
(index_select x2, index_copy x3, two copies and an add: about 13 us per step on an
H200, about 3% of a batch-1 step). ``expand_block_tables`` runs once at a chain's head:
the host stages the block tables compactly, [n, w], in the chain's one copy, and the
graph reads them at the width it was captured with. ``stop_nonfinite_rows`` runs there
too: a sequence whose first hidden holds a NaN or an inf gets limit 0, so its chain writes
no KV (the host's own check of the hiddens then runs while the device drafts).

``step`` is read by every program of ``select_step`` and written only by
``record_step`` (and ``cur`` the other way round), so no program ever reads an index
that another program of the same kernel is changing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_same_device, check_shape, check_tensor

__all__ = ["expand_block_tables", "record_step", "select_step", "stop_nonfinite_rows"]

_BLOCK = 1024


@triton.jit
def _select_step_kernel(
    step_ptr,  # [1] int64 step index
    cur_ptr,  # [1] int64, set to the step index
    first_ptr,  # [N] int64: each row's first position
    limit_ptr,  # [N] int64: each row's steps that write KV (0: a padding row)
    tables_ptr,  # [N, W] int32 block tables
    now_ptr,  # [3, N] int64 out: this step's positions, KV slots, context lengths
    masks_ptr,  # [S, M] per-step masks (unused without HAS_MASK)
    mask_now_ptr,  # [M] this step's row of masks
    N,
    W,
    M,  # mask elements per step
    block_size,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.load(step_ptr)
    if pid == 0:
        tl.store(cur_ptr, step)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    first = tl.load(first_ptr + offs, mask=ok, other=0)
    limit = tl.load(limit_ptr + offs, mask=ok, other=0)
    live = limit > 0
    # A row past its limit repeats its last row's position (a valid context) and writes
    # nothing; a padding row reads position 0 and writes nothing.
    pos = tl.where(live, first + tl.minimum(step, limit - 1), 0)
    page = tl.minimum(pos // block_size, W - 1)
    block = tl.load(tables_ptr + offs.to(tl.int64) * W + page, mask=ok & live, other=0)
    slot = tl.where(live & (step < limit), block.to(tl.int64) * block_size + pos % block_size, -1)
    tl.store(now_ptr + offs, pos, mask=ok)
    tl.store(now_ptr + N + offs, slot, mask=ok)
    tl.store(now_ptr + 2 * N + offs, pos + 1, mask=ok)
    if HAS_MASK:
        ok = offs < M
        tl.store(mask_now_ptr + offs, tl.load(masks_ptr + step * M + offs, mask=ok), mask=ok)


@triton.jit
def _expand_block_tables_kernel(
    shape_ptr,  # [2] int64: n, w
    compact_ptr,  # [n * w] int32
    tables_ptr,  # [N, W] int32
    W,
    BLOCK: tl.constexpr,
):
    n = tl.load(shape_ptr)
    w = tl.maximum(tl.load(shape_ptr + 1), 1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n * w
    value = tl.load(compact_ptr + offs, mask=ok)
    tl.store(tables_ptr + (offs // w) * W + offs % w, value, mask=ok)


@triton.jit
def _stop_nonfinite_rows_kernel(
    x_ptr,  # [N, H]
    limit_ptr,  # [N] int64, set to 0 where the row is not finite
    H,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    bad = 0
    for start in range(0, H, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * H + offs, mask=offs < H, other=0.0).to(tl.float32)
        bad += tl.sum(((x - x) != 0).to(tl.int32))  # x - x is NaN for NaN and +-inf alone
    if bad > 0:
        tl.store(limit_ptr + row, 0)


@triton.jit
def _record_step_kernel(
    cur_ptr,  # [1] int64 step index
    step_ptr,  # [1] int64, set to cur + 1
    h_ptr,  # [N * H] output hiddens
    t_ptr,  # [N] output tokens
    p_ptr,  # [N] output probabilities
    out_h_ptr,  # [S, N * H]
    out_t_ptr,  # [S, N]
    out_p_ptr,  # [S, N]
    feed_h_ptr,  # [N * H] the next step's input hiddens
    feed_t_ptr,  # [N] the next step's input tokens
    NH,  # N * H
    N,  # rows
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cur = tl.load(cur_ptr)
    if pid == 0:
        tl.store(step_ptr, cur + 1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NH
    h = tl.load(h_ptr + offs, mask=ok)
    tl.store(out_h_ptr + cur * NH + offs, h, mask=ok)
    tl.store(feed_h_ptr + offs, h, mask=ok)
    ok = offs < N
    t = tl.load(t_ptr + offs, mask=ok)
    tl.store(out_t_ptr + cur * N + offs, t, mask=ok)
    tl.store(feed_t_ptr + offs, t, mask=ok)
    tl.store(out_p_ptr + cur * N + offs, tl.load(p_ptr + offs, mask=ok), mask=ok)


def _check_index(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, 1, (torch.int64,))
    check_shape(name, t, (1,))


def select_step(
    step: torch.Tensor,
    cur: torch.Tensor,
    first_positions: torch.Tensor,
    limits: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    now: torch.Tensor,
    masks: torch.Tensor | None = None,
    mask_now: torch.Tensor | None = None,
) -> None:
    """This step's rows of a chain, from its step index on the device (``cur = step``).

    Row i advances from position ``first_positions[i]`` by one a step and writes the KV
    of its first ``limits[i]`` steps; past them it repeats its last position and writes
    nothing, and a row of limit 0 is padding (position 0, nothing written). ``now``
    [3, N] int64 gets the step's positions, KV slots (block * block_size + offset, -1:
    none) and context lengths; ``mask_now = masks[step]`` where masks ([S, ...]) are given.
    """
    _check_index("step", step)
    _check_index("cur", cur)
    check_tensor("first_positions", first_positions, 1, (torch.int64,))
    n = first_positions.shape[0]
    check_tensor("limits", limits, 1, (torch.int64,))
    check_shape("limits", limits, (n,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_shape("block_tables", block_tables, (n, block_tables.shape[1]))
    check_tensor("now", now, 2, (torch.int64,))
    check_shape("now", now, (3, n))
    if block_size < 1 or block_tables.shape[1] < 1:
        raise ValueError("block_size and the block tables' width must be >= 1")
    size = 0
    if masks is not None:
        check_tensor("masks", masks, masks.dim())
        if not isinstance(mask_now, torch.Tensor):
            raise ValueError("mask_now must be a torch.Tensor")
        check_tensor("mask_now", mask_now, mask_now.dim(), (masks.dtype,))
        check_shape("mask_now", mask_now, tuple(masks.shape[1:]))
        size = mask_now.numel()
    check_same_device(step=step, cur=cur, first_positions=first_positions, now=now)
    grid = (triton.cdiv(max(n, size, 1), _BLOCK),)
    _select_step_kernel[grid](
        step, cur, first_positions, limits, block_tables, now,
        now if masks is None else masks, now if mask_now is None else mask_now,
        n, block_tables.shape[1], size, block_size, HAS_MASK=masks is not None, BLOCK=_BLOCK,
    )  # fmt: skip


def expand_block_tables(
    shape: torch.Tensor, compact: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """``block_tables[:n, :w] = compact[: n * w].view(n, w)``, with (n, w) = ``shape``, read
    on the device: a chain staged compactly widened to the tables a graph was captured with
    (n <= N and w <= W are the caller's to keep)."""
    check_tensor("shape", shape, 1, (torch.int64,))
    check_shape("shape", shape, (2,))
    check_tensor("compact", compact, 1, (torch.int32,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if compact.numel() < block_tables.numel():
        raise ValueError("compact must hold as many elements as block_tables")
    check_same_device(shape=shape, compact=compact, block_tables=block_tables)
    grid = (triton.cdiv(max(block_tables.numel(), 1), _BLOCK),)
    _expand_block_tables_kernel[grid](
        shape, compact, block_tables, block_tables.shape[1], BLOCK=_BLOCK
    )


def record_step(
    cur: torch.Tensor,
    step: torch.Tensor,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    out_h: torch.Tensor,
    out_t: torch.Tensor,
    out_p: torch.Tensor,
    feed_hidden: torch.Tensor,
    feed_tokens: torch.Tensor,
) -> None:
    """``out_*[cur] = (hidden, tokens, probs)``, ``feed_* = (hidden, tokens)``, ``step = cur + 1``.

    hidden [N, H], tokens [N] int64, probs [N] fp32; out_h [S, N, H], out_t [S, N],
    out_p [S, N]; feed_hidden [N, H] and feed_tokens [N] (the next step's inputs).
    """
    _check_index("cur", cur)
    _check_index("step", step)
    check_tensor("hidden", hidden, 2)
    n, h = hidden.shape
    check_tensor("tokens", tokens, 1, (torch.int64,))
    check_tensor("probs", probs, 1, (torch.float32,))
    check_tensor("out_h", out_h, 3, (hidden.dtype,))
    check_tensor("out_t", out_t, 2, (torch.int64,))
    check_tensor("out_p", out_p, 2, (torch.float32,))
    check_tensor("feed_hidden", feed_hidden, 2, (hidden.dtype,))
    check_tensor("feed_tokens", feed_tokens, 1, (torch.int64,))
    s = out_h.shape[0]
    for name, t, shape in [
        ("tokens", tokens, (n,)), ("probs", probs, (n,)), ("out_h", out_h, (s, n, h)),
        ("out_t", out_t, (s, n)), ("out_p", out_p, (s, n)), ("feed_hidden", feed_hidden, (n, h)),
        ("feed_tokens", feed_tokens, (n,)),
    ]:  # fmt: skip
        check_shape(name, t, shape)
    check_same_device(cur=cur, step=step, hidden=hidden, out_h=out_h, feed_hidden=feed_hidden)
    grid = (triton.cdiv(max(n * h, 1), _BLOCK),)
    _record_step_kernel[grid](
        cur, step, hidden, tokens, probs, out_h, out_t, out_p, feed_hidden, feed_tokens,
        n * h, n, BLOCK=_BLOCK,
    )  # fmt: skip


def stop_nonfinite_rows(x: torch.Tensor, limits: torch.Tensor) -> None:
    """``limits[i] = 0`` where row i of ``x`` [N, H] holds a NaN or an inf; limits [N] int64."""
    check_tensor("x", x, 2, (torch.float32, torch.float16, torch.bfloat16))
    check_tensor("limits", limits, 1, (torch.int64,))
    check_shape("limits", limits, (x.shape[0],))
    check_same_device(x=x, limits=limits)
    if x.shape[0]:
        block = min(triton.next_power_of_2(max(x.shape[1], 1)), _BLOCK)
        _stop_nonfinite_rows_kernel[(x.shape[0],)](x, limits, x.shape[1], BLOCK=block)
