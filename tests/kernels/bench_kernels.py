"""Benchmark the kernels against eager torch at MiMo-7B MTP shapes (needs a GPU).

Run ``python tests/kernels/bench_kernels.py [--sweep]``. Prints, per op and batch, the
Triton and torch times (``triton.testing.do_bench``, median) and the Triton kernel's
effective bandwidth; ``--sweep`` adds a launch-configuration sweep of paged_attention.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from mtpdraft.kernels import (
    mtp_input_norms,
    paged_attention,
    rms_norm,
    rope_write_kv,
    select_drafts,
    swiglu,
)
from mtpdraft.kernels.paged_attention import _paged_attention

H, HQ, HKV, D, INTER, VOCAB, PAGE = 4096, 32, 8, 128, 11008, 151680, 16
DT = torch.bfloat16


def _us(fn: Callable[[], object]) -> float:
    """GPU time of one call, launched from a CUDA graph (as the service runs it)."""
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    except Exception as exc:  # not capturable: say so, and time it eagerly
        print(f"  (no CUDA graph: {type(exc).__name__}: {exc})"[:120])
        return _eager_us(fn)


def _eager_us(fn: Callable[[], object]) -> float:
    """Time of one eager call, Python launch overhead included."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _row(
    name: str, fn_triton: Callable[[], object], fn_torch: Callable[[], object], nbytes: int
) -> None:
    """One line: graph times, torch/triton speed-up, Triton's bandwidth and eager time."""
    t_triton, t_torch, t_eager = _us(fn_triton), _us(fn_torch), _eager_us(fn_triton)
    gbs = nbytes / (t_triton * 1e-6) / 1e9
    print(
        f"{name:<34} triton {t_triton:7.1f} us  torch {t_torch:7.1f} us  "
        f"x{t_torch / t_triton:5.2f}  {gbs:6.0f} GB/s  (eager triton {t_eager:6.1f} us)"
    )


