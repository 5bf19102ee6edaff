"""fused_moe against a float64 loop over each token's experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpdraft.kernels import fused_moe

H, INTER, EXPERTS = 64, 32, 8


def moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """float64, token by token and expert by expert, on the CPU; returns [N, H] float64.

    Rounds where the kernel does (its module docstring): only silu(gate) * up, to x.dtype.
    Ids outside [0, E) contribute nothing.
    """
    x64, gu64, down64 = (t.double().cpu() for t in (x, w_gate_up, w_down))
    inter = down64.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist(), strict=True)):
        for e, weight in zip(ids, weights, strict=True):
            if not 0 <= e < gu64.shape[0]:
                continue
            gate, up = gu64[e, :inter] @ x64[n], gu64[e, inter:] @ x64[n]
            act = (F.silu(gate) * up).to(x.dtype).double()
            out[n] += weight * (down64[e] @ act)
    return out


def make_inputs(
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    id_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    experts: int = EXPERTS,
) -> tuple[torch.Tensor, ...]:
    """Random tokens and weights; each token routed to k distinct random experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen)
    w_gate_up = torch.randn(experts, 2 * INTER, H, generator=gen) / H**0.5
    w_down = torch.randn(experts, H, INTER, generator=gen) / INTER**0.5
    ids = torch.rand(n, experts, generator=gen).argsort(-1)[:, :k].contiguous()
    weights = torch.rand(n, k, generator=gen) + 0.1
    weights /= weights.sum(-1, keepdim=True)
    return (
        x.to(device, dtype),
        w_gate_up.to(device, dtype),
        w_down.to(device, dtype),
        ids.to(device, id_dtype),
        weights.to(device),
    )


