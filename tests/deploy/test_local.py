"""deploy/local.py names what the topology needs and the host lacks, before it starts
anything: one line each, with how to get it, no traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from manifests import DEPLOY, local


@pytest.fixture
def no_replica_starts(monkeypatch: pytest.MonkeyPatch) -> list:
    started: list = []
    monkeypatch.setattr(local, "start_replicas", lambda *args: started.append(args) or [])
    return started


def test_without_nginx_on_path_it_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    no_replica_starts: list,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH that lacks nginx
    monkeypatch.setattr(local, "NGINX_ELSEWHERE", (str(tmp_path / "sbin" / "nginx"),))
    assert local.main(["--replicas", "1", "--", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "local: nginx is not installed (not on PATH, nor /usr/sbin): apt-get install nginx\n"
    )
    assert no_replica_starts == []


def test_a_missing_module_is_named_with_its_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, no_replica_starts: list
) -> None:
    monkeypatch.setattr(local, "find_nginx", lambda: "/usr/sbin/nginx")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        local.importlib.util, "find_spec", lambda name: None if name == "torch" else find_spec(name)
    )
    assert local.main(["--replicas", "1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"local: torch cannot be imported by {sys.executable}: ")
    assert line.endswith(": pip install torch (README.md, Set up)")
    assert no_replica_starts == []


def test_the_script_itself_ends_in_lines_not_a_traceback(tmp_path: Path) -> None:
    # An interpreter without the package (no venv's site): it lacks mtpdraft whatever the
    # host has; nginx's line comes too where nginx is not installed.
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(DEPLOY / "local.py"), "--replicas", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(tmp_path)},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert all(line.startswith("local: ") for line in lines) and lines
    assert any(line.startswith("local: mtpdraft cannot be imported by ") for line in lines)
