"""`python bench/bench_draw.py`: what a sampled draft's draw costs on the GPU, kernel by
kernel, beside the greedy argmax and one read of the logits.

At MiMo-7B's vocabulary, bf16 logits, a support of 64, B = 1, 8 and 64: the greedy draft
(`select_drafts`: it reads the logits once) alone and writing the group maxima,
`torch.topk` against `top_support` (each row's support) from its own first pass and from
those maxima with the kept mass summed, `sample_top` for rows cut by top-k and rows cut by
top-p, and the whole sampled draw past B = 32 as the service runs it (select_drafts with
maxima, top_support, sample_top), each replayed from a CUDA graph (median us); the roofline
is one read of the logits at the device's copy bandwidth. Then every kernel of the whole
draw at the last batch from torch.profiler, and whether `top_support` equals a stable
full sort. Writes draw.json and draw.md to --out-dir. `--small` runs a
tiny vocabulary on the CPU (a smoke test; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from bench_moe_kernel import copy_bandwidth, time_us
from results_file import write_results

from mtpdraft.kernels import sample_top, select_drafts, top_support, top_support_group

VOCAB, SUPPORT = 151680, 64  # MiMo-7B's vocabulary; --max-sample-top-k's default


def _rows(b: int, device: torch.device, top_p: bool, support: int):
    """sample_top's per-row columns: temperature 0.8, then top-p 0.95 or a top-k cut at the
    support."""

    def full(value, dtype=torch.float32) -> torch.Tensor:
        return torch.full((b,), value, dtype=dtype, device=device)

    params = (
        full(0.8), full(0 if top_p else support, torch.int64), full(0.95 if top_p else 1.0),
        full(0.0),
    )  # fmt: skip
    keys = tuple(torch.arange(b, device=device) + i for i in range(4))
    greedy = (full(0, torch.int64), full(1.0))
    return params, keys, greedy


def _draw(logits: torch.Tensor, support: int, top_p: bool):
    """The whole sampled draw of these rows as the service runs it past the fused LM head's
    rows: the greedy pass writes the group maxima, top_support starts from them."""
    params, keys, _ = _rows(logits.shape[0], logits.device, top_p, support)
    group = top_support_group(logits.shape[1], support)
    maxima = torch.empty(logits.shape[0], -(-logits.shape[1] // group), device=logits.device)

    def draw():
        greedy = select_drafts(logits, None, maxima=(maxima, group))
        top = top_support(logits, support, maxima=(maxima, group), params=params)
        return sample_top(top, params, keys, greedy, support, None, (2, 1))

    return draw


def _kernels(logits: torch.Tensor, support: int) -> dict[str, float]:
    """Device us per call of each kernel of the draw (top_p rows), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    draw = _draw(logits, support, True)
    for _ in range(3):
        draw()
    torch.cuda.synchronize()
    calls = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            draw()
        torch.cuda.synchronize()
    return {
        e.key: e.device_time_total / calls
        for e in prof.key_averages()
        if e.device_time_total > 0 and "kernel" in e.key.lower()
    }


def _times(logits: torch.Tensor, support: int, bandwidth: float) -> dict[str, float]:
    """Median us per call of each piece at this batch (see the module)."""
    device, (b, vocab) = logits.device, logits.shape
    group = top_support_group(vocab, support)
    maxima = (torch.empty(b, -(-vocab // group), device=device), group)
    params = _rows(b, device, True, support)[0]
    times = {
        "one read of the logits (roofline)": logits.nbytes / (bandwidth / 2) * 1e6,
        "select_drafts (greedy)": time_us(lambda: select_drafts(logits, None), device, 5),
        "select_drafts + maxima": time_us(
            lambda: select_drafts(logits, None, maxima=maxima), device, 5
        ),
        "torch.topk": time_us(lambda: logits.topk(support, sorted=False), device, 5),
        "top_support": time_us(lambda: top_support(logits, support), device, 5),
        "top_support from maxima + kept mass": time_us(
            lambda: top_support(logits, support, maxima=maxima, params=params), device, 5
        ),
    }
    for name, top_p in (("sample_top, top-k rows", False), ("sample_top, top-p rows", True)):
        params, keys, greedy = _rows(b, device, top_p, support)
        top = top_support(logits, support, params=params)
        run = lambda t=top, p=params, k=keys, g=greedy: sample_top(t, p, k, g, support)  # noqa: E731
        times[name] = time_us(run, device, 5)
    for name, top_p in (("whole draw, top-k rows", False), ("whole draw, top-p rows", True)):
        times[name] = time_us(_draw(logits, support, top_p), device, 5)
    return times


def _exact(logits: torch.Tensor, support: int) -> bool:
    values, ids, _ = top_support(logits, support)
    want_values, want_ids = logits.double().sort(dim=-1, descending=True, stable=True)
    return torch.equal(ids, want_ids[:, :support]) and torch.equal(
        values.double(), want_values[:, :support]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny vocabulary on the CPU")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    vocab, support = (512, 16) if args.small else (VOCAB, SUPPORT)
    bandwidth = copy_bandwidth(device)
    gen = torch.Generator().manual_seed(0)
    rows, exact = [], {}
    for b in (int(x) for x in args.batches.split(",")):
        logits = (torch.randn(b, vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
        rows.append({"batch": b, "us": _times(logits, support, bandwidth)})
        exact[b] = _exact(logits, support)
    kernels = {} if device.type == "cpu" else _kernels(logits, support)
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "vocab": vocab, "support": support, "logits": "bfloat16", "rows": rows,
        "top_support_exact": exact, "kernels_at_last_batch": kernels,
    }  # fmt: skip
    names = list(rows[0]["us"])
    lines = [
        f"# A sampled draft's draw ({report['device']}, vocabulary {vocab}, bf16 logits, "
        f"support {support})",
        "",
        f"`{report['command']}`: us per call, replayed from a CUDA graph (median).",
        "",
        "| B | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
        *(
            f"| {r['batch']} | " + " | ".join(f"{r['us'][n]:.1f}" for n in names) + " |"
            for r in rows
        ),
        "",
        f"top_support equals a stable full sort: {exact}.",
    ]
    if kernels:
        lines += ["", f"Kernels at B = {rows[-1]['batch']} (torch.profiler, us per call):", ""]
        lines += ["| kernel | us |", "|---|---|"]
        slowest = sorted(kernels.items(), key=lambda kv: -kv[1])
        lines += [f"| `{name[:60]}` | {us:.1f} |" for name, us in slowest]
    write_results(args.out_dir, "draw", report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
