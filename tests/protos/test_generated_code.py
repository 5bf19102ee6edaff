"""The generated Python in protos/ is exactly what `make proto` makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
GENERATED = ("drafter_pb2.py", "drafter_pb2.pyi", "drafter_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.glob("mtpdraft/v1/*.proto"))
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}"]
    cmd += [f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    subprocess.run([*cmd, *sources], check=True, cwd=PROTOS)
    for name in GENERATED:
        fresh = (tmp_path / "mtpdraft" / "v1" / name).read_text()
        committed = (PROTOS / "mtpdraft" / "v1" / name).read_text()
        if fresh != committed:
            pytest.fail(f"protos/mtpdraft/v1/{name} is stale: run `make proto`")
