"""The benches that run on the CPU finish and write what they promise (tiny shapes; the
figures themselves are the GPU runs', never judged here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, *args: str, scratch: Path | None = None) -> subprocess.CompletedProcess:
    """Runs bench/SCRIPT ARGS; its temporary files go under `scratch` where given."""
    env = os.environ if scratch is None else {**os.environ, "TMPDIR": str(scratch)}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parent,
        env=env,
    )


def test_host_cost_times_every_stage(tmp_path: Path) -> None:
    done = _run("host_cost.py", "--shapes", "4x64", "--iters", "3", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "host_cost.json").read_text())
    stages = report["shapes"]["4x64"]
    assert stages["request bytes"] > 4 * 64 * 2
    assert all(v > 0 for k, v in stages.items())
    assert "| client: build the request |" in (tmp_path / "host_cost.md").read_text()
    for before, more in (
        ("idle", ["--idle-ms", "1"]),
        ("busy", ["--idle-ms", "1"]),
        ("sweep", ["--sweep-mb", "8"]),
    ):
        args = ["--shapes", "4x64", "--iters", "3", "--before", before, *more]
        done = _run("host_cost.py", *args, "--out-dir", str(tmp_path))
        assert done.returncode == 0, done.stderr
        report = json.loads((tmp_path / f"host_cost_{before}.json").read_text())
        assert report["shapes"]["4x64"]["client: parse the answer"] > 0
        assert report["before"] in (tmp_path / f"host_cost_{before}.md").read_text()


def test_bench_verifier_measures_every_way_and_judges_the_targets(tmp_path: Path) -> None:
    args = ["--small", "--device", "cpu", "--shapes", "1x2,2x1", "--steps", "2", "--warmup", "1"]
    args += ["--rounds", "2", "--out-dir", str(tmp_path)]
    # A short path: a Unix socket's is at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="bv-") as scratch:
        done = _run("bench_verifier.py", *args, scratch=Path(scratch))
        assert done.returncode == 0, done.stderr[-2000:]
        assert not os.listdir(scratch)  # its checkpoint and sockets removed at exit
    report = json.loads((tmp_path / "verifier.json").read_text())
    row = report["shapes"]["1x2"]
    assert row["in_process"]["kernel_only"]["drafts_per_s"] > 0
    for way in ("batch", "stream", "many", "stream, unix socket"):
        assert row[way].get("drafts_per_s", 0) > 0, (way, row[way])
    assert set(report["floor"]["1x2"]) == {"tcp", "unix"}
    # Tracing against off, in rounds, at the largest shapes.
    traced = row["stream, tracing on (median round)"]
    assert len(traced["rounds"]) == 2 and traced["median_on_off"] > 0
    assert "tracing on: off / on drafts/s" in (tmp_path / "verifier.md").read_text()
    assert report["targets"] and all("met" in t for t in report["targets"])


def test_timeline_stamps_every_hop_wherever_the_batch_runs(tmp_path: Path) -> None:
    runs = (
        ("engine-thread", [], "engine_thread"),
        ("loop", ["--chain-ms", "1"], "loop_waited_chain"),
        ("loop", ["--awake"], "loop_awake"),
        ("loop", ["--awake", "server"], "loop_awake_server"),
    )
    for where, more, name in runs:
        args = ["--small", "--device", "cpu", "--batch", "2", "--steps", "3", *more]
        done = _run("timeline_served_step.py", *args, "--batches-on", where, "--out-dir",
                    str(tmp_path))  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((tmp_path / f"timeline_stream_{name}_2.json").read_text())
        hops = {h["hop"]: h["p50_us"] for h in report["report"]["hops"]}
        assert "server: to the engine (a thread hop, none inline)" in hops
        assert (
            "engine: record the proposals' drafts, the answer" in hops
            and "client: read the answer" in hops
        )
        assert all(not math.isnan(p50) for p50 in hops.values()), hops  # every hop stamped
        assert where.replace("-", " ") in report["way"]


def test_tracing_calls_counts_the_loops_calls_off_and_on(tmp_path: Path) -> None:
    args = ["--streams", "2", "--messages", "3", "--out-dir", str(tmp_path)]
    done = _run("tracing_calls.py", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "tracing_calls.json").read_text())
    # The instrumentation's stream wrapper runs only with tracing on.
    wrapper = [k for k in report["on"] if k.endswith(":_stream_interceptor")]
    assert wrapper and not any(k in report["off"] for k in wrapper)
    assert "_stream_interceptor` |" in (tmp_path / "tracing_calls.md").read_text()


def test_bench_families_reports_every_family_against_its_roofline(tmp_path: Path) -> None:
    args = ["--small", "--device", "cpu", "--batches", "1,4", "--context", "64", "--iters", "2"]
    done = _run("bench_families.py", *args, "--no-compile", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "families.json").read_text())
    assert set(report["families"]) == {"glm-4.5-air", "qwen3-next-80b", "deepseek-v3"}
    for family in report["families"].values():
        assert [r["batch"] for r in family["rows"]] == [1, 4]
        assert all(r["roofline_ms"] > 0 and 1 <= r["experts_touched"] <= 8 for r in family["rows"])
    assert "| batch | context | experts touched |" in (tmp_path / "families.md").read_text()


def test_bench_moe_kernel_writes_its_table(tmp_path: Path) -> None:
    done = _run("bench_moe_kernel.py", "--small", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "moe_kernel.json").read_text())
    table = (tmp_path / "moe_kernel.md").read_text()
    assert report and "| model |" in table and "distinct experts" in table and "(FP8)" in table


def test_bench_draw_times_every_piece_and_checks_the_support(tmp_path: Path) -> None:
    done = _run("bench_draw.py", "--small", "--batches", "1,2", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "draw.json").read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    assert all(us > 0 for row in report["rows"] for us in row["us"].values())
    assert report["top_support_exact"] == {"1": True, "2": True}
    assert "| B | one read of the logits (roofline) |" in (tmp_path / "draw.md").read_text()
