"""The bookkeeping of a self-advancing CUDA graph: pick this step's inputs, record its outputs.

A graph replayed once per step cannot be handed a different step index each time,
so the index lives on the device: ``select_step`` copies row ``step`` of the staged
per-step inputs into the buffers the step reads (and notes the index in ``cur``);
``record_step`` stores the step's outputs at row ``cur`` of the per-step outputs,
feeds them back as the next step's inputs, and advances ``step``. Two kernels where
torch ops took seven (index_select x2, index_copy x3, two copies and an add: about
13 us per step on an H200, about 3% of a batch-1 step).

``step`` is read by every program of ``select_step`` and written only by
``record_step`` (and ``cur`` the other way round), so no program ever reads an index
that another program of the same kernel is changing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_same_device, check_shape, check_tensor

__all__ = ["record_step", "select_step"]

_BLOCK = 1024


@triton.jit
def _select_step_kernel(
    step_ptr,  # [1] int64 step index
    cur_ptr,  # [1] int64, set to the step index
    a_ptr,  # [S, A] per-step input
    a_now_ptr,  # [A] this step's row of a
    b_ptr,  # [S, B] second per-step input (unused without HAS_B)
    b_now_ptr,  # [B]
    A,  # elements per step of a
    B,  # elements per step of b
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.load(step_ptr)
    if pid == 0:
        tl.store(cur_ptr, step)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < A
    tl.store(a_now_ptr + offs, tl.load(a_ptr + step * A + offs, mask=ok), mask=ok)
    if HAS_B:
        ok = offs < B
        tl.store(b_now_ptr + offs, tl.load(b_ptr + step * B + offs, mask=ok), mask=ok)


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
    a: torch.Tensor,
    a_now: torch.Tensor,
    b: torch.Tensor | None = None,
    b_now: torch.Tensor | None = None,
) -> None:
    """``a_now = a[step]`` (and ``b_now = b[step]``), ``cur = step``; step is read on the device.

    ``a`` ([S, ...]) and ``b`` are the staged per-step inputs, ``a_now``/``b_now`` the
    buffers one step reads (shape ``a.shape[1:]``). The step index must be < S.
    """
    _check_index("step", step)
    _check_index("cur", cur)
    pairs = [("a", a, a_now)] + ([] if b is None else [("b", b, b_now)])
    for name, table, now in pairs:
        if not isinstance(now, torch.Tensor):
            raise ValueError(f"{name}_now must be a torch.Tensor")
        check_tensor(name, table, table.dim())
        check_tensor(f"{name}_now", now, now.dim(), (table.dtype,))
        check_shape(f"{name}_now", now, tuple(table.shape[1:]))
    check_same_device(step=step, cur=cur, a=a, a_now=a_now, **({} if b is None else {"b": b}))
    size_a, size_b = a_now.numel(), 0 if b_now is None else b_now.numel()
    grid = (triton.cdiv(max(size_a, size_b, 1), _BLOCK),)
    _select_step_kernel[grid](
        step, cur, a, a_now, a if b is None else b, a_now if b_now is None else b_now,
        size_a, size_b, HAS_B=b is not None, BLOCK=_BLOCK,
    )  # fmt: skip


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
