"""One chain's hiddens (B = 64, MiMo-7B's 4096, bf16) copied into pinned memory, as the
graph path stages them, after a 4 ms sleep (as between steps): torch's intra-op pool at its
default and at one thread, and numpy's copy.

    python bench/host_copy.py    (needs a CUDA device for pinned memory)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch


def after_a_sleep(copy, n: int = 300) -> float:
    """Median us of `copy` run after a 4 ms sleep."""
    times = []
    for _ in range(n):
        time.sleep(0.004)
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    src = torch.randn(64, 4096).to(torch.bfloat16)
    pinned = torch.empty_like(src).pin_memory()
    a, b = pinned.view(torch.int16).numpy(), src.view(torch.int16).numpy()
    out = {"cpus": os.cpu_count(), "torch threads": torch.get_num_threads()}
    out["torch copy_, default threads, us"] = after_a_sleep(lambda: pinned.copy_(src))
    out["np.copyto, us"] = after_a_sleep(lambda: np.copyto(a, b))
    torch.set_num_threads(1)
    out["torch copy_, one thread, us"] = after_a_sleep(lambda: pinned.copy_(src))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
