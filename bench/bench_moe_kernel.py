"""`python bench/bench_moe_kernel.py`: the fused_moe kernel at three MTP layers' MoE shapes
against the HBM roofline and torch.compile, on the GPU, with random weights.

Shapes: GLM-4.5-Air (H 4096, I 1408, E 128, k 8) and Qwen3-Next-80B (H 2048, I 512,
E 512, k 10) in bf16, and DeepSeek-V3 (H 7168, I 2048, E 256, k 8) with its FP8 experts
(float8_e4m3fn, an fp32 scale per 128 x 128 block; x and the output bf16), for N = 1, 8,
32, 64 tokens routed at random (k distinct experts a token); the number of distinct
experts the routing touched is noted. Three figures a point:

- fused_moe: the kernel's time replayed from a CUDA graph (triton.testing.do_bench_cudagraph).
- roofline: (the distinct experts' weight bytes, FP8 ones with their scales, + the
  activations read and written: x, ids, weights, out) / the HBM bandwidth of a 1 GiB
  device-to-device copy measured in the same run (bytes read + written).
- peer: the same math in plain torch over a dense gather of each token's experts
  (w[topk_ids], one [2I, H] and one [H, I] matrix a (token, slot) pair), compiled with
  torch.compile(mode="max-autotune-no-cudagraphs") and also replayed from a CUDA graph.
  For the FP8 rows the peer is fused_moe itself on the weights dequantized to bf16 (a dense
  gather of dequantized experts would not fit), so the ratio is FP8's gain over bf16.

Each timed call runs ROUTINGS different routings one after another (the time is per
routing), so that one routing's experts are not still in L2 when the next call reads them
(Qwen3-Next's 10 experts are 63 MB, about an L2). Writes moe_kernel.json and moe_kernel.md
to --out-dir. `--small` (tiny shapes, bf16 and FP8 with 16 x 16 blocks) runs on the CPU
under the Triton interpreter as a smoke test: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "GLM-4.5-Air": dict(hidden=4096, inter=1408, experts=128, topk=8),
    "Qwen3-Next-80B": dict(hidden=2048, inter=512, experts=512, topk=10),
    # FP8 experts, one scale per fp8_block x fp8_block block (DeepSeek's weight_scale_inv).
    "DeepSeek-V3 (FP8)": dict(hidden=7168, inter=2048, experts=256, topk=8, fp8_block=128),
}
SMALL = {
    "small": dict(hidden=64, inter=32, experts=16, topk=4),
    "small (FP8)": dict(hidden=64, inter=32, experts=16, topk=4, fp8_block=16),
}
ROUTINGS = 4


def moe_dense(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The peer: each (token, slot) pair's expert matrices gathered densely, then batched."""
    gate_up = (w_gate_up[topk_ids] @ x[:, None, :, None]).squeeze(-1)  # [N, k, 2I]
    gate, up = gate_up.float().chunk(2, -1)
    act = (F.silu(gate) * up).to(x.dtype)
    y = (w_down[topk_ids] @ act[..., None]).squeeze(-1)  # [N, k, H]
    return (y.float() * topk_weights[..., None]).sum(1).to(x.dtype)


