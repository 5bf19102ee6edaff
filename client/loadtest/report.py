"""The report of ``mtpdraft loadtest``: statistics, JSON, a text summary and a PNG plot.

The report is a plain dict (it is what ``--out`` writes): the configuration,
the server, throughput, latency percentiles in milliseconds (``propose`` from
the send; in open loop ``from_arrival``, from the scheduled arrival, so that
queueing behind a slow server counts: coordinated omission corrected), errors
by status code name (the warm-up's included), the server's batch-size histogram
over the measured run (GetInfo's ``batch_size_counts`` at the end minus at the
warm-up's end) and queue depth, the warm-up's steps (left out of every figure),
the measured window (and why it is not ``--duration`` long, when it is not),
why the run was cut short if it was, and a timeline in bins for plotting.
matplotlib is imported only by `plot_figure`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..types import ServerInfo
from .verifier import Samples

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


def timeline(
    samples: Samples, bin_s: float, open_loop: bool = False
) -> list[dict[str, float | int]]:
    """Per time bin (seconds since the first measured step): steps, steps/s, drafts/s,
    errors, propose p50 / p99 ms (and from the arrival in open loop). Errors after the
    last step (a server gone) extend it."""
    if not samples.sent:
        return []
    sent = np.asarray(samples.sent) - samples.started
    latency = np.asarray(samples.propose, dtype=np.float64) * 1e3
    waited = np.asarray(samples.waited, dtype=np.float64) * 1e3
    drafts = np.asarray(samples.drafts_per_step, dtype=np.int64)
    bins = np.floor(sent / bin_s).astype(np.int64)
    failed = np.asarray(samples.error_times) - samples.started
    error_bins = np.floor(failed[failed >= 0] / bin_s).astype(np.int64)
    last = max(int(bins.max()), int(error_bins.max(initial=0)))
    errors = np.bincount(error_bins, minlength=last + 1)
    out: list[dict[str, float | int]] = []
    for b in range(last + 1):
        mask = bins == b
        row: dict[str, float | int] = {
            "t": round(b * bin_s, 6),
            "steps": int(mask.sum()),
            "steps_per_s": float(mask.sum() / bin_s),
            "drafts_per_s": float(drafts[mask].sum() / bin_s),
            "errors": int(errors[b]),
        }
        if mask.any():
            row["p50_ms"], row["p99_ms"] = map(float, np.percentile(latency[mask], (50, 99)))
            if open_loop:
                p50, p99 = np.percentile(waited[mask], (50, 99))
                row["from_arrival_p50_ms"], row["from_arrival_p99_ms"] = float(p50), float(p99)
        out.append(row)
    return out


def measured_window(
    config: dict[str, Any], samples: Samples, cut_short: str | None
) -> dict[str, Any]:
    """The measured window: planned (``--duration``) and measured (the first measured
    step's start to the last answer), and ``note``, why they differ when they do by more
    than 1%."""
    planned = config.get("duration")
    steps = len(samples.sent)
    measured = samples.finished - samples.started if steps else 0.0
    window = {"planned_s": planned, "measured_s": measured, "note": None}
    if planned is None:
        return window
    requests = config.get("requests")
    if cut_short is not None:
        note = f"cut short after {measured:.2f} s of the {planned:g} s planned: {cut_short}"
    elif requests is not None and steps >= requests:
        note = f"--requests {requests} answered in {measured:.2f} s"
    elif not steps:
        note = f"no step was answered in the {planned:g} s of --duration"
    elif abs(measured - planned) <= 0.01 * planned:
        note = None
    else:
        first = samples.started - samples.warmup_until  # after the window opened
        last = samples.finished - (samples.warmup_until + planned)  # after it closed
        note = (
            f"{measured:.2f} s measured of --duration {planned:g} s: from the first measured "
            f"step, {first:.2f} s into the window, to the last answer, {last:+.2f} s from its "
            "end (steps under way then are waited for)"
        )
    return window | {"note": note}


def build_report(
    config: dict[str, Any],
    before: ServerInfo,
    after: ServerInfo,
    samples: Samples,
    queue: list[tuple[float, int]],
    warnings: list[str],
    *,
    cut_short: str | None = None,
    answered_after: bool = True,
    warmup_seconds: float | None = None,
) -> dict[str, Any]:
    """The whole report; ``queue`` holds (time.monotonic(), queued_calls) samples.

    ``before``: GetInfo at the warm-up's end (or the start); ``after``: at the end, or
    the last answered when the server no longer answered (``answered_after`` False).
    ``cut_short``: why the run ended early, if it did; ``warmup_seconds``: how long the
    warm-up took (None: it never ended).
    """
    steps = len(samples.sent)
    elapsed = samples.finished - samples.started if steps else 0.0

    def per_s(n: float) -> float:
        return n / elapsed if elapsed > 0 else 0.0

    depth = [q for t, q in queue if samples.started <= t <= samples.finished] or [
        q for _, q in queue
    ]
    bin_s = max(0.1, round(elapsed / 100, 1)) if elapsed else 1.0
    open_loop = config.get("rate") is not None
    latency = {
        "propose": latency_stats(samples.propose),
        "step": latency_stats(samples.step),
    }
    if open_loop:
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
        "cut_short": cut_short,
        "warmup": {
            "steps_per_verifier": config.get("warmup_steps", 0),
            "steps": samples.warmup_steps,
            "seconds": warmup_seconds,
        },
        "window": measured_window(config, samples, cut_short),
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
        "server_answered_at_end": answered_after,
        "live_states_after": after.live_states if answered_after else None,
        "timeline_bin_s": bin_s,
        "timeline": timeline(samples, bin_s, open_loop),
        "warnings": warnings,
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


_LATENCY_NAMES = {
    "propose": "from the send",
    "step": "the step's round trips",
    "from_arrival": "from the scheduled arrival",
}


def _loop(config: dict[str, Any]) -> str:
    return f"open loop {config['rate']:g}/s" if config.get("rate") is not None else "closed loop"


def _warmup(warmup: dict[str, Any]) -> str:
    if not warmup["steps_per_verifier"]:
        return "no warm-up"
    took = "did not end" if warmup["seconds"] is None else f"{warmup['seconds']:.2f} s"
    return (
        f"after a warm-up of {warmup['steps_per_verifier']} steps per verifier: "
        f"{warmup['steps']} steps, {took}, left out"
    )


def summary(report: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    c, lat = report["config"], report["latency_ms"]
    lines = [
        f"mtpdraft loadtest: {c['verifiers']} verifiers, {c['mode']}, {_loop(c)}, "
        f"K={c['num_drafts']}, accept {c['accept']}, {report['elapsed_s']:.2f} s "
        f"({_warmup(report['warmup'])})",
        f"  steps {report['steps']} ({report['steps_per_s']:.1f}/s), drafts "
        f"{report['drafts']} ({report['drafts_per_s']:.1f}/s), acceptance "
        f"{report['acceptance_rate']:.3f}, sequences {report['sequences']}",
    ]
    if report["cut_short"] is not None:
        lines.insert(1, f"  cut short: {report['cut_short']}")
    note = report.get("window", {}).get("note")
    if note is not None:
        lines.insert(1, f"  window: {note}")
    for name, stats in lat.items():
        lines.append(
            f"  {name:<12} ms  p50 {_ms(stats['p50'])}  p90 {_ms(stats['p90'])}  "
            f"p99 {_ms(stats['p99'])}  max {_ms(stats['max'])}  ({_LATENCY_NAMES[name]})"
        )
    b = report["server_batches"]
    seen = "" if report["server_answered_at_end"] else " (to the last GetInfo answered)"
    lines.append(
        f"  server: {b['batches']} batches, mean {b['mean_batch']:.2f} requests, "
        f"queued calls max {report['queued_calls']['max']}{seen}"
    )
    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"
    lines.append(f"  errors: {errors}")
    if report["arrivals_dropped"] or report["arrivals_unserved"]:
        why = "the run was cut short" if report["cut_short"] else "the server did not keep up"
        lines.append(
            f"  arrivals dropped {report['arrivals_dropped']}, "
            f"unserved {report['arrivals_unserved']} ({why})"
        )
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def _wide(values: np.ndarray) -> bool:
    """Latencies spanning more than 10x: a log axis keeps the tail and the bulk readable."""
    return bool(values.size) and values.min() > 0 and values.max() / values.min() > 10


def _log_axis(ax: Any, which: str) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 10, not 10^1
    axis.set_minor_formatter(NullFormatter())


def plot_figure(report: dict[str, Any], samples: Samples) -> Any:
    """The run at a glance, a matplotlib Figure of four panels: latency over time (every
    step, per-bin p50 / p99), the latency histogram, throughput over time and the server's
    batch sizes. Open loop adds the latency from the scheduled arrival."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    fig = Figure(figsize=(14, 9), layout="constrained")
    (ax_lat, ax_hist), (ax_rate, ax_batch) = fig.subplots(2, 2)
    c, lat = report["config"], report["latency_ms"]
    title = (
        f"mtpdraft loadtest: {c['verifiers']} verifiers, {c['mode']}, {_loop(c)}, "
        f"K={c['num_drafts']}: {report['drafts_per_s']:.0f} drafts/s, "
        f"propose p50 {_ms(lat['propose']['p50'])} ms"
    )
    if report["cut_short"] is not None:
        title += f"; cut short: {report['cut_short']}"
    fig.suptitle(title)
    open_loop = "from_arrival" in lat
    bins = [b for b in report["timeline"] if b["steps"]]
    mid = [b["t"] + report["timeline_bin_s"] / 2 for b in bins]
    seconds = "seconds since the first measured step"

    sent = np.asarray(samples.sent) - samples.started
    latency = np.asarray(samples.propose, dtype=np.float64) * 1e3
    if sent.size > MAX_PLOT_POINTS:
        keep = np.random.default_rng(0).choice(sent.size, MAX_PLOT_POINTS, replace=False)
        sent, latency = sent[keep], latency[keep]
    ax_lat.scatter(sent, latency, s=2, alpha=0.3, color="tab:blue", label="propose round trip")
    if bins:
        ax_lat.plot(mid, [b["p50_ms"] for b in bins], color="tab:green", label="p50")
        ax_lat.plot(mid, [b["p99_ms"] for b in bins], color="tab:red", label="p99")
        if open_loop:
            ax_lat.plot(
                mid, [b["from_arrival_p99_ms"] for b in bins], color="tab:purple",
                linestyle="--", label="p99 from arrival",
            )  # fmt: skip
    if _wide(latency):
        _log_axis(ax_lat, "y")
    ax_lat.set(title="propose latency over time", xlabel=seconds, ylabel="latency (ms)")
    ax_lat.legend(loc="upper right")

    propose = np.asarray(samples.propose, dtype=np.float64) * 1e3
    if propose.size:
        waited = np.asarray(samples.waited, dtype=np.float64) * 1e3
        shown = np.concatenate([propose, waited]) if open_loop else propose
        lo, hi, wide = shown.min(), shown.max(), _wide(shown)
        edges = np.geomspace(lo, hi, 60) if wide else np.linspace(lo, max(hi, lo + 1e-3), 60)
        ax_hist.hist(propose, bins=edges, color="tab:blue", alpha=0.7, label="from the send")
        if open_loop:
            ax_hist.hist(
                waited, bins=edges, histtype="step", color="tab:purple",
                label="from the scheduled arrival",
            )  # fmt: skip
        if wide:
            _log_axis(ax_hist, "x")
        for name, colour in (("p50", "tab:green"), ("p99", "tab:red")):
            value = lat["propose"][name]
            ax_hist.axvline(value, color=colour, label=f"{name} {value:.3f} ms")
        ax_hist.legend(loc="upper right")
    ax_hist.set(title="propose latency histogram", xlabel="latency (ms)", ylabel="steps")

    rows = report["timeline"]
    t = [b["t"] + report["timeline_bin_s"] / 2 for b in rows]
    ax_rate.plot(t, [b["drafts_per_s"] for b in rows], color="tab:blue", label="drafts/s")
    ax_rate.plot(t, [b["steps_per_s"] for b in rows], color="tab:green", label="steps/s")
    if report["error_count"]:
        errors = [b["errors"] / report["timeline_bin_s"] for b in rows]
        ax_rate.plot(t, errors, color="tab:red", label="errors/s")
    ax_rate.set(title="throughput over time", xlabel=seconds, ylabel="per second")
    ax_rate.set_ylim(bottom=0)
    ax_rate.legend(loc="upper right")

    counts = report["server_batches"]["counts"]
    sizes = [int(size) for size in counts]
    ax_batch.bar(sizes, list(counts.values()), width=0.8, color="tab:orange")
    ax_batch.set(
        title=f"server batch sizes (mean {report['server_batches']['mean_batch']:.2f})",
        xlabel="requests per batched forward",
        ylabel="batches",
    )
    if sizes:
        ax_batch.set_xlim(0, max(sizes) + 1)
    return fig


def write_plot(report: dict[str, Any], samples: Samples, path: str | Path) -> None:
    """`plot_figure` as a PNG at 100 dpi."""
    plot_figure(report, samples).savefig(path, dpi=100)
