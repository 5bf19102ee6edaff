"""The service bench's markdown, re-rendered from a committed report (no GPU needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_render_rewrites_the_markdown_with_the_floor_column(tmp_path: Path) -> None:
    report_path = tmp_path / "service.json"
    shutil.copy(ROOT / "bench/results/service.json", report_path)
    script = ROOT / "bench/bench_service.py"
    subprocess.run([sys.executable, script, "--render", report_path], check=True, timeout=120)

    report = json.loads(report_path.read_text())
    b1 = report["in_process"]["batched"]["1"]["p50_us"]
    floor = report["floor"]["b1_after_step"]["p50_us"] - b1
    stream = report["grpc"]["tracing_off"]["stream_b1"]["p50_us"] - b1
    rows = (tmp_path / "service.md").read_text().splitlines()
    assert "over the canned-reply floor" in next(r for r in rows if r.startswith("| batch 1 |"))
    first = next(r for r in rows if r.startswith("| ProposeStream |"))
    assert first.endswith(f"| +{stream - floor:.1f} us |")
    assert f"Command: `{report['command']}`" in rows


def test_repeated_starts_are_reported_by_median_and_range() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_service

    report = json.loads((ROOT / "bench/results/service.json").read_text())
    engine = report["in_process"]["batched"]["64"]["drafts_per_s"]
    report["repeats"] = {
        "streams": 64,
        "client": "Go",
        "starts": 3,
        "drafts_per_s": {"tracing_off": [16300.0, 21600.0, 19000.0]},
    }
    report["ratios"] = bench_service.ratios(report)
    got = report["ratios"]["repeats"]["tracing_off"]
    assert (got["median"], got["min"], got["max"]) == (19000.0, 16300.0, 21600.0)
    assert got["median_over_batched"] == 19000.0 / engine
    rows = bench_service.markdown(report).splitlines()
    assert "| 64 streams, Go client, on 3 server starts |" in "\n".join(rows)
    assert (
        f"| tracing off | 16300, 21600, 19000 | 19000 | 16300 - 21600 | {19000 / engine:.2f}x |"
        in rows
    )