def fp8_weights(
    experts: int, rows: int, cols: int, block: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weights [E, rows, cols] (values spread over e4m3's range) and fp32 scales
    [E, ceil(rows / block), ceil(cols / block)] that make the weights about 1 / sqrt(cols);
    drawn a few experts at a time in the generator's device (DeepSeek's are 11 GB)."""
    q = torch.empty(experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
    chunk = max(1, (1 << 28) // max(rows * cols, 1))
    for e in range(0, experts, chunk):
        noise = torch.randn(q[e : e + chunk].shape, generator=gen, device=gen.device)
        q[e : e + chunk] = (noise * 100).clamp(-448, 448).to(device, torch.float8_e4m3fn)
    grid = (experts, -(-rows // block), -(-cols // block))
    scale = (torch.rand(grid, generator=gen, device=gen.device) + 0.5) / (100 * cols**0.5)
    return q, scale.to(device)


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype):
    """q * its block's scale, in dtype, a few experts at a time (the FP8 rows' peer)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    rows, cols = q.shape[1:]
    chunk = max(1, (1 << 28) // max(rows * cols, 1))
    for e in range(0, q.shape[0], chunk):
        s = scale[e : e + chunk].repeat_interleave(block, 1)[:, :rows]
        s = s.repeat_interleave(block, 2)[:, :, :cols]
        out[e : e + chunk] = (q[e : e + chunk].float() * s).to(dtype)
    return out


def time_us(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median microseconds of fn(): replayed from a CUDA graph on the GPU, wall time else."""
    if device.type == "cuda":
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (bytes read + written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    else:
        ms = time_us(lambda: dst.copy_(src), device, 5) / 1e3
    return 2 * n / (ms / 1e3)


def routing(n: int, experts: int, topk: int, device: torch.device, gen: torch.Generator):
    """k distinct random experts a token (int32 ids, as routers hand them) and their weights."""
    scores = torch.rand(n, experts, generator=gen)
    weights, ids = scores.topk(topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device, torch.int32), weights.to(device)


def measure(
    name: str,
    shape: dict,
    n: int,
    weights: tuple[torch.Tensor, torch.Tensor],
    peer: Callable | None,
    bandwidth: float,
    gen: torch.Generator,
    iters: int,
    routings: int,
    dtype: torch.dtype,
    scales: dict | None = None,
) -> dict:
    """One point; ``scales`` (fused_moe's FP8 keywords) where the weights are FP8."""
    from mtpdraft.kernels import fused_moe
    from mtpdraft.kernels.fused_moe import fused_moe_config

    w_gate_up, w_down = weights
    scales = scales or {}
    device = w_gate_up.device
    hidden, inter, experts, topk = (shape[k] for k in ("hidden", "inter", "experts", "topk"))
    x = torch.randn(n, hidden, generator=gen).to(device, dtype)
    routes = [routing(n, experts, topk, device, gen) for _ in range(routings)]
    distinct = [ids.unique().numel() for ids, _ in routes]
    itemsize = torch.finfo(dtype).bits // 8
    w_itemsize = torch.finfo(w_gate_up.dtype).bits // 8
    expert_bytes = 3 * hidden * inter * w_itemsize
    if scales:  # each expert's fp32 scales are read with its weights
        expert_bytes += 4 * (scales["gate_up_scale"][0].numel() + scales["down_scale"][0].numel())
    activation_bytes = 2 * n * hidden * itemsize + n * topk * 8  # x, out, ids, weights
    moved = statistics.mean(distinct) * expert_bytes + activation_bytes
    scale_k = scales["scale_block"][1] if scales else None
    row: dict = {
        "model": name,
        "tokens": n,
        "weights": str(w_gate_up.dtype).removeprefix("torch."),
        "distinct_experts": distinct,
        "bytes_per_call": moved,
        "roofline_us": moved / bandwidth * 1e6,
        "config": fused_moe_config(n, topk, experts, hidden, inter, dtype, scale_k),
    }
    ours = [fused_moe(x, w_gate_up, w_down, ids, w, **scales) for ids, w in routes]
    row["fused_moe_us"] = (
        time_us(
            lambda: [fused_moe(x, w_gate_up, w_down, i, w, **scales) for i, w in routes],
            device,
            iters,
        )
        / routings
    )
    row["fused_moe_tb_s"] = moved / (row["fused_moe_us"] * 1e-6) / 1e12
    row["vs_roofline"] = row["fused_moe_us"] / row["roofline_us"]
    if peer is not None:
        try:
            theirs = [peer(x, w_gate_up, w_down, ids, w) for ids, w in routes]
            row["max_abs_diff_vs_peer"] = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(ours, theirs, strict=True)
            )
            row["peer_us"] = (
                time_us(
                    lambda: [peer(x, w_gate_up, w_down, i, w) for i, w in routes], device, iters
                )
                / routings
            )
            row["vs_peer"] = row["fused_moe_us"] / row["peer_us"]
        except Exception as exc:  # record it, keep measuring the rest
            row["peer_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def fused_moe_peer(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> Callable:
    """The FP8 rows' peer: fused_moe on these (dequantized, bf16) weights, ignoring the
    FP8 ones it is handed."""

    def peer(x, _w_gate_up, _w_down, topk_ids, topk_weights):
        from mtpdraft.kernels import fused_moe

        return fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)

    return peer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default=None, help="comma-separated N (default 1,8,32,64)")
    parser.add_argument("--iters", type=int, default=5, help="CPU timing iterations")
    parser.add_argument("--no-compile", action="store_true", help="the peer in eager torch")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        # Before mtpdraft.kernels is imported: its kernels are decorated on import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, str(ROOT / "tests"))
        from triton_interpreter import patch_interpreter  # the interpreter's bf16 tl.dot

        patch_interpreter()
    models = SMALL if args.small else MODELS
    tokens = [int(t) for t in (args.tokens or ("1,3" if args.small else "1,8,32,64")).split(",")]
    routings = 1 if device.type == "cpu" else ROUTINGS
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth(device)
    # The peer is compiled on the GPU only: on the CPU it is the smoke test's eager torch.
    compile_peer = device.type == "cuda" and not args.no_compile
    if compile_peer:
        torch._dynamo.config.cache_size_limit = 64  # one graph per (model, N)
    peer = (
        torch.compile(moe_dense, mode="max-autotune-no-cudagraphs", dynamic=False)
        if compile_peer
        else moe_dense
    )
    gen = torch.Generator().manual_seed(0)
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "models": models,
        "routings_per_timed_call": routings,
        "timing": (
            f"each call replayed from a CUDA graph, {routings} different routings a replay"
            if device.type == "cuda"
            else "wall time under the Triton interpreter (a smoke test: no meaning)"
        ),
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "peer": (
            'torch.compile(mode="max-autotune-no-cudagraphs") of a dense gather, CUDA graph'
            if compile_peer
            else "eager torch, dense gather"
        ),
        "rows": [],
    }
    for name, shape in models.items():
        e, h, i = shape["experts"], shape["hidden"], shape["inter"]
        scales, model_peer = None, peer
        if "fp8_block" in shape:
            block = shape["fp8_block"]
            # On the GPU drawn there, a few experts at a time (11 GB of FP8 for DeepSeek).
            wgen = gen if device.type == "cpu" else torch.Generator(device).manual_seed(1)
            w_gate_up, s_gu = fp8_weights(e, 2 * i, h, block, device, wgen)
            w_down, s_down = fp8_weights(e, h, i, block, device, wgen)
            scales = dict(gate_up_scale=s_gu, down_scale=s_down, scale_block=(block, block))
            model_peer = fused_moe_peer(
                dequantized(w_gate_up, s_gu, block, dtype),
                dequantized(w_down, s_down, block, dtype),
            )
        else:
            w_gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(device, dtype)
            w_down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(device, dtype)
        for n in tokens:
            row = measure(
                name,
                shape,
                n,
                (w_gate_up, w_down),
                model_peer,
                bandwidth,
                gen,
                args.iters,
                routings,
                dtype,
                scales,
            )
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            # Written after every point: a run cut short keeps what it measured.
            write_results(args.out_dir, "moe_kernel", report, markdown(report))
        del w_gate_up, w_down, scales, model_peer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"fused_moe (kernels/fused_moe.py), {report['device']}, {report['dtype']}, random "
        f"routing (k distinct experts a token), torch {report['torch']}, triton "
        f"{report['triton']}. Copy bandwidth {report['copy_bandwidth_tb_s']:.2f} TB/s.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Times per call in microseconds, {report['timing']}. Roofline: the "
        "distinct experts' weights and the activations at the copy bandwidth. Peer: "
        f"{report['peer']}; for FP8 weights, fused_moe on the weights dequantized to bf16.",
        "",
        "| model | weights | N | distinct experts | MB moved | roofline us | fused_moe us | TB/s "
        "| peer us | fused_moe / roofline | fused_moe / peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        peer = f"{r['peer_us']:.1f}" if "peer_us" in r else "n/a"
        vs_peer = f"{r['vs_peer']:.2f}x" if "vs_peer" in r else "n/a"
        distinct = "/".join(str(d) for d in r["distinct_experts"])
        lines.append(
            f"| {r['model']} | {r.get('weights', report['dtype'])} | {r['tokens']} | {distinct} "
            f"| {r['bytes_per_call'] / 1e6:.1f} "
            f"| {r['roofline_us']:.1f} | {r['fused_moe_us']:.1f} | {r['fused_moe_tb_s']:.2f} "
            f"| {peer} | {r['vs_roofline']:.2f}x | {vs_peer} |"
        )
    errors = [r for r in report["rows"] if "peer_error" in r]
    for r in errors:
        lines.append(f"\nPeer failed at {r['model']} N = {r['tokens']}: {r['peer_error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
