"""paged_attention against a per-row gather + softmax attention in torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from mtpdraft.kernels import paged_attention


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    for i in range(n):
        length = int(context_lens[i])
        if length == 0:
            continue
        blocks = block_tables[int(seq_ids[i])].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:length].float()  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:length].float()
        k = k.repeat_interleave(hq // hkv, dim=1)  # query head h reads kv head h // G
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator | None = None,
) -> PagedKV:
    """Caches holding sequences of ``seq_lens`` rows in shuffled blocks (plus spare blocks)."""
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    shape = (num_blocks, block_size, hkv, d)
    seed = int(torch.randint(2**31, (1,), generator=gen))
    dev_gen = torch.Generator(device).manual_seed(seed)  # no host-side randn for GPU sizes
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    return PagedKV(k_cache, v_cache, block_tables.to(device, torch.int32))


def run_both(
    kv: PagedKV,
    q: torch.Tensor,
    seq_ids: list[int],
    context_lens: list[int],
    **kwargs: int | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.tensor(seq_ids, dtype=torch.int32, device=q.device)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=q.device)
    scale = q.shape[-1] ** -0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, seq, ctx, scale)
    return paged_attention(*args, **kwargs), paged_attention_ref(*args)


HEADS = [(4, 2, 16), (6, 2, 40), (4, 4, 32), (8, 1, 16)]  # (Hq, Hkv, D): G = 2, 3, 1, 8


@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode(
    hq: int,
    hkv: int,
    d: int,
    num_splits: int | None,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """One query row per sequence, contexts of various lengths (not block multiples)."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(hq * d)
    seq_lens = [1, 70, 5, 33, 129]
    kv = make_paged_kv(seq_lens, 8, hkv, d, dtype, device, gen)
    rows = [3, 0, 4, 2, 1, 4, 3]  # N = 7; some sequences queried twice
    q = torch.randn(len(rows), hq, d, generator=gen).to(device, dtype)
    out, ref = run_both(kv, q, rows, [seq_lens[s] for s in rows], num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_strided_queries_and_int64_context_lens(device: torch.device) -> None:
    """q as a view of a fused projection, context lengths as int64: the same attention."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 4, 2, 16
    kv = make_paged_kv([9, 40], 8, hkv, d, torch.float32, device, gen)
    qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=gen).to(device)
    q = qkv[:, : hq * d].view(2, hq, d)
    seq = torch.tensor([1, 0], dtype=torch.int32, device=device)
    ctx = torch.tensor([40, 9], dtype=torch.int64, device=device)
    args = (kv.k_cache, kv.v_cache, kv.block_tables, seq)
    out = paged_attention(q, *args, ctx, d**-0.5)
    ref = paged_attention_ref(q.contiguous(), *args, ctx.int(), d**-0.5)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_gate_scales_the_output_by_its_sigmoid(
    num_splits: int, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    """Qwen3-Next's output gate, a strided view of the fused projection, applied where the
    output is written (whole or merged from splits), rounded as the unfused product is."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(11 + num_splits)
    hq, hkv, d = 4, 2, 16
    kv = make_paged_kv([9, 40, 17], 8, hkv, d, dtype, device, gen)
    fused = (torch.randn(3, 3 * hq * d, generator=gen) * 2).to(device, dtype)
    q, gate = fused[:, : hq * d].view(3, hq, d), fused[:, hq * d : 2 * hq * d]
    rows, lens = [2, 0, 1], [17, 9, 40]
    out, ref = run_both(kv, q, rows, lens, num_splits=num_splits, gate=gate)
    want = ref * torch.sigmoid(gate).view(3, hq, d)  # each factor in dtype, as torch does
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)


