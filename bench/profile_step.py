"""Where a draft step's time goes on the GPU: the kernels of one graph replay, by name.

Replays the served step (as `make bench` measures it) under torch.profiler and
lists each kernel's time per step, the sum of kernel time, and the step's time
between CUDA events: the difference is the gaps between kernels. MiMo-7B shape, or
a MoE family's (`--family`, the shapes of bench_families.py), random weights, bf16. On
the GPU machine:

    python bench/profile_step.py --batches 1,32 --contexts 2048 [--family NAME] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from bench_families import DT, FAMILIES, fp8_weights
from bench_step import CHAIN, make_chain, timed_replay
from scratch import scratch_folder
from shapes import MIMO_7B
from torch.profiler import ProfilerActivity, profile

from mtpdraft.service.model.checkpoint import load_mtp_weights, mtp_weights_from
from mtpdraft.service.model.decode_graphs import DecodeGraphs
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import random_tensors, write_random_checkpoint
from mtpdraft.service.model.tensors import TensorDict

BLOCK = 16


def kernel_times(graphs: DecodeGraphs, chain, replays: int) -> dict[str, float]:
    """Microseconds per step of each kernel name over `replays` single-step replays."""
    graphs.stage(chain).replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.stage(chain).replay()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in event.name:
            per_name[event.name] += event.device_time / replays
    return dict(per_name)


def weights_of(family: str):
    """Random MTP weights at `family`'s shape (mimo-7b, or a key of bench_families.FAMILIES)."""
    if family != "mimo-7b":
        kind, cfg = FAMILIES[family]
        tensors = random_tensors(cfg, kind, dtype=DT, device="cuda")
        return mtp_weights_from(cfg, TensorDict(fp8_weights(cfg, tensors)))
    folder = scratch_folder("profile-step-", in_memory=True)
    write_random_checkpoint(
        folder, "mimo", **MIMO_7B, dtype=torch.bfloat16, seed=0,
        extra_config={"max_position_embeddings": 32768},
    )  # fmt: skip
    return load_mtp_weights(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="2048")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--family", default="mimo-7b", choices=["mimo-7b", *FAMILIES])
    parser.add_argument("--out", help="also write the breakdown as JSON here")
    args = parser.parse_args()
    head = MTPHead(weights_of(args.family), torch.device("cuda"), ops="triton")
    gen = torch.Generator().manual_seed(0)
    report = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            chain, blocks = make_chain(head, b, ctx, gen)
            kv = head.new_kv_cache(blocks, BLOCK)
            graphs = DecodeGraphs(head, kv, b, CHAIN, buckets=(b,), masks=(False,))
            step_us = timed_replay(graphs, chain, 50) * 1e3
            kernels = kernel_times(graphs, chain, args.replays)
            busy = sum(kernels.values())
            print(f"\nbatch {b}, context {ctx}: step {step_us:.1f} us between events, "
                  f"kernels {busy:.1f} us, gaps {step_us - busy:.1f} us, "
                  f"{len(kernels)} kernel names")  # fmt: skip
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"  {us:8.1f} us  {name[:110]}")
            report.append(
                {"batch": b, "context": ctx, "step_us": step_us, "kernel_us": busy,
                 "kernels": kernels}
            )  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
