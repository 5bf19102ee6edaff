"""The report of ``mtpdraft loadtest``: statistics, JSON, a text summary and a PNG plot.

The report is a plain dict (it is what ``--out`` writes): the configuration,
the server, throughput, latency percentiles in milliseconds, errors by status
code name, the server's batch-size histogram over the run (GetInfo's
``batch_size_counts`` after minus before) and queue depth, and a timeline in
bins for plotting. matplotlib is imported only by `write_plot`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .loadtest_verifier import Samples
from .types import ServerInfo

# Scatter points in the latency plot at most: a long run would otherwise make a
# PNG that takes minutes to draw and shows nothing more.
MAX_PLOT_POINTS = 20_000
_PERCENTILES = (50, 90, 99)


def latency_stats(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean and p50/p90/p99/max in milliseconds (None when there are no samples)."""
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    if values.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(values, _PERCENTILES)
    return {
        "count": int(values.size),
        "mean": float(values.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(values.max()),
    }


def batch_histogram(before: ServerInfo, after: ServerInfo) -> dict[str, Any]:
    """The server's batched forwards during the run, by requests per batch."""
    counts = {
        size: after.batch_size_counts.get(size, 0) - before.batch_size_counts.get(size, 0)
        for size in sorted(after.batch_size_counts)
    }
    counts = {size: n for size, n in counts.items() if n > 0}
    batches = sum(counts.values())
    requests = sum(size * n for size, n in counts.items())
    return {
        # JSON object keys are strings; sorted by batch size.
        "counts": {str(size): n for size, n in counts.items()},
        "batches": batches,
        "requests": requests,
        "mean_batch": requests / batches if batches else 0.0,
    }


def timeline(samples: Samples, bin_s: float) -> list[dict[str, float | int]]:
    """Per time bin (seconds since the first step): steps, drafts/s, propose p50 / p99 ms."""
    if not samples.sent:
        return []
    sent = np.asarray(samples.sent) - samples.started
    latency = np.asarray(samples.propose, dtype=np.float64) * 1e3
    drafts = np.asarray(samples.drafts_per_step, dtype=np.int64)
    bins = np.floor(sent / bin_s).astype(np.int64)
    out = []
    for b in range(int(bins.max()) + 1):
        mask = bins == b
        if not mask.any():
            out.append({"t": b * bin_s, "steps": 0, "drafts_per_s": 0.0})
            continue
        p50, p99 = np.percentile(latency[mask], (50, 99))
        out.append(
            {
                "t": round(b * bin_s, 6),
                "steps": int(mask.sum()),
                "drafts_per_s": float(drafts[mask].sum() / bin_s),
                "p50_ms": float(p50),
                "p99_ms": float(p99),
            }
        )
    return out


def build_report(
    config: dict[str, Any],
    before: ServerInfo,
    after: ServerInfo,
    samples: Samples,
    queue: list[tuple[float, int]],
    warnings: list[str],
) -> dict[str, Any]:
    """The whole report; ``queue`` holds (time.monotonic(), queued_calls) samples."""
    steps = len(samples.sent)
    elapsed = samples.finished - samples.started if steps else 0.0

    def per_s(n: float) -> float:
        return n / elapsed if elapsed > 0 else 0.0

    depth = [q for t, q in queue if samples.started <= t <= samples.finished] or [
        q for _, q in queue
    ]
    bin_s = max(0.1, round(elapsed / 100, 1)) if elapsed else 1.0
    latency = {
        "propose": latency_stats(samples.propose),
        "step": latency_stats(samples.step),
    }
    if config.get("rate") is not None:
        latency["from_arrival"] = latency_stats(samples.waited)
    return {
        "config": config,
        "server": {
            "model_family": before.model_family,
            "hidden_size": before.hidden_size,
            "vocab_size": before.vocab_size,
            "device": before.device,
            "compute_dtype": before.compute_dtype,
            "max_batch": before.max_batch,
            "max_drafts": before.max_drafts,
        },
        "elapsed_s": elapsed,
        "steps": steps,
        "sequences": samples.sequences,
        "drafts": samples.drafts,
        "accepted": samples.accepted,
        "verdicts": samples.verdicts,
        "steps_per_s": per_s(steps),
        "drafts_per_s": per_s(samples.drafts),
        "accepted_per_s": per_s(samples.accepted),
        "acceptance_rate": samples.accepted / samples.drafts if samples.drafts else 0.0,
        "latency_ms": latency,
        "errors": dict(sorted(samples.errors.items())),
        "errors_by_rpc": dict(sorted(samples.errors_by_rpc.items())),
        "error_count": sum(samples.errors.values()),
        "arrivals_dropped": samples.arrivals_dropped,
        "arrivals_unserved": samples.arrivals_unserved,
        "server_batches": batch_histogram(before, after),
        "queued_calls": {
            "before": before.queued_calls,
            "after": after.queued_calls,
            "max": max(depth, default=0),
            "mean": float(np.mean(depth)) if depth else 0.0,
            "samples": len(depth),
        },
        "live_states_after": after.live_states,
        "timeline_bin_s": bin_s,
        "timeline": timeline(samples, bin_s),
        "warnings": warnings,
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary(report: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    c, lat = report["config"], report["latency_ms"]
    loop = f"open loop {c['rate']:g}/s" if c.get("rate") is not None else "closed loop"
    lines = [
        f"mtpdraft loadtest: {c['verifiers']} verifiers, {c['mode']}, {loop}, "
        f"K={c['num_drafts']}, accept {c['accept']}, {report['elapsed_s']:.2f} s",
        f"  steps {report['steps']} ({report['steps_per_s']:.1f}/s), drafts "
        f"{report['drafts']} ({report['drafts_per_s']:.1f}/s), acceptance "
        f"{report['acceptance_rate']:.3f}, sequences {report['sequences']}",
    ]
    for name, stats in lat.items():
        lines.append(
            f"  {name:<12} ms  p50 {_ms(stats['p50'])}  p90 {_ms(stats['p90'])}  "
            f"p99 {_ms(stats['p99'])}  max {_ms(stats['max'])}"
        )
    b = report["server_batches"]
    lines.append(
        f"  server: {b['batches']} batches, mean {b['mean_batch']:.2f} requests, "
        f"queued calls max {report['queued_calls']['max']}"
    )
    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"
    lines.append(f"  errors: {errors}")
    if report["arrivals_dropped"] or report["arrivals_unserved"]:
        lines.append(
            f"  arrivals dropped {report['arrivals_dropped']}, "
            f"unserved {report['arrivals_unserved']} (the server did not keep up)"
        )
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], samples: Samples, path: str | Path) -> None:
    """Latency over time (every step, and per-bin p50 / p99) and the batch-size histogram."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_batch) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    sent = np.asarray(samples.sent) - samples.started
    latency = np.asarray(samples.propose, dtype=np.float64) * 1e3
    if sent.size > MAX_PLOT_POINTS:
        keep = np.random.default_rng(0).choice(sent.size, MAX_PLOT_POINTS, replace=False)
        sent, latency = sent[keep], latency[keep]
    ax_lat.scatter(sent, latency, s=2, alpha=0.3, color="tab:blue", label="propose round trip")
    bins = [b for b in report["timeline"] if b["steps"]]
    if bins:
        mid = [b["t"] + report["timeline_bin_s"] / 2 for b in bins]
        ax_lat.plot(mid, [b["p50_ms"] for b in bins], color="tab:green", label="p50")
        ax_lat.plot(mid, [b["p99_ms"] for b in bins], color="tab:red", label="p99")
    if latency.size and latency.min() > 0:
        ax_lat.set_yscale("log")
    ax_lat.set_xlabel("seconds since the first step")
    ax_lat.set_ylabel("latency (ms)")
    c = report["config"]
    loop = f"open loop {c['rate']:g}/s" if c.get("rate") is not None else "closed loop"
    ax_lat.set_title(
        f"{c['verifiers']} verifiers, {c['mode']}, {loop}, K={c['num_drafts']}: "
        f"{report['drafts_per_s']:.0f} drafts/s"
    )
    ax_lat.legend(loc="upper right")
    counts = report["server_batches"]["counts"]
    sizes = [int(s) for s in counts]
    ax_batch.bar(sizes, list(counts.values()), width=0.8, color="tab:orange")
    ax_batch.set_xlabel("requests per batched forward")
    ax_batch.set_ylabel("batches")
    ax_batch.set_title(f"server batch sizes (mean {report['server_batches']['mean_batch']:.2f})")
    if sizes:
        ax_batch.set_xlim(0, max(sizes) + 1)
    fig.savefig(path, dpi=100)
    plt.close(fig)
