"""A benchmark's report as it is committed: <stem>.json and <stem>.md in one folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(folder: str | Path, stem: str, report: dict[str, Any], text: str) -> None:
    """Writes `report` as <stem>.json and `text` (its table) as <stem>.md under `folder`,
    made if missing."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(text)
