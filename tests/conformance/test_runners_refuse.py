"""Every conformance runner refuses a vector it cannot replay, before any call.

A runner that replayed an empty vector, or one without a tolerance, would pass
while checking nothing (so would an empty ProposeStream, or a batch without
states). Each runner (Python, Node.js, Go, C++) gets a few
malformed copies of vector.json and must exit 2 and say why ("bad vector" and
the fault) on stderr, with no server at its address. The Node.js, Go and C++
runners are skipped where they are not built (`make -f client/polyglot.mk
polyglot`; .ci/polyglot.sh builds them before it runs this).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vector_runner import VECTOR_PATH, VectorError, check_vector, load_vector

ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "127.0.0.1:9"  # the discard port: a runner that calls it fails otherwise


def _without(key: str):
    return lambda v: v.pop(key)


def _set(key: str, value: Any):
    return lambda v: v.__setitem__(key, value)


def _first_op(value: dict[str, Any]):
    return lambda v: v["operations"].insert(0, value)


def _empty_stream(v: dict[str, Any]) -> None:
    next(op for op in v["operations"] if op["op"] == "ProposeStream")["messages"] = []


def _change(name: str, change: Any):
    """Applies `change` to the vector's first operation named `name`."""
    return lambda v: change(next(op for op in v["operations"] if op["op"] == name))


def _first_message(change: Any):
    """Applies `change` to the first message of the vector's first ProposeStream."""
    return _change("ProposeStream", lambda op: change(op["messages"][0]))


#: name: (how the vector is broken, a word the refusal must contain)
MALFORMED = {
    "empty-operations": (_set("operations", []), "operations"),
    "no-operations": (_without("operations"), "operations"),
    "wrong-format": (_set("format", "mtpdraft-conformance/0"), "format"),
    "no-format": (_without("format"), "format"),
    "unknown-op": (_first_op({"op": "Frobnicate", "state": "A"}), "unknown op"),
    "op-without-name": (_first_op({"state": "A"}), "unknown op"),
    "no-prob-tolerance": (_without("prob_tolerance"), "prob_tolerance"),
    "negative-prob-tolerance": (_set("prob_tolerance", -0.5), "prob_tolerance"),
    "stream-without-messages": (_empty_stream, "messages"),
    "batch-without-states": (_change("ProposeBatch", _without("states")), "states"),
    "batch-without-hiddens": (_change("ProposeBatch", _without("hiddens")), "hiddens"),
    "message-without-states": (_first_message(_set("states", [])), "states"),
    "message-without-hiddens": (_first_message(_without("hiddens")), "hiddens"),
}

RUNNERS = {
    "python": ([sys.executable, str(ROOT / "tests/conformance/vector_runner.py")], "--"),
    "node": (["node", str(ROOT / "client/node/conformance.js")], "--"),
    "go": ([str(ROOT / "client/go/build/bin/mtpdraft-conformance")], "-"),
    "cpp": ([str(ROOT / "client/cpp/build/mtpdraft-conformance")], "--"),
}


def _missing(runner: str) -> str | None:
    """Why `runner` cannot run here, or None."""
    if runner == "node":
        if shutil.which("node") is None:
            return "node is not installed"
        if not (ROOT / "client/node/node_modules").is_dir():
            return "client/node has no node_modules (npm ci)"
    elif runner in ("go", "cpp") and not Path(RUNNERS[runner][0][0]).is_file():
        return f"{RUNNERS[runner][0][0]} is not built"
    return None


def _refusal(runner: str, path: Path) -> str:
    """The runner's stderr on the vector at `path`; fails unless it exits 2."""
    if why := _missing(runner):
        pytest.skip(why)
    command, dash = RUNNERS[runner]
    done = subprocess.run(
        [*command, f"{dash}address", NOWHERE, f"{dash}vector", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "bad vector" in done.stderr, done.stderr
    return done.stderr


def _broken(case: str) -> dict[str, Any]:
    vector = copy.deepcopy(load_vector())
    MALFORMED[case][0](vector)
    return vector


def test_the_vector_itself_is_well_formed() -> None:
    check_vector(load_vector(VECTOR_PATH))


@pytest.mark.parametrize("case", MALFORMED)
def test_python_check_refuses(case: str) -> None:
    with pytest.raises(VectorError, match=MALFORMED[case][1]):
        check_vector(_broken(case))


@pytest.mark.parametrize("case", MALFORMED)
@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_refuses(runner: str, case: str, tmp_path: Path) -> None:
    path = tmp_path / "vector.json"
    path.write_text(json.dumps(_broken(case)))
    assert MALFORMED[case][1] in _refusal(runner, path)


@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_refuses_text_that_is_not_json(runner: str, tmp_path: Path) -> None:
    path = tmp_path / "vector.json"
    path.write_text('{"format": "mtpdraft-conformance/4", "operations": [')
    _refusal(runner, path)
