"""A mixture-of-experts MLP for decode batches: ``out[n] = sum_j w[n, j] * expert_{e[n, j]}(x[n])``.

Each expert is a SwiGLU MLP, ``down_e @ (silu(gate_e @ x) * (up_e @ x))``, and each token
goes to the k experts its router chose (``topk_ids``, with the router's ``topk_weights``).
At decode batch sizes (N = 1..64 tokens, k = 8..10 of E = 128..512 experts) each routed
expert sees a few tokens, so the op is bound by reading the experts' weights: it reads
only the experts the batch routes to, and each of those once for all the tokens that chose
it (up to BLOCK_M of them, below).

Four launches, none of which waits for the host, so the op can be captured in a CUDA graph
and replayed with other routings in the same tensors (every grid size follows from N, k,
E and the shapes alone):

1. ``_align_kernel`` (one program) groups the N * k (token, slot) pairs by expert, as
   vLLM's moe_align_block_size does: it counts each expert's pairs (an atomic add, whose
   old value is the pair's rank within its expert), lays the experts' pairs out one after
   another in blocks of BLOCK_M rows (an expert with c pairs takes ceil(c / BLOCK_M)
   blocks, its last one padded), and records each block's expert. At most
   ``N * k // BLOCK_M + min(N * k, E)`` blocks can be used; the unused ones are marked -1.
2. ``_gate_up_kernel``, grid (blocks, I / BLOCK_N): a program streams BLOCK_N rows of one
   expert's gate and up weights through all of H once and multiplies them by the block's
   (gathered) token rows, then applies SwiGLU. Programs of unused blocks return at once,
   before reading any weight.
3. ``_down_kernel``, grid (blocks, H / BLOCK_N): likewise for the down projection, over I.
4. ``_weighted_sum_kernel``, grid (N, H / BLOCK_H): each token's k expert outputs, weighted.

An expert's weights are read once per BLOCK_M of its pairs: once per batch for every
expert that at most BLOCK_M tokens chose. BLOCK_M is about the pairs an expert gets on
average (16 at decode: GLM-4.5-Air at N = 64 gives an expert 4 on average, Qwen3-Next 1.3),
since blocks sized for the worst case (all tokens on one expert) made the common case
slower (fused_moe_config); a rare expert with more than 16 tokens is read once per 16.

Rounding, for a reference to match: the products of x and the weights are accumulated in
fp32; ``silu(gate) * up`` is computed in fp32 from the fp32 gate and up (which are never
rounded) and rounded once to x.dtype (the intermediate, as vLLM keeps it); the down
projection of that rounded intermediate is accumulated in fp32 and stays fp32; the k
weighted expert outputs of a token (each the fp32 product of its ``topk_weights`` entry
and the fp32 down projection) are summed in fp32, in a fixed order, and the sum is
rounded once to x.dtype. The result does not depend on how the pairs were grouped (a row
of a matrix product does not depend on the other rows of its block, and each pair's
output is summed from its own slot), so it is deterministic although the grouping's order
within an expert is not.

FP8 weights (``gate_up_scale``, ``down_scale``: DeepSeek-V3's float8_e4m3fn experts, one
fp32 scale per ``scale_block`` = (bn, bk) block, 128 x 128 there) are read as FP8 bytes,
half of bf16's, plus the scales. Inside the K loops each weight tile is converted to fp32,
multiplied by its blocks' scales and rounded once to x.dtype (a no-op for fp32 x); from
there on everything is as above, so the result is the x.dtype path's on the weights
dequantized that way, ``(w.float() * scale).to(x.dtype)``. The K tiles are cut to a power
of two that divides bk, so a tile row needs one scale (its row's block, looked up per row
since the tile's rows may span two row blocks, as the gate and up rows do where bn does not
divide I); where bk has no such divisor of 16 or more, each element looks up its own.

An expert id outside [0, E) (say -1 for an expert held by another rank) contributes
nothing; ids are not otherwise checked, since that would wait for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_shape, check_tensor
from ._shared import dequantize_tile, scale_tiles

__all__ = ["fused_moe", "fused_moe_config"]

# Decode batches up to this many tokens get a block that holds them all (see the docstring).
MAX_BLOCK_M = 64
# Shared memory for the tiles in flight (Hopper has 227 KB a block), as in gemv.
SHARED_BYTES = 200 * 1024


@triton.jit
def _align_kernel(
    ids_ptr,  # [P] expert of each (token, slot) pair; P = N * k, pair p = token * k + slot
    work_ptr,  # int32 scratch: [E] counts, [E] each expert's first block, [P] ranks
    block_expert_ptr,  # [BLOCKS] out: the expert of each block, -1 where unused
    block_pairs_ptr,  # [BLOCKS * BLOCK_M] out: the pair of each block row, P where padding
    P,
    E,
    BLOCKS,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,  # pairs (and output entries) per step
    BLOCK_E: tl.constexpr,  # experts per step
):
    """Groups the pairs by expert; one program, its phases separated by barriers.

    The phases pass data through global memory between threads of this one program: a
    barrier orders a block's memory accesses, and the ``.cg`` loads read L2, where the
    atomics happen, rather than the SM's L1.
    """
    counts_ptr = work_ptr
    first_ptr = work_ptr + E
    rank_ptr = work_ptr + 2 * E
    re = tl.arange(0, BLOCK_E)
    rp = tl.arange(0, BLOCK_P)

    # 0: zero the counts; every block unused and every row padding until filled in.
    for e0 in range(0, E, BLOCK_E):
        tl.store(counts_ptr + e0 + re, tl.zeros([BLOCK_E], tl.int32), mask=e0 + re < E)
    for b0 in range(0, BLOCKS, BLOCK_P):
        unused = tl.full([BLOCK_P], -1, tl.int32)
        tl.store(block_expert_ptr + b0 + rp, unused, mask=b0 + rp < BLOCKS)
    for r0 in range(0, BLOCKS * BLOCK_M, BLOCK_P):
        padding = tl.full([BLOCK_P], 0, tl.int32) + P
        tl.store(block_pairs_ptr + r0 + rp, padding, mask=r0 + rp < BLOCKS * BLOCK_M)
    tl.debug_barrier()

    # 1: count each expert's pairs; the count before a pair's add is its rank (the order
    # among one expert's pairs is whatever the atomics gave, which changes no result).
    for p0 in range(0, P, BLOCK_P):
        in_range = p0 + rp < P
        e = tl.load(ids_ptr + p0 + rp, mask=in_range, other=-1)
        ok = in_range & (e >= 0) & (e < E)  # in the ids' own dtype: no int64 id wraps
        e = e.to(tl.int32)
        rank = tl.atomic_add(
            counts_ptr + e, tl.full([BLOCK_P], 1, tl.int32), mask=ok, sem="relaxed"
        )
        tl.store(rank_ptr + p0 + rp, rank, mask=ok)
    tl.debug_barrier()

    # 2: each expert's first block: the exclusive prefix sum of ceil(count / BLOCK_M).
    done = 0
    for e0 in range(0, E, BLOCK_E):
        c = tl.load(counts_ptr + e0 + re, mask=e0 + re < E, other=0, cache_modifier=".cg")
        blocks = (c + BLOCK_M - 1) // BLOCK_M
        tl.store(first_ptr + e0 + re, done + tl.cumsum(blocks, 0) - blocks, mask=e0 + re < E)
        done += tl.sum(blocks, 0)
    tl.debug_barrier()

    # 3: place each pair in its expert's blocks; a block's first row names its expert.
    for p0 in range(0, P, BLOCK_P):
        in_range = p0 + rp < P
        e = tl.load(ids_ptr + p0 + rp, mask=in_range, other=-1)
        ok = in_range & (e >= 0) & (e < E)  # in the ids' own dtype: no int64 id wraps
        e = e.to(tl.int32)
        rank = tl.load(rank_ptr + p0 + rp, mask=ok, other=0, cache_modifier=".cg")
        first = tl.load(first_ptr + e, mask=ok, other=0, cache_modifier=".cg")
        tl.store(block_pairs_ptr + first * BLOCK_M + rank, p0 + rp, mask=ok)
        tl.store(block_expert_ptr + first + rank // BLOCK_M, e, mask=ok & (rank % BLOCK_M == 0))


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [N, H] tokens
    w_ptr,  # [E, 2I, H] gate rows, then up rows, per expert
    block_expert_ptr,  # [BLOCKS]
    block_pairs_ptr,  # [BLOCKS * BLOCK_M]
    inter_ptr,  # [P, I] out: silu(gate) * up of each pair, dtype of x
    scale_ptr,  # [E, ceil(2I / SCALE_N), ceil(H / SCALE_K)] fp32 where FP8, else unread
    P,
    TOPK,
    H,
    INTER,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of I (rows of gate and of up) per program
    BLOCK_K: tl.constexpr,  # tile of H
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored)
    FP8: tl.constexpr,  # w is float8_e4m3fn with a scale per SCALE_N x SCALE_K block
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_TILE: tl.constexpr,  # SCALE_K % BLOCK_K == 0: one scale column per K tile
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # beyond the blocks this routing uses: read no weight
        return
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    pairs = tl.load(block_pairs_ptr + block * BLOCK_M + rm)
    m_ok = pairs < P
    n_ok = rn < INTER
    x_ptrs = x_ptr + (pairs // TOPK).to(tl.int64)[:, None] * H + rk[None, :]
    g_ptrs = (
        w_ptr + expert.to(tl.int64) * 2 * INTER * H + rn.to(tl.int64)[:, None] * H + rk[None, :]
    )
    u_ptrs = g_ptrs + INTER * H
    if FP8:  # each weight row's row of scales, for the gate and the up rows
        scale_cols = tl.cdiv(H, SCALE_K)
        scale_rows = tl.cdiv(2 * INTER, SCALE_N)
        sg_ptrs = scale_ptr + (expert.to(tl.int64) * scale_rows + rn // SCALE_N) * scale_cols
        su_ptrs = (
            scale_ptr + (expert.to(tl.int64) * scale_rows + (INTER + rn) // SCALE_N) * scale_cols
        )
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, H, BLOCK_K):
        k_ok = (k + rk) < H
        xs = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            wg = dequantize_tile(wg, sg_ptrs, k, rk, n_ok, k_ok, SCALE_K, SCALE_TILE).to(xs.dtype)
            wu = dequantize_tile(wu, su_ptrs, k, rk, n_ok, k_ok, SCALE_K, SCALE_TILE).to(xs.dtype)
        gate += tl.dot(xs, tl.trans(wg), input_precision=DOT_PRECISION)
        up += tl.dot(xs, tl.trans(wu), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = gate * tl.sigmoid(gate) * up
    out_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * INTER + rn[None, :]
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,  # [P, I] silu(gate) * up of each pair
    w_ptr,  # [E, H, I]
    block_expert_ptr,  # [BLOCKS]
    block_pairs_ptr,  # [BLOCKS * BLOCK_M]
    part_ptr,  # [P, H] fp32 out: each pair's expert output, not yet weighted
    scale_ptr,  # [E, ceil(H / SCALE_N), ceil(I / SCALE_K)] fp32 where FP8, else unread
    P,
    H,
    INTER,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows of H per program
    BLOCK_K: tl.constexpr,  # tile of I
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_TILE: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    pairs = tl.load(block_pairs_ptr + block * BLOCK_M + rm)
    m_ok = pairs < P
    n_ok = rn < H
    a_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * INTER + rk[None, :]
    w_ptrs = (
        w_ptr + expert.to(tl.int64) * H * INTER + rn.to(tl.int64)[:, None] * INTER + rk[None, :]
    )
    if FP8:
        scale_cols = tl.cdiv(INTER, SCALE_K)
        scale_rows = tl.cdiv(H, SCALE_N)
        s_ptrs = scale_ptr + (expert.to(tl.int64) * scale_rows + rn // SCALE_N) * scale_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, INTER, BLOCK_K):
        k_ok = (k + rk) < INTER
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            w = dequantize_tile(w, s_ptrs, k, rk, n_ok, k_ok, SCALE_K, SCALE_TILE).to(a.dtype)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = part_ptr + pairs.to(tl.int64)[:, None] * H + rn[None, :]
    tl.store(out_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _weighted_sum_kernel(
    part_ptr,  # [P, H] fp32 expert outputs, pair p = token * k + slot
    ids_ptr,  # [N, k]
    weights_ptr,  # [N, k] fp32
    out_ptr,  # [N, H] out, dtype of x
    E,
    H,
    TOPK,
    BLOCK_SLOTS: tl.constexpr,  # >= k
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, BLOCK_SLOTS)
    pairs = token * TOPK + slots
    slot_ok = slots < TOPK
    expert = tl.load(ids_ptr + pairs, mask=slot_ok, other=-1)
    weight = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    # A pair whose expert is out of range was never computed: leave its row unread.
    ok = slot_ok & (expert >= 0) & (expert < E)
    col_ok = cols < H
    # All k rows in one load (a loop over the slots would wait for each load in turn).
    part = tl.load(
        part_ptr + pairs[:, None] * H + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
    )
    acc = tl.sum(weight[:, None] * part, axis=0)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def fused_moe_config(
    n: int,
    topk: int,
    experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    scale_k: int | None = None,
) -> dict[str, int | str | bool]:
    """Launch constants; BLOCK_M is shared by the alignment and both products.

    dtype is x's. ``scale_k``: the columns of an FP8 scale block, if the weights are FP8;
    the K tiles are then cut to divide it (SCALE_TILE: one scale a tile row), unless its
    largest power-of-two divisor is below 16 (tl.dot's least), where each column of a
    tile looks up its own scale.

    Measured on an H200 (bf16, each in a CUDA graph, GLM-4.5-Air's and Qwen3-Next's
    shapes at N = 1 and 64, random routing; bench/bench_moe_kernel.py): BLOCK_M is the
    number of pairs an expert gets on average, at least 16 (tl.dot's least): at N = 64,
    16-row blocks took 1011 us (GLM) and 559 us (Qwen) where 64-row blocks, one per expert
    whatever its count, took 1124 and 723 (four times the x tiles and the products, for
    4 and 1.3 pairs an expert). The tiles of I and H are narrow (32, 64 rows) so that one
    token's 8-10 experts already make hundreds of programs to spread the weight stream over
    the SMs; wider tiles or other K tiles and stages were within 3%.
    """
    pairs = max(n * topk, 1)
    per_expert = pairs / min(pairs, max(experts, 1))
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(int(per_expert))))
    itemsize = torch.finfo(dtype).bits // 8

    def k_tile(k: int, rows: int, stages: int) -> int:
        """128 (64 for fp32), halved until the stages' x and w tiles fit in shared memory."""
        block_k = min(128 if itemsize < 4 else 64, max(16, triton.next_power_of_2(k)))
        while block_k > 16 and stages * (block_m + rows) * block_k * itemsize > SHARED_BYTES:
            block_k //= 2
        return block_k

    block_n1 = min(32, max(16, triton.next_power_of_2(inter)))
    block_n2 = min(64, max(16, triton.next_power_of_2(hidden)))
    block_k1, block_k2 = k_tile(hidden, 2 * block_n1, 4), k_tile(inter, block_n2, 3)
    scale_tile = False
    if scale_k is not None:
        (block_k1, scale_tile), (block_k2, _) = (
            scale_tiles(b, scale_k) for b in (block_k1, block_k2)
        )
    return {
        "BLOCK_M": block_m,
        "BLOCK_N1": block_n1,
        "BLOCK_K1": block_k1,
        "STAGES1": 4,
        "WARPS1": 4,
        "BLOCK_N2": block_n2,
        "BLOCK_K2": block_k2,
        "STAGES2": 3,
        "WARPS2": 4,
        "BLOCK_H": min(256, max(16, triton.next_power_of_2(hidden))),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "SCALE_TILE": scale_tile,
    }


def check_fused_moe_args(
    x: object,
    w_gate_up: object,
    w_down: object,
    topk_ids: object,
    topk_weights: object,
    gate_up_scale: object = None,
    down_scale: object = None,
    scale_block: object = (128, 128),
) -> None:
    fp8 = gate_up_scale is not None or down_scale is not None
    if fp8 and (gate_up_scale is None or down_scale is None):
        raise ValueError("gate_up_scale and down_scale must be given together (FP8 weights)")
    check_tensor("x", x, 2, FLOAT_DTYPES)
    w_dtypes = (torch.float8_e4m3fn,) if fp8 else FLOAT_DTYPES
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not fp8 and isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{name} is float8_e4m3fn: pass gate_up_scale and down_scale")
        check_tensor(name, w, 3, w_dtypes)
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    if fp8:
        check_tensor("gate_up_scale", gate_up_scale, 3, (torch.float32,))
        check_tensor("down_scale", down_scale, 3, (torch.float32,))
        check_same_device(x=x, gate_up_scale=gate_up_scale, down_scale=down_scale)
    else:
        check_same_dtype(x=x, w_gate_up=w_gate_up, w_down=w_down)
    check_same_device(
        x=x, w_gate_up=w_gate_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights
    )
    n, hidden = x.shape
    experts, two_i, h_gate_up = w_gate_up.shape
    if two_i % 2:
        raise ValueError(
            f"w_gate_up [E, 2I, H] must hold gate and up rows (an even count), got {two_i}"
        )
    if h_gate_up != hidden:
        raise ValueError(
            f"x [N, H] and w_gate_up [E, 2I, H] must share H, got {tuple(x.shape)} and "
            f"{tuple(w_gate_up.shape)}"
        )
    check_shape("w_down", w_down, (experts, hidden, two_i // 2))
    if topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise ValueError(
            f"topk_ids must have shape [N, k] with N = {n} and k >= 1, got {tuple(topk_ids.shape)}"
        )
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if fp8:
        if (
            not isinstance(scale_block, tuple | list)
            or len(scale_block) != 2
            or not all(isinstance(b, int) and b > 0 for b in scale_block)
        ):
            raise ValueError(
                f"scale_block must be two positive ints (rows, columns), got {scale_block!r}"
            )
        bn, bk = scale_block
        grid = (experts, -(-two_i // bn), -(-hidden // bk))
        check_shape("gate_up_scale", gate_up_scale, grid)
        check_shape("down_scale", down_scale, (experts, -(-hidden // bn), -(-(two_i // 2) // bk)))


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token; returns [N, H].

    x [N, H]; w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows); w_down
    [E, H, I]; topk_ids [N, k] int32 or int64; topk_weights [N, k] float32. ``out[n] =
    sum_j topk_weights[n, j] * w_down[e] @ (silu(gate_e @ x[n]) * (up_e @ x[n]))`` with
    ``e = topk_ids[n, j]``, in x.dtype (rounding: see the module docstring).

    FP8 weights (DeepSeek-V3's): w_gate_up and w_down float8_e4m3fn with float32
    ``gate_up_scale`` [E, ceil(2I / bn), ceil(H / bk)] and ``down_scale`` [E, ceil(H / bn),
    ceil(I / bk)], (bn, bk) = ``scale_block`` (rows, columns); the weight is
    ``w[e, r, c] * scale[e, r // bn, c // bk]`` (a checkpoint's ``weight_scale_inv``).
    Both scales or neither; x stays float16, bfloat16 or float32.
    """
    check_fused_moe_args(
        x, w_gate_up, w_down, topk_ids, topk_weights, gate_up_scale, down_scale, scale_block
    )
    fp8 = gate_up_scale is not None
    n, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter, topk = two_i // 2, topk_ids.shape[1]
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if n == 0 or hidden == 0:
        return out
    if inter == 0 or experts == 0:
        return out.zero_()
    scale_n, scale_k = scale_block if fp8 else (1, 1)
    cfg = fused_moe_config(n, topk, experts, hidden, inter, x.dtype, scale_k if fp8 else None)
    block_m, precision = cfg["BLOCK_M"], cfg["DOT_PRECISION"]
    pairs = n * topk
    # Used blocks: sum_e ceil(c_e / BLOCK_M) <= sum_e floor(c_e / BLOCK_M) + #{e: c_e > 0}.
    blocks = pairs // block_m + min(pairs, experts)
    work = torch.empty(
        2 * experts + pairs + blocks * (1 + block_m), dtype=torch.int32, device=x.device
    )
    block_expert = work[2 * experts + pairs :][:blocks]
    block_pairs = work[2 * experts + pairs + blocks :]
    inter_rows = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    parts = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)

    _align_kernel[(1,)](
        topk_ids,
        work,
        block_expert,
        block_pairs,
        pairs,
        experts,
        blocks,
        BLOCK_M=block_m,
        BLOCK_P=min(1024, triton.next_power_of_2(max(pairs, blocks))),
        BLOCK_E=min(1024, triton.next_power_of_2(experts)),
        num_warps=4,
    )
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg["BLOCK_N1"]))](
        x,
        w_gate_up,
        block_expert,
        block_pairs,
        inter_rows,
        gate_up_scale if fp8 else x,  # unread without FP8
        pairs,
        topk,
        hidden,
        inter,
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N1"],
        BLOCK_K=cfg["BLOCK_K1"],
        DOT_PRECISION=precision,
        FP8=fp8,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        SCALE_TILE=cfg["SCALE_TILE"],
        num_warps=cfg["WARPS1"],
        num_stages=cfg["STAGES1"],
    )
    _down_kernel[(blocks, triton.cdiv(hidden, cfg["BLOCK_N2"]))](
        inter_rows,
        w_down,
        block_expert,
        block_pairs,
        parts,
        down_scale if fp8 else x,
        pairs,
        hidden,
        inter,
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N2"],
        BLOCK_K=cfg["BLOCK_K2"],
        DOT_PRECISION=precision,
        FP8=fp8,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        SCALE_TILE=cfg["SCALE_TILE"],
        num_warps=cfg["WARPS2"],
        num_stages=cfg["STAGES2"],
    )
    _weighted_sum_kernel[(n, triton.cdiv(hidden, cfg["BLOCK_H"]))](
        parts,
        topk_ids,
        topk_weights,
        out,
        experts,
        hidden,
        topk,
        BLOCK_SLOTS=triton.next_power_of_2(topk),
        BLOCK_H=cfg["BLOCK_H"],
        num_warps=4,
    )
    return out