def check(args: tuple[torch.Tensor, ...], atol: float, rtol: float) -> None:
    out = fused_moe(*args)
    x = args[0]
    assert out.dtype == x.dtype and out.shape == x.shape and out.device == x.device
    torch.testing.assert_close(out.double().cpu(), moe_reference(*args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("n,k", [(1, 2), (3, 3), (17, 2)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_matches_reference(
    n: int,
    k: int,
    id_dtype: torch.dtype,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """Random routing; at 17 tokens over 8 experts every expert has several tokens."""
    dtype, atol, rtol = dtype_tol
    check(make_inputs(n, k, dtype, device, id_dtype, seed=n * 10 + k), atol, rtol)


@pytest.mark.parametrize("n", [17, 80])
def test_every_token_to_one_expert(n: int, device: torch.device) -> None:
    """One expert takes all n pairs of slot 0: at 80 tokens, more than one block of rows."""
    x, w_gate_up, w_down, ids, weights = make_inputs(n, 2, torch.float32, device, seed=n)
    ids[:, 0] = 5
    ids[:, 1] = torch.arange(n, device=device) % 5  # any other expert
    check((x, w_gate_up, w_down, ids, weights), 1e-5, 1e-5)


def test_k1_all_tokens_one_expert_bf16(device: torch.device) -> None:
    x, w_gate_up, w_down, _, _ = make_inputs(9, 1, torch.bfloat16, device, seed=3)
    ids = torch.full((9, 1), 7, dtype=torch.int32, device=device)
    weights = torch.linspace(0.5, 1.5, 9, device=device)[:, None]
    check((x, w_gate_up, w_down, ids, weights), 2e-2, 2e-2)


def test_repeated_expert_in_a_row_and_out_of_range_ids(device: torch.device) -> None:
    """A token may name an expert twice (it counts twice); ids outside [0, E) count zero."""
    x, w_gate_up, w_down, _, _ = make_inputs(5, 3, torch.float32, device, seed=4)
    rows = [[2, 2, 6], [-1, 2, 0], [EXPERTS, 3, 3], [-1, -1, -1], [2**32 + 3, 1, 4]]
    ids = torch.tensor(rows, device=device)  # 2**32 + 3 must not pass for expert 3
    weights = torch.tensor([[0.5, 0.25, 0.25]] * 5, device=device)
    out = fused_moe(x, w_gate_up, w_down, ids, weights)
    torch.testing.assert_close(
        out.double().cpu(), moe_reference(x, w_gate_up, w_down, ids, weights), atol=1e-5, rtol=1e-5
    )
    assert out[3].abs().max().item() == 0.0


def test_no_tokens_gives_an_empty_output(device: torch.device) -> None:
    x, w_gate_up, w_down, ids, weights = make_inputs(0, 2, torch.bfloat16, device)
    out = fused_moe(x, w_gate_up, w_down, ids, weights)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


def _bad(**changes: object) -> dict[str, object]:
    args = dict(
        zip(
            ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights"),
            make_inputs(3, 2, torch.float32, torch.device("cpu")),
            strict=True,
        )
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args,match",
    [
        (_bad(x=torch.randn(3, H + 1)), "must share H"),
        (_bad(x=torch.randn(3, H, dtype=torch.float64)), "x must have dtype in"),
        (_bad(x=torch.randn(H, 3).t()), "x must be contiguous"),
        (_bad(w_gate_up=torch.randn(EXPERTS, 2 * INTER + 1, H)), "even count"),
        (_bad(w_gate_up=torch.randn(2 * INTER, H)), "w_gate_up must be 3-D"),
        (_bad(w_down=torch.randn(EXPERTS, H, INTER + 1)), r"w_down must have shape \(8, 64, 32\)"),
        (_bad(w_down=torch.randn(EXPERTS - 1, H, INTER)), "w_down must have shape"),
        (_bad(topk_ids=torch.zeros(3, 2, dtype=torch.int16)), "topk_ids must have dtype in"),
        (_bad(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), r"topk_ids must have shape \[N, k\]"),
        (_bad(topk_ids=torch.zeros(3, 0, dtype=torch.int64)), "k >= 1"),
        (_bad(topk_weights=torch.rand(3, 3)), r"topk_weights must have shape \(3, 2\)"),
        (_bad(topk_weights=torch.rand(3, 2, dtype=torch.bfloat16)), "topk_weights must have"),
        (_bad(w_down=torch.randn(EXPERTS, H, INTER, dtype=torch.bfloat16)), "dtypes must match"),
        (_bad(topk_ids=[[0, 1]] * 3), "topk_ids must be a torch.Tensor"),
    ],
)
def test_rejects_bad_arguments(args: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8: float8_e4m3fn values and an fp32 scale per (bn, bk) block of
    [E, R, C] (the last blocks partial where bn, bk do not divide R, C); the weight is
    ``q * scale[r // bn, c // bk]``, with scale = amax(|block|) / 448."""
    bn, bk = block
    e, rows, cols = w.shape
    rb, cb = -(-rows // bn), -(-cols // bk)
    padded = F.pad(w.float().abs(), (0, cb * bk - cols, 0, rb * bn - rows))
    amax = padded.view(e, rb, bn, cb, bk).amax(dim=(2, 4))
    scale = amax.clamp_min(1e-12) / 448
    q = (w.float() / expand_scale(scale, block, rows, cols)).to(torch.float8_e4m3fn)
    return q, scale


def expand_scale(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """[E, R / bn, C / bk] scales spread over the [E, R, C] weights they scale."""
    bn, bk = block
    return scale.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """As the kernel dequantizes a tile: fp8 to fp32, times the fp32 scale, rounded to dtype."""
    return (q.float() * expand_scale(scale, block, *q.shape[1:])).to(dtype)


def make_fp8_inputs(
    n: int, k: int, dtype: torch.dtype, device: torch.device, block: tuple[int, int], seed: int
) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    """make_inputs with its weights quantized per block: (args, fused_moe's FP8 keywords)."""
    x, w_gate_up, w_down, ids, weights = make_inputs(n, k, torch.float32, device, seed=seed)
    q_gu, s_gu = quantize_blocks(w_gate_up, block)
    q_down, s_down = quantize_blocks(w_down, block)
    scales = dict(gate_up_scale=s_gu, down_scale=s_down, scale_block=block)
    return (x.to(dtype), q_gu, q_down, ids, weights), scales


# (16, 16): K tiles of 16 within the blocks; (48, 48): partial last blocks, a scale row
# across the gate and up rows, K tiles of 16; (24, 24): 24 has no power-of-two divisor of
# 16 or more, so each column of a K tile looks up its own scale.
@pytest.mark.parametrize("block", [(16, 16), (48, 48), (24, 24)], ids=str)
@pytest.mark.parametrize("n", [1, 5])
def test_fp8_block_scaled_weights(
    n: int,
    block: tuple[int, int],
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """FP8 weights with block scales against the float64 reference on the dequantized ones."""
    dtype, atol, rtol = dtype_tol
    args, scales = make_fp8_inputs(n, 2, dtype, device, block, seed=n + block[0])
    x, q_gu, q_down, ids, weights = args
    out = fused_moe(*args, **scales)
    assert out.dtype == dtype and out.shape == x.shape
    w_gate_up = dequantize(q_gu, scales["gate_up_scale"], block, dtype)
    w_down = dequantize(q_down, scales["down_scale"], block, dtype)
    want = moe_reference(x, w_gate_up, w_down, ids, weights)
    torch.testing.assert_close(out.double().cpu(), want, atol=atol, rtol=rtol)
    # The x.dtype path on the same dequantized weights: the same math.
    same = fused_moe(x, w_gate_up, w_down, ids, weights)
    torch.testing.assert_close(out, same, atol=atol, rtol=rtol)


def _bad_fp8(**changes: object) -> dict[str, object]:
    args, scales = make_fp8_inputs(3, 2, torch.float32, torch.device("cpu"), (16, 16), seed=0)
    names = ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights")
    kwargs = dict(zip(names, args, strict=True)) | scales
    kwargs.update(changes)
    return kwargs


_GU_GRID, _DOWN_GRID = (EXPERTS, 2 * INTER // 16, H // 16), (EXPERTS, H // 16, INTER // 16)


@pytest.mark.parametrize(
    "args,match",
    [
        (_bad_fp8(down_scale=None), "must be given together"),
        (_bad_fp8(gate_up_scale=None), "must be given together"),
        (_bad_fp8(w_down=torch.randn(EXPERTS, H, INTER)), r"w_down must have dtype in \(float8"),
        (
            _bad_fp8(w_gate_up=torch.randn(EXPERTS, 2 * INTER, H).bfloat16()),
            "w_gate_up must have dtype in",
        ),
        (_bad_fp8(gate_up_scale=None, down_scale=None), "w_gate_up is float8_e4m3fn"),
        (_bad(w_down=torch.randn(EXPERTS, H, INTER).to(torch.float8_e4m3fn)), "w_down is float8"),
        (
            _bad_fp8(gate_up_scale=torch.ones(EXPERTS, 4, 3)),
            r"gate_up_scale must have shape \(8, 4, 4\)",
        ),
        (_bad_fp8(down_scale=torch.ones(EXPERTS, 4, 3)), r"down_scale must have shape \(8, 4, 2\)"),
        (_bad_fp8(scale_block=(16, 32)), r"gate_up_scale must have shape \(8, 4, 2\)"),
        (_bad_fp8(gate_up_scale=torch.ones(_GU_GRID).double()), "gate_up_scale must have dtype"),
        (_bad_fp8(down_scale=torch.ones(_DOWN_GRID).bfloat16()), "down_scale must have dtype"),
        (_bad_fp8(scale_block=(16, 0)), "scale_block must be two positive ints"),
    ],
)
def test_fp8_rejects_bad_arguments(args: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


@pytest.mark.gpu
def test_gpu_graph_replays_new_routings() -> None:
    """Captured once, replayed with other ids and weights copied into the same tensors."""
    n, k, experts = 16, 4, 32
    args = make_inputs(n, k, torch.bfloat16, torch.device("cuda"), torch.int32, 1, experts)
    x, w_gate_up, w_down, ids, weights = args
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(*args)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*args)
    routings = [
        make_inputs(n, k, torch.bfloat16, "cpu", torch.int32, s, experts)[3:] for s in (2, 3)
    ]
    routings.append((torch.full((n, k), 9, dtype=torch.int32), torch.full((n, k), 0.25)))
    for new_ids, new_weights in routings:
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        want = moe_reference(x, w_gate_up, w_down, ids, weights)
        torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
        # The grouping's order within an expert is the atomics'; the result is not.
        assert torch.equal(out, fused_moe(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64, 200])
@pytest.mark.parametrize(
    "hidden,inter,experts,k", [(4096, 1408, 128, 8), (2048, 512, 512, 10)], ids=["glm", "qwen"]
)
def test_gpu_model_shapes(n: int, hidden: int, inter: int, experts: int, k: int) -> None:
    """GLM-4.5-Air's and Qwen3-Next's expert shapes against torch in fp32, expert by expert."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
    w_gate_up = (
        torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 64
    ).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / 32).bfloat16()
    ids = torch.rand(n, experts, device="cuda", generator=gen).topk(k).indices
    weights = torch.softmax(torch.randn(n, k, device="cuda", generator=gen), -1)
    out = fused_moe(x, w_gate_up, w_down, ids, weights)
    want = torch.zeros(n, hidden, device="cuda")
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[rows].float() @ w_gate_up[e].float().t()).chunk(2, -1)
        act = (F.silu(gate) * up).bfloat16().float()
        want.index_add_(0, rows, weights[rows, slots, None] * (act @ w_down[e].float().t()))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_deepseek_v3_fp8(n: int) -> None:
    """DeepSeek-V3's experts (H 7168, I 2048, E 256, k 8) in FP8 with 128 x 128 block scales
    against torch in fp32 on the dequantized weights (rounded to bf16 as the kernel does),
    expert by expert."""
    hidden, inter, experts, k, block = 7168, 2048, 256, 8, (128, 128)
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
    w_gate_up = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=torch.float8_e4m3fn)
    w_down = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.float8_e4m3fn)
    for w in (w_gate_up, w_down):
        for e in range(0, experts, 32):  # values spread over the FP8 range, a chunk at a time
            noise = torch.randn(w[e : e + 32].shape, device="cuda", generator=gen)
            w[e : e + 32] = (noise * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid_gu = (experts, 2 * inter // 128, hidden // 128)
    grid_down = (experts, hidden // 128, inter // 128)
    s_gu = (torch.rand(grid_gu, device="cuda", generator=gen) + 0.5) / (100 * hidden**0.5)
    s_down = (torch.rand(grid_down, device="cuda", generator=gen) + 0.5) / (100 * inter**0.5)
    ids = torch.rand(n, experts, device="cuda", generator=gen).topk(k).indices
    weights = torch.softmax(torch.randn(n, k, device="cuda", generator=gen), -1)
    out = fused_moe(
        x, w_gate_up, w_down, ids, weights, gate_up_scale=s_gu, down_scale=s_down, scale_block=block
    )
    want = torch.zeros(n, hidden, device="cuda")
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gu = dequantize(w_gate_up[e : e + 1], s_gu[e : e + 1], block, torch.bfloat16)[0]
        down = dequantize(w_down[e : e + 1], s_down[e : e + 1], block, torch.bfloat16)[0]
        gate, up = (x[rows].float() @ gu.float().t()).chunk(2, -1)
        act = (F.silu(gate) * up).bfloat16().float()
        want.index_add_(0, rows, weights[rows, slots, None] * (act @ down.float().t()))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
