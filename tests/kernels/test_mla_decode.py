"""mla_decode against per-row gathered dot products in float64, and against non-absorbed MLA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from mtpdraft.kernels import mla_decode


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float64 absorbed attention over each row's gathered cache rows: [N, H, R]."""
    n, h, r = q_latent.shape
    width = latent.shape[2]
    out = torch.zeros(n, h, r, dtype=torch.float64, device=q_latent.device)
    for i in range(n):
        length = int(context_lens[i])
        if length == 0:
            continue
        blocks = block_tables[int(seq_ids[i])].long()
        rows = latent[blocks].reshape(-1, width)[:length].double()  # [L, R + P]
        c, k_pe = rows[:, :r], rows[:, r:]
        scores = (q_latent[i].double() @ c.T + q_pe[i].double() @ k_pe.T) * scale  # [H, L]
        out[i] = scores.softmax(dim=-1) @ c
    return out


@dataclass
class PagedLatent:
    latent: torch.Tensor  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor  # [S, max_blocks] int32


def make_paged_latent(
    seq_lens: list[int],
    block_size: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator | None = None,
) -> PagedLatent:
    """A cache holding sequences of ``seq_lens`` rows in shuffled blocks (plus spare blocks)."""
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    seed = int(torch.randint(2**31, (1,), generator=gen))
    dev_gen = torch.Generator(device).manual_seed(seed)  # no host-side randn for GPU sizes
    shape = (num_blocks, block_size, width)
    latent = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    return PagedLatent(latent, block_tables.to(device, torch.int32))


def run_both(
    cache: PagedLatent,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    seq_ids: list[int],
    context_lens: list[int],
    **kwargs: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.tensor(seq_ids, dtype=torch.int32, device=q_latent.device)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=q_latent.device)
    scale = (q_latent.shape[-1] + q_pe.shape[-1]) ** -0.5
    args = (q_latent, q_pe, cache.latent, cache.block_tables, seq, ctx, scale)
    return mla_decode(*args, **kwargs), mla_decode_ref(*args)