def test_single_row_single_key(device: torch.device) -> None:
    """N = 1, context 1: the output is that key's value."""
    kv = make_paged_kv([1], 4, 2, 16, torch.float32, device)
    q = torch.randn(1, 4, 16, device=device)
    out, _ = run_both(kv, q, [0], [1])
    blk = int(kv.block_tables[0, 0])
    expected = kv.v_cache[blk, 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(out[0], expected)


@pytest.mark.parametrize("rows_per_seq", [1, 4, 16])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_causal_chunks(
    rows_per_seq: int,
    num_splits: int | None,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """Several states' new rows, each row seeing the cache up to and including itself."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(rows_per_seq)
    seq_lens = [45, 7, 90]
    chunks = {0: (38, 7), 1: (0, 7), 2: (85, 5)}  # seq -> (first new position, rows)
    kv = make_paged_kv(seq_lens, 16, 2, 32, dtype, device, gen)
    seq_ids, ctx = [], []
    for s, (start, count) in chunks.items():
        seq_ids += [s] * count
        ctx += [start + j + 1 for j in range(count)]
    q = torch.randn(len(seq_ids), 6, 32, generator=gen).to(device, dtype)
    out, ref = run_both(kv, q, seq_ids, ctx, rows_per_seq=rows_per_seq, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_interleaved_rows_with_tile_hint(device: torch.device) -> None:
    """Rows of different sequences in one tile fall back to per-row attention."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [20, 50, 3]
    kv = make_paged_kv(seq_lens, 4, 2, 16, torch.float32, device, gen)
    seq_ids = [0, 1, 0, 2, 1, 1, 2, 0, 1]
    ctx = [seq_lens[s] - (i % 3) for i, s in enumerate(seq_ids)]
    q = torch.randn(len(seq_ids), 4, 16, generator=gen).to(device)
    out, ref = run_both(kv, q, seq_ids, ctx, rows_per_seq=8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_zero_context_gives_zeros(device: torch.device) -> None:
    kv = make_paged_kv([10], 4, 1, 16, torch.float32, device)
    q = torch.randn(2, 2, 16, device=device)
    for splits in (1, 4):
        out, ref = run_both(kv, q, [0, 0], [0, 10], num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, ref)


def test_large_scores_are_stable(device: torch.device) -> None:
    """Scores in the hundreds must not overflow the online softmax."""
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([37], 8, 1, 16, torch.float32, device, gen)
    kv.k_cache.mul_(20)
    q = torch.randn(1, 2, 16, generator=gen).to(device) * 20
    for splits in (1, 3):
        out, ref = run_both(kv, q, [0], [37], num_splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _args(**overrides: torch.Tensor) -> list[torch.Tensor | float]:
    args: dict[str, torch.Tensor | float] = {
        "q": torch.randn(2, 4, 16),
        "k_cache": torch.zeros(3, 4, 2, 16),
        "v_cache": torch.zeros(3, 4, 2, 16),
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
        ({"q": torch.randn(2, 3, 16)}, "multiple of kv heads"),
        ({"k_cache": torch.zeros(3, 4, 2, 8)}, "head dim"),
        ({"v_cache": torch.zeros(3, 4, 2, 8)}, "v_cache must have shape"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables must have dtype"),
        ({"seq_ids": torch.zeros(3, dtype=torch.int32)}, "seq_ids must have shape"),
        ({"context_lens": torch.ones(2)}, "context_lens must have dtype"),
        ({"q": torch.randn(2, 16, 4).transpose(1, 2)}, "q must have contiguous rows"),
        ({"k_cache": torch.zeros(3, 4, 2, 16).bfloat16()}, "dtypes must match"),
    ],
)
def test_rejects_bad_arguments(overrides: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paged_attention(*_args(**overrides))


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*_args(), num_splits=0)
    with pytest.raises(ValueError, match="rows_per_seq"):
        paged_attention(*_args(), rows_per_seq=0)
    with pytest.raises(ValueError, match="gate must have shape"):
        paged_attention(*_args(), gate=torch.randn(2, 16))


# MiMo-7B attention shape on the GPU.
HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("max_ctx", [512, 2048, 8192])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_decode_mimo_shape(batch: int, max_ctx: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(batch + max_ctx)
    seq_lens = torch.randint(max_ctx // 2, max_ctx + 1, (batch,), generator=gen).tolist()
    seq_lens[0] = max_ctx
    kv = make_paged_kv(seq_lens, BLOCK_SIZE, HKV, D, torch.bfloat16, "cuda", gen)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    out, ref = run_both(kv, q, list(range(batch)), seq_lens, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_seq", [1, 16])
def test_gpu_chunk_mimo_shape(rows_per_seq: int) -> None:
    gen = torch.Generator().manual_seed(rows_per_seq)
    kv = make_paged_kv([4100, 300], BLOCK_SIZE, HKV, D, torch.bfloat16, "cuda", gen)
    seq_ids = [0] * 100 + [1] * 30
    ctx = [4001 + j for j in range(100)] + [271 + j for j in range(30)]
    q = torch.randn(len(seq_ids), HQ, D, device="cuda", dtype=torch.bfloat16)
    out, ref = run_both(kv, q, seq_ids, ctx, rows_per_seq=rows_per_seq)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
