"""The Node.js, Go and C++ sampling runners (each client's accept against
sampling_vector.json, no server) pass the vector, fail it where one expectation is changed,
report the inputs accept refuses by the value at fault, and refuse (exit 2, "bad vector") a
vector they cannot check: one that would check nothing passes nothing. Skipped where a
runner is not built (`make -f client/polyglot.mk polyglot`)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from make_sampling_vector import VECTOR_PATH

ROOT = Path(__file__).resolve().parents[2]
VECTOR = json.loads(VECTOR_PATH.read_text())
RUNNERS = {
    "node": (["node", str(ROOT / "client/node/sampling_conformance.js")], "--"),
    "go": ([str(ROOT / "client/go/build/bin/mtpdraft-sampling")], "-"),
    "cpp": ([str(ROOT / "client/cpp/build/mtpdraft-sampling")], "--"),
}


def _run(runner: str, vector: dict[str, Any] | str, tmp_path: Path):
    command, dash = RUNNERS[runner]
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        pytest.skip(f"{command[0]} is not here")
    path = tmp_path / "sampling_vector.json"
    path.write_text(vector if isinstance(vector, str) else json.dumps(vector))
    return subprocess.run(
        [*command, f"{dash}vector", str(path)], capture_output=True, text=True, timeout=60
    )


def _changed(name: str, change) -> dict[str, Any]:
    vector = copy.deepcopy(VECTOR)
    change(next(c for c in vector["cases"] if c["name"] == name))
    return vector


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_runner_passes_the_vector(runner: str, tmp_path: Path) -> None:
    done = _run(runner, VECTOR, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{runner}: {len(VECTOR['cases'])} passed, 0 failed" in done.stdout


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_runner_fails_a_changed_expectation(runner: str, tmp_path: Path) -> None:
    def change(case: dict) -> None:
        case["expect"]["next_tokens"][1] += 1

    done = _run(runner, _changed("edge-uniforms", change), tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL edge-uniforms" in done.stdout
    assert f"{len(VECTOR['cases']) - 1} passed, 1 failed" in done.stdout


#: name: (the case changed, how, what the runner's report of accept's refusal must say)
REFUSED_INPUTS = {
    "count-past-K": ("short-counts", lambda c: c["counts"].__setitem__(1, 5), "counts[1] = 5"),
    "draft-past-V": ("greedy", lambda c: c["drafts"][0].__setitem__(1, 99), "drafts[0][1] = 99"),
    "uniform-1": ("sparse", lambda c: c["uniforms"][1].__setitem__(2, 1.0), "uniforms[1][2] = 1"),
}


@pytest.mark.parametrize("fault", REFUSED_INPUTS)
@pytest.mark.parametrize("runner", RUNNERS)
def test_accept_refuses_bad_inputs(runner: str, fault: str, tmp_path: Path) -> None:
    name, change, says = REFUSED_INPUTS[fault]
    done = _run(runner, _changed(name, change), tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith(f"FAIL {name}"))
    assert says in line


def _first_case(change):
    def apply(vector: dict[str, Any]) -> None:
        change(vector["cases"][0])

    return apply


#: name: (how the vector is broken, a word the refusal must contain)
MALFORMED = {
    "wrong-format": (lambda v: v.__setitem__("format", "mtpdraft-sampling/0"), "format"),
    "no-format": (lambda v: v.pop("format"), "format"),
    "no-cases": (lambda v: v.pop("cases"), "cases"),
    "empty-cases": (lambda v: v.__setitem__("cases", []), "cases"),
    "case-without-q_probs": (_first_case(lambda c: c.pop("q_probs")), "q_probs"),
    "case-with-empty-drafts": (_first_case(lambda c: c.__setitem__("drafts", [])), "drafts"),
    "case-without-expect": (_first_case(lambda c: c.pop("expect")), "expect"),
    "expect-short": (_first_case(lambda c: c["expect"]["next_tokens"].pop()), "expect"),
}


@pytest.mark.parametrize("case", MALFORMED)
@pytest.mark.parametrize("runner", RUNNERS)
def test_the_runner_refuses_a_malformed_vector(runner: str, case: str, tmp_path: Path) -> None:
    vector = copy.deepcopy(VECTOR)
    MALFORMED[case][0](vector)
    done = _run(runner, vector, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "bad vector" in done.stderr and MALFORMED[case][1] in done.stderr, done.stderr


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_runner_refuses_text_that_is_not_json(runner: str, tmp_path: Path) -> None:
    done = _run(runner, '{"format": "mtpdraft-sampling/1", "cases": [', tmp_path)
    assert done.returncode == 2 and "bad vector" in done.stderr, done.stdout + done.stderr