def _paged_setup(batch: int, ctx: int) -> tuple[torch.Tensor, ...]:
    blocks = triton.cdiv(ctx, PAGE)
    k_cache = torch.randn(batch * blocks, PAGE, HKV, D, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DT)
    seq_ids = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq_ids, lens


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_ids: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Eager baseline: gather the pages, then SDPA with a length mask and GQA."""
    n = q.shape[0]
    t = tables[seq_ids.long()].long()  # [N, blocks]
    k = k_cache[t].view(n, -1, HKV, D).transpose(1, 2)  # [N, Hkv, L, D]
    v = v_cache[t].view(n, -1, HKV, D).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


def select_drafts_torch(
    logits: torch.Tensor, bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    if bitmask is not None:
        tok = torch.arange(x.shape[1], device=x.device)
        bits = (bitmask[:, tok // 32] >> (tok % 32)) & 1
        x = x.masked_fill(bits == 0, float("-inf"))
    probs, tokens = x.softmax(dim=-1).max(dim=-1)
    return tokens, probs


def bench_paged_attention(sweep: bool) -> None:
    scale = D**-0.5
    for batch in (1, 8, 32, 64):
        for ctx in (512, 2048, 8192):
            if batch == 8 and ctx != 2048:
                continue
            args = _paged_setup(batch, ctx)
            torch.testing.assert_close(
                paged_attention(*args, scale).float(),
                paged_attention_torch(*args, scale).float(),
                atol=2e-2,
                rtol=2e-2,
            )
            nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * batch * HQ * D * 2
            _row(
                f"paged_attention b={batch} ctx={ctx}",
                lambda args=args: paged_attention(*args, scale),
                lambda args=args: paged_attention_torch(*args, scale),
                nbytes,
            )
    if not sweep:
        return
    print("paged_attention sweep (block_n, warps, stages, splits): fastest first")
    for batch, ctx in ((32, 2048), (1, 2048)):  # the last one (batch 1) picks `best`
        args = _paged_setup(batch, ctx)
        results = []
        for block_n, warps, stages in itertools.product((64, 128), (4, 8), (2, 3)):
            cfg = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            results.append((_try(args, scale, cfg), block_n, warps, stages))
        results.sort()
        print(f"  b={batch} ctx={ctx}: " + ", ".join(f"{r[1:]} {r[0]:.1f}" for r in results[:6]))
    best = {"block_n": results[0][1], "num_warps": results[0][2], "num_stages": results[0][3]}
    for batch, ctx in ((1, 2048), (1, 8192), (8, 2048), (16, 2048)):
        args = _paged_setup(batch, ctx)
        times = {sp: _try(args, scale, {**best, "num_splits": sp}) for sp in (1, 2, 4, 8, 16, 32)}
        print(
            f"  b={batch} ctx={ctx} splits: " + ", ".join(f"{k}:{v:.1f}" for k, v in times.items())
        )


def _try(args: tuple[torch.Tensor, ...], scale: float, cfg: dict[str, int | None]) -> float:
    try:
        return _us(lambda: _paged_attention(*args, scale, **cfg))
    except Exception as exc:  # e.g. out of shared memory
        print(f"  {cfg}: {type(exc).__name__}")
        return float("inf")


def bench_select_drafts() -> None:
    for batch in (1, 8, 32, 64):
        logits = torch.randn(batch, VOCAB, device="cuda", dtype=DT)
        words = triton.cdiv(VOCAB, 32)
        bitmask = torch.randint(-(2**31), 2**31, (batch, words), device="cuda").int()
        for mask in (None, bitmask):
            masking = "masked" if mask is not None else "no mask"
            nbytes = batch * VOCAB * 2 + (0 if mask is None else mask.numel() * 4)
            _row(
                f"select_drafts b={batch} {masking}",
                lambda logits=logits, mask=mask: select_drafts(logits, mask),
                lambda logits=logits, mask=mask: select_drafts_torch(logits, mask),
                nbytes,
            )


def bench_small_ops(batch: int) -> None:
    x = torch.randn(batch, H, device="cuda", dtype=DT)
    w = torch.rand(H, device="cuda", dtype=DT)
    pos = torch.arange(batch, device="cuda")

    def rms_torch(x: torch.Tensor = x) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(DT)

    nbytes = x.numel() * 4
    _row(f"rms_norm b={batch}", lambda: rms_norm(x, w, 1e-6), rms_torch, nbytes)
    _row(
        f"mtp_input_norms b={batch}",
        lambda: mtp_input_norms(x, x, w, w, pos, 1e-6, embed_first=False),
        lambda: torch.cat([rms_torch(x), rms_torch(x)], dim=-1),
        2 * nbytes,
    )
    gu = torch.randn(batch, 2 * INTER, device="cuda", dtype=DT)
    _row(
        f"swiglu b={batch}",
        lambda: swiglu(gu),
        lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:],
        gu.numel() * 3,
    )
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DT)
    k = torch.randn(batch, HKV, D, device="cuda", dtype=DT)
    cos_sin = torch.randn(8192, D, device="cuda")
    kc = torch.zeros(1024, PAGE, HKV, D, device="cuda", dtype=DT)

    def rope_torch() -> None:
        cos, sin = cos_sin[pos].chunk(2, dim=-1)
        cos, sin = cos[:, None].to(DT), sin[:, None].to(DT)
        for t in (q, k):
            t1, t2 = t[..., : D // 2], t[..., D // 2 :]
            t.copy_(torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1))
        kc.view(-1, HKV, D)[pos] = k
        kc.view(-1, HKV, D)[pos] = k

    _row(
        f"rope_write_kv b={batch}",
        lambda: rope_write_kv(q, k, k, pos, cos_sin, kc, kc, pos),
        rope_torch,
        (q.numel() * 2 + k.numel() * 4) * 2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="sweep paged_attention configs")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for batch in (1, 32):
        bench_small_ops(batch)
    bench_select_drafts()
    bench_paged_attention(args.sweep)


if __name__ == "__main__":
    main()
