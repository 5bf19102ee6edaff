"""The MTP forward's ops in plain torch: the CPU path, and the reference for kernels."""

from __future__ import annotations

import torch

# Bound on one attention score tile (query rows x context x heads) so that a long
# prefill does not materialize a score tensor of gigabytes: 2**26 fp32 = 256 MiB.
_MAX_SCORE_ELEMENTS = 1 << 26


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim, scaled by w (or by 1 + w: zero-centred weights)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = 1.0 + weight.float() if unit_offset else weight.float()
    return (xf * scale).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of the first 2 * cos.shape[-1] dims of x [N, heads, D]."""
    half = cos.shape[-1]
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotation of x [N, heads, P]: pair (x[2i], x[2i + 1]) turns by angle i."""
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each query row attends the first context_lens[i] KV rows of its sequence (GQA).

    V may be narrower than q and K (MLA's latent: K = [c, k_pe], V = c).
    """
    n, heads, dim = q.shape
    kv_heads, block_size, v_dim = k_cache.shape[2], k_cache.shape[1], v_cache.shape[-1]
    out = q.new_empty(n, heads, v_dim)
    seq_list = seq_ids.tolist()
    lens = context_lens.tolist()
    start = 0
    while start < n:  # one contiguous run of rows of the same sequence at a time
        end = start
        while end < n and seq_list[end] == seq_list[start]:
            end += 1
        ctx = max(lens[start:end])
        blocks = block_tables[seq_list[start], : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, kv_heads, v_dim)[:ctx].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        step = max(1, _MAX_SCORE_ELEMENTS // (ctx * heads))
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale
            limit = torch.tensor(lens[lo:hi], device=q.device)[:, None]
            masked = torch.arange(ctx, device=q.device)[None, :] >= limit
            scores.masked_fill_(masked[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start = end
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Routed experts' SwiGLU MLPs [E, 2I, H] / [E, H, I], summed by the routing weights.

    Each expert runs on the rows routed to it (the host looks at the routing: this
    path is not for CUDA graphs); its activation is rounded to x's dtype, the
    weighted sum is kept in fp32 and rounded once.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        act = swiglu(torch.nn.functional.linear(x[rows], gate_up[e]))
        routed = torch.nn.functional.linear(act, down[e]).float()
        out.index_add_(0, rows, weights[rows, slots, None].float() * routed)
    return out.to(x.dtype)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] packed int32 (xgrammar layout) -> [N, vocab_size] bool; uncovered tokens False."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(bitmask.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def masked(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """The logits, -inf where the bitmask (if any) allows no token."""
    if bitmask is None:
        return logits
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))


def select_drafts(
    logits: torch.Tensor, bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked argmax of logits [N, V] and its softmax probability over allowed tokens."""
    logits = masked(logits.float(), bitmask)
    best, tokens = logits.max(dim=-1)
    probs = 1.0 / torch.exp(logits - best[:, None]).sum(dim=-1)
    return tokens, probs
