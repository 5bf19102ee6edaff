"""A mixture-of-experts router's choice: each row's top-k experts and their weights, from
the router's logits, in one program per row.

Two scorings, as the published modeling code and vLLM route:
- softmax (Qwen3-Next): softmax over the experts in fp32, the k most probable, their
  probabilities renormalized to sum to one when asked;
- sigmoid (GLM-4.5, DeepSeek-V3): sigmoid scores; an expert is chosen by its score
  plus a correction bias, among the ``topk_group`` of ``n_group`` groups whose two
  best such values sum highest; it weighs its plain score, renormalized when asked.
Both are then scaled by ``routed_scaling_factor``. Ties go to the lower expert index.

A shared expert stored as expert E (one past the routed ones) can get a last column: id E,
weight one, or the sigmoid of the logits' column E (Qwen's shared expert gate, computed
by the same matrix product as the router's logits). Unfused, this step is a dozen small
torch kernels (softmax, the sort and gather of topk, a sum, a divide, a concatenation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_rows, check_same_device, check_tensor

__all__ = ["moe_route"]

SHARED = {None: 0, "one": 1, "gate": 2}


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [N, >= E] router logits (column E: the shared expert's gate, if SHARED == 2)
    bias_ptr,  # [E] fp32 correction bias (SIGMOID only)
    ids_ptr,  # [N, K + (SHARED > 0)] int32
    w_ptr,  # [N, K + (SHARED > 0)] fp32
    E,  # routed experts
    logits_row,  # row stride of logits
    group_size,  # E // N_GROUP
    scale,  # routed_scaling_factor
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    SHARED: tl.constexpr,  # 0: no shared column; 1: weight one; 2: sigmoid of column E
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    logits = tl.load(logits_ptr + row * logits_row + cols, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        score = tl.sigmoid(logits)
        bias = tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, score + bias, float("-inf"))
        if N_GROUP > 1:
            # Each group's value: the sum of its two best choices (its one, if alone).
            group = cols // group_size
            slots = tl.arange(0, BLOCK_G)
            group_value = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                inside = valid & (group == g)
                first = tl.max(tl.where(inside, choice, float("-inf")), axis=0)
                at = tl.min(tl.where(inside & (choice == first), cols, BLOCK_E), axis=0)
                second = tl.max(tl.where(inside & (cols != at), choice, float("-inf")), axis=0)
                second = tl.where(group_size > 1, second, 0.0)
                group_value = tl.where(slots == g, first + second, group_value)
            kept = tl.zeros((BLOCK_G,), tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(group_value, axis=0)
                at = tl.min(tl.where(group_value == best, slots, BLOCK_G), axis=0)
                kept = tl.where(slots == at, 1, kept)
                group_value = tl.where(slots == at, float("-inf"), group_value)
            keep = tl.zeros((BLOCK_E,), tl.int32)
            for g in tl.static_range(N_GROUP):
                group_kept = tl.max(tl.where(slots == g, kept, 0), axis=0)
                keep = tl.where(group == g, group_kept, keep)
            choice = tl.where(keep > 0, choice, float("-inf"))
    else:
        logits = tl.where(valid, logits, float("-inf"))
        exp = tl.exp(logits - tl.max(logits, axis=0))
        score = exp / tl.sum(exp, axis=0)
        choice = tl.where(valid, score, float("-inf"))
    picks = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    for j in tl.static_range(K):
        best = tl.max(choice, axis=0)
        at = tl.minimum(tl.min(tl.where(choice == best, cols, BLOCK_E), axis=0), E - 1)
        ids = tl.where(picks == j, at, ids)
        weights = tl.where(picks == j, tl.sum(tl.where(cols == at, score, 0.0), axis=0), weights)
        choice = tl.where(cols == at, float("-inf"), choice)
    if NORM:
        total = tl.sum(weights, axis=0)
        if SIGMOID:
            total += 1e-20
        weights = weights / total
    weights = weights * scale
    width = K + (SHARED > 0)
    out = row * width + picks
    tl.store(ids_ptr + out, ids, mask=picks < K)
    tl.store(w_ptr + out, weights, mask=picks < K)
    if SHARED > 0:
        shared = 1.0
        if SHARED == 2:
            shared = tl.sigmoid(tl.load(logits_ptr + row * logits_row + E).to(tl.float32))
        tl.store(ids_ptr + row * width + K, E)
        tl.store(w_ptr + row * width + K, shared)


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    num_experts: int,
    top_k: int,
    scoring: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    shared: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k'] int32, weights [N, k'] fp32) from router logits [N, L] (rows may
    be strided); k' = top_k, plus one for a ``shared`` column ("one": weight one; "gate":
    the sigmoid of logits[:, num_experts], so L > num_experts). ``bias`` [num_experts]
    fp32: the correction bias of sigmoid scoring (None: zeros)."""
    check_rows("logits", logits, 2, (torch.float16, torch.bfloat16, torch.float32))
    n, width = logits.shape
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be softmax or sigmoid, got {scoring!r}")
    if shared not in SHARED:
        raise ValueError(f"shared must be None, 'one' or 'gate', got {shared!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
    if width < num_experts + (shared == "gate"):
        raise ValueError(
            f"logits need {num_experts + (shared == 'gate')} columns, got {tuple(logits.shape)}"
        )
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"n_group ({n_group}) must divide num_experts ({num_experts}) and topk_group "
            f"({topk_group}) be in [1, n_group]"
        )
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k ({top_k}) exceeds the experts of topk_group groups")
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.float32,))
        if bias.shape[0] != num_experts:
            raise ValueError(f"bias must have {num_experts} values, got {tuple(bias.shape)}")
        check_same_device(logits=logits, bias=bias)
    elif scoring == "sigmoid":
        bias = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    k_out = top_k + (shared is not None)
    ids = torch.empty((n, k_out), dtype=torch.int32, device=logits.device)
    weights = torch.empty((n, k_out), dtype=torch.float32, device=logits.device)
    if n == 0:
        return ids, weights
    block_e = triton.next_power_of_2(num_experts)
    _moe_route_kernel[(n,)](
        logits,
        logits if bias is None else bias,  # softmax scoring reads no bias
        ids,
        weights,
        num_experts,
        logits.stride(0),
        num_experts // n_group,
        float(routed_scaling_factor),
        K=top_k,
        SIGMOID=scoring == "sigmoid",
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        NORM=norm_topk_prob,
        SHARED=SHARED[shared],
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(n_group),
        num_warps=min(max(block_e // 256, 1), 8),
    )
    return ids, weights