def randn(*shape: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype):
    return torch.randn(*shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize(
    "h,r,p,block_size",
    [
        (4, 32, 8, 8),  # the small test size
        (20, 32, 8, 4),  # two head blocks, the second partial
        (3, 24, 6, 5),  # widths and block size not powers of two
    ],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(
    h: int,
    r: int,
    p: int,
    block_size: int,
    num_splits: int,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """Rows of several sequences, some queried twice with different context lengths."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(h * r + p)
    seq_lens = [1, 70, 5, 33, 100]
    cache = make_paged_latent(seq_lens, block_size, r + p, dtype, device, gen)
    seq_ids = [3, 0, 4, 2, 1, 4, 3]
    ctx = [33, 1, 100, 5, 70, 61, 17]  # seq 4 and seq 3 twice; context 1 on row 1
    q_latent = randn(len(seq_ids), h, r, gen=gen, device=device, dtype=dtype)
    q_pe = randn(len(seq_ids), h, p, gen=gen, device=device, dtype=dtype)
    out, ref = run_both(cache, q_latent, q_pe, seq_ids, ctx, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q_latent.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [None, 2, 8])
def test_causal_chunk(
    num_splits: int | None, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    """A prefill chunk: consecutive rows of one sequence, each seeing up to itself."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(17)
    r, p, h = 32, 8, 4
    cache = make_paged_latent([40, 12], 16, r + p, dtype, device, gen)
    seq_ids = [0] * 6 + [1] * 3
    ctx = [35 + j for j in range(6)] + [10, 11, 12]
    q_latent = randn(len(seq_ids), h, r, gen=gen, device=device, dtype=dtype)
    q_pe = randn(len(seq_ids), h, p, gen=gen, device=device, dtype=dtype)
    out, ref = run_both(cache, q_latent, q_pe, seq_ids, ctx, num_splits=num_splits)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_matches_non_absorbed_mla(device: torch.device) -> None:
    """W_UV applied to the absorbed output equals MLA with per-head k_nope and v (fp32).

    The non-absorbed form decompresses every cache row per head, k_nope[t, h] = W_UK[h] c[t]
    and v[t, h] = W_UV[h] c[t], and scores q_nope . k_nope + q_pe . k_pe.
    """
    gen = torch.Generator().manual_seed(23)
    h, r, p, nope, dv, block_size = 4, 32, 8, 16, 12, 8
    seq_lens = [29, 9]
    cache = make_paged_latent(seq_lens, block_size, r + p, torch.float32, device, gen)
    w_uk = torch.randn(h, nope, r, generator=gen, dtype=torch.float64) / math.sqrt(r)
    w_uv = torch.randn(h, dv, r, generator=gen, dtype=torch.float64) / math.sqrt(r)
    seq_ids, ctx = [0, 1, 0], [29, 9, 12]
    q_nope = torch.randn(3, h, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(3, h, p, generator=gen, dtype=torch.float64)
    scale = (nope + p) ** -0.5

    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # absorb W_UK into the query
    out_latent = mla_decode(
        q_latent.float().to(device),
        q_pe.float().to(device),
        cache.latent,
        cache.block_tables,
        torch.tensor(seq_ids, dtype=torch.int32, device=device),
        torch.tensor(ctx, dtype=torch.int32, device=device),
        scale,
        num_splits=2,
    )
    out = torch.einsum("nhr,hvr->nhv", out_latent.double().cpu(), w_uv)

    latent, tables = cache.latent.double().cpu(), cache.block_tables.long().cpu()
    for i, (s, length) in enumerate(zip(seq_ids, ctx, strict=True)):
        rows = latent[tables[s]].reshape(-1, r + p)[:length]
        c, k_pe = rows[:, :r], rows[:, r:]
        k_nope = torch.einsum("hdr,lr->lhd", w_uk, c)  # [L, H, nope]
        v = torch.einsum("hvr,lr->lhv", w_uv, c)  # [L, H, dv]
        scores = (torch.einsum("hd,lhd->hl", q_nope[i], k_nope) + q_pe[i] @ k_pe.T) * scale
        expected = torch.einsum("hl,lhv->hv", scores.softmax(dim=-1), v)
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


def test_strided_queries_and_int64_context_lens(device: torch.device) -> None:
    """q_latent as a transposed [H, N, R] bmm output, q_pe a slice of the query projection."""
    gen = torch.Generator().manual_seed(5)
    n, h, r, p, nope = 3, 4, 32, 8, 16
    cache = make_paged_latent([9, 40], 8, r + p, torch.float32, device, gen)
    q_latent = torch.randn(h, n, r, generator=gen).to(device).transpose(0, 1)
    q_full = torch.randn(n, h, nope + p, generator=gen).to(device)
    q_pe = q_full[..., nope:]
    assert not q_latent.is_contiguous() and not q_pe.is_contiguous()
    seq = torch.tensor([1, 0, 1], dtype=torch.int32, device=device)
    ctx = torch.tensor([40, 9, 2], dtype=torch.int64, device=device)
    args = (cache.latent, cache.block_tables, seq)
    out = mla_decode(q_latent, q_pe, *args, ctx, 0.2, num_splits=2)
    ref = mla_decode_ref(q_latent.contiguous(), q_pe.contiguous(), *args, ctx, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_single_key_gives_its_latent(device: torch.device) -> None:
    """Context 1: every head's output is that cache row's c."""
    gen = torch.Generator().manual_seed(2)
    cache = make_paged_latent([1], 4, 40, torch.float32, device, gen)
    q_latent = torch.randn(1, 5, 32, generator=gen).to(device)
    q_pe = torch.randn(1, 5, 8, generator=gen).to(device)
    out, _ = run_both(cache, q_latent, q_pe, [0], [1])
    c = cache.latent[int(cache.block_tables[0, 0]), 0, :32]
    torch.testing.assert_close(out[0], c.expand(5, 32))


def test_zero_context_gives_zeros(device: torch.device) -> None:
    cache = make_paged_latent([10], 4, 40, torch.float32, device)
    q_latent = torch.randn(2, 4, 32, device=device)
    q_pe = torch.randn(2, 4, 8, device=device)
    for splits in (1, 4):
        out, ref = run_both(cache, q_latent, q_pe, [0, 0], [0, 10], num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_no_rows(device: torch.device) -> None:
    cache = make_paged_latent([10], 4, 40, torch.float32, device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    out = mla_decode(
        torch.zeros(0, 4, 32, device=device),
        torch.zeros(0, 4, 8, device=device),
        cache.latent,
        cache.block_tables,
        empty,
        empty,
        0.1,
    )
    assert out.shape == (0, 4, 32)


def test_large_scores_are_stable(device: torch.device) -> None:
    """Scores in the hundreds must not overflow the online softmax or the split merge."""
    gen = torch.Generator().manual_seed(3)
    cache = make_paged_latent([37], 8, 40, torch.float32, device, gen)
    cache.latent.mul_(20)
    q_latent = torch.randn(1, 4, 32, generator=gen).to(device) * 20
    q_pe = torch.randn(1, 4, 8, generator=gen).to(device) * 20
    for splits in (1, 3):
        out, ref = run_both(cache, q_latent, q_pe, [0], [37], num_splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def _args(**overrides: object) -> list[object]:
    args: dict[str, object] = {
        "q_latent": torch.randn(2, 4, 32),
        "q_pe": torch.randn(2, 4, 8),
        "latent": torch.zeros(3, 4, 40),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32),
        "seq_ids": torch.zeros(2, dtype=torch.int32),
        "context_lens": torch.ones(2, dtype=torch.int32),
        "scale": 0.25,
    }
    args.update(overrides)
    return list(args.values())


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"q_pe": torch.randn(2, 3, 8)}, "q_pe must have shape"),
        ({"latent": torch.zeros(3, 4, 48)}, "latent must have shape"),
        ({"latent": torch.zeros(3, 4)}, "latent must be 3-D"),
        ({"latent": torch.zeros(3, 40, 4).transpose(1, 2)}, "latent must be contiguous"),
        ({"q_latent": torch.randn(2, 32, 4).transpose(1, 2)}, "last dim must be contiguous"),
        ({"q_latent": torch.randn(2, 4, 1024)}, "kv_lora_rank"),
        ({"q_pe": torch.randn(2, 4, 0)}, "qk_rope_head_dim"),
        ({"q_latent": torch.randn(2, 4, 32).bfloat16()}, "dtypes must match"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables must have dtype"),
        ({"seq_ids": torch.zeros(3, dtype=torch.int32)}, "seq_ids must have shape"),
        ({"context_lens": torch.ones(2)}, "context_lens must have dtype"),
        ({"q_latent": [[0.0]]}, "q_latent must be a torch.Tensor"),
    ],
)
def test_rejects_bad_arguments(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mla_decode(*_args(**overrides))


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(*_args(), num_splits=0)


# DeepSeek-V3 on the GPU: 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, 64-row pages.
H, R, P, BLOCK_SIZE = 128, 512, 64, 64
V3_SCALE = (128 + 64) ** -0.5


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("max_ctx", [1024, 8192])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_decode_deepseek_v3_shape(batch: int, max_ctx: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(batch + max_ctx)
    seq_lens = torch.randint(max_ctx // 2, max_ctx + 1, (batch,), generator=gen).tolist()
    seq_lens[0] = max_ctx
    cache = make_paged_latent(seq_lens, BLOCK_SIZE, R + P, torch.bfloat16, "cuda", gen)
    q_latent = torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, H, P, device="cuda", dtype=torch.bfloat16)
    seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (q_latent, q_pe, cache.latent, cache.block_tables, seq, ctx, V3_SCALE)
    out = mla_decode(*args, num_splits=num_splits)
    ref = mla_decode_ref(*args)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_chunk_deepseek_v3_shape() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_paged_latent([4100, 300], BLOCK_SIZE, R + P, torch.bfloat16, "cuda", gen)
    seq_ids = [0] * 40 + [1] * 30
    ctx = [4061 + j for j in range(40)] + [271 + j for j in range(30)]
    q_latent = torch.randn(len(seq_ids), H, R, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(len(seq_ids), H, P, device="cuda", dtype=torch.bfloat16)
    out, ref = run_both(cache, q_latent, q_pe, seq_ids, ctx)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_context_lens() -> None:
    """Captured once, replayed after the context lengths (device data only) change."""
    gen = torch.Generator().manual_seed(4)
    batch = 4
    cache = make_paged_latent([8192] * batch, BLOCK_SIZE, R + P, torch.bfloat16, "cuda", gen)
    q_latent = torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, H, P, device="cuda", dtype=torch.bfloat16)
    seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    ctx = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    args = (q_latent, q_pe, cache.latent, cache.block_tables, seq, ctx, V3_SCALE)
    mla_decode(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(*args)
    ctx.copy_(torch.tensor([8192, 1, 3000, 64], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out.double(), mla_decode_ref(*args), atol=2e-2, rtol=2e-2)
