"""Times as the benches report them: percentiles of a sample in microseconds, and progress
lines stamped with the seconds since the bench started."""

from __future__ import annotations

import statistics
import time

_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {message}", flush=True)


def percentiles_us(seconds: list[float]) -> dict[str, float]:
    values = sorted(seconds)
    if not values:
        return {}

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e6

    return {
        "p50_us": statistics.median(values) * 1e6,
        "p90_us": at(0.90),
        "p99_us": at(0.99),
        "mean_us": statistics.fmean(values) * 1e6,
        "samples": len(values),
    }
