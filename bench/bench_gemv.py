"""`python bench/bench_gemv.py`: the GEMV (kernels/gemv.py) at the MTP layers' matrix shapes,
its launch constants swept, against cuBLAS and the HBM roofline, on the GPU.

For each matrix (MiMo-7B's, GLM-4.5-Air's and Qwen3-Next-80B's projections) and M rows:
the kernel with gemv_config's constants, the fastest constants of the sweep (BLOCK_N x
BLOCK_K x pipeline stages), and F.linear (cuBLAS). Each call reads a different copy of
the weight, round robin over enough copies to exceed the L2, so every call streams its
weight from HBM as a decode step does. Times per call in microseconds, replayed from a
CUDA graph. Writes gemv.json and gemv.md to --out-dir.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys

import torch
import torch.nn.functional as F
import triton
from bench_moe_kernel import copy_bandwidth, time_us
from results_file import write_results

from mtpdraft.kernels._shared import SHARED_BYTES, gemv_config
from mtpdraft.kernels.gemv import _gemv_kernel

# (name, N, K): the MTP layers' projections (fused q/k/v and gate/up as the service holds them).
SHAPES = [
    ("mimo-7b o_proj", 4096, 4096),
    ("mimo-7b qkv", 6144, 4096),
    ("mimo-7b fc", 4096, 8192),
    ("glm-4.5-air qkv", 14336, 4096),
    ("glm-4.5-air o_proj", 4096, 12288),
    ("qwen3-next qkv+gate", 9216, 2048),
    ("qwen3-next fc", 2048, 4096),
    ("qwen3-next o_proj", 2048, 4096),
    ("qwen3-next router", 513, 2048),
]
L2_BYTES = 256 << 20  # copies of a weight until they exceed this (H100/H200 L2: 50 MB)


def launch(x, weights, y, cfg):
    """One call per weight copy, the kernel launched with cfg (gemv_config's keys)."""
    m, k = x.shape
    n = weights[0].shape[0]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)

    def run():
        for w in weights:
            _gemv_kernel[grid](
                x, w, w, x, y, m, n, k, HAS_BIAS=False, FP8=False, SCALE_N=1, SCALE_K=1,
                SCALE_TILE=False, **cfg,
            )  # fmt: skip

    return run


def sweep(m: int, n: int, k: int, dtype: torch.dtype):
    """Launch constants that fit in shared memory: BLOCK_N x BLOCK_K x stages."""
    block_m = max(16, triton.next_power_of_2(m))
    for bn, bk, stages in itertools.product((16, 32, 64), (128, 256, 512), (3, 4)):
        buffers = stages if block_m >= 64 else stages - 1
        if buffers * (block_m + bn) * bk * dtype.itemsize > SHARED_BYTES or bk > k:
            continue
        yield {
            "BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "DOT_PRECISION": "tf32",
            "num_warps": 4, "num_stages": stages,
        }  # fmt: skip


def measure(name, n, k, m, device, bandwidth, dtype=torch.bfloat16) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    copies = max(1, -(-L2_BYTES // (n * k * dtype.itemsize)))
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
    y = torch.empty(m, n, device=device, dtype=dtype)

    def per_call(fn):
        return time_us(fn, device, 1) / copies

    default = gemv_config(m, n, k, dtype)
    row = {
        "matrix": name, "N": n, "K": k, "M": m, "copies": copies,
        "roofline_us": (n * k + 2 * m * k + m * n) * dtype.itemsize / bandwidth * 1e6,
        "default_config": default, "default_us": per_call(launch(x, weights, y, default)),
    }  # fmt: skip
    best = min(
        ((per_call(launch(x, weights, y, cfg)), cfg) for cfg in sweep(m, n, k, dtype)),
        key=lambda t: t[0],
    )
    row["best_us"], row["best_config"] = best
    row["cublas_us"] = per_call(lambda: [F.linear(x, w) for w in weights])
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--matrices", default=None, help="substring of the matrix names")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = []
    for (name, n, k), m in itertools.product(SHAPES, map(int, args.rows.split(","))):
        if args.matrices and args.matrices not in name:
            continue
        rows.append(measure(name, n, k, m, device, bandwidth))
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "rows": rows,
    }
    write_results(args.out_dir, "gemv", report, markdown(report))
    print(markdown(report))
    return 0


def _cfg(c: dict) -> str:
    return f"{c['BLOCK_N']}x{c['BLOCK_K']}/{c['num_stages']}"


def markdown(report: dict) -> str:
    lines = [
        f"The GEMV at the MTP layers' shapes, {report['device']}, bfloat16, triton "
        f"{report['triton']}. Copy bandwidth {report['copy_bandwidth_tb_s']:.2f} TB/s.",
        "",
        f"Command: `{report['command']}`",
        "",
        "Microseconds per call, each call on a weight copy not in L2, replayed from a CUDA "
        "graph. Constants as BLOCK_N x BLOCK_K / stages.",
        "",
        "| matrix | N x K | M | roofline us | gemv_config | us | best of sweep | us | cuBLAS us "
        "| gemv_config / roofline | best / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['matrix']} | {r['N']} x {r['K']} | {r['M']} | {r['roofline_us']:.1f} "
            f"| {_cfg(r['default_config'])} | {r['default_us']:.1f} | {_cfg(r['best_config'])} "
            f"| {r['best_us']:.1f} | {r['cublas_us']:.1f} "
            f"| {r['default_us'] / r['roofline_us']:.2f}x "
            f"| {r['best_us'] / r['roofline_us']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
