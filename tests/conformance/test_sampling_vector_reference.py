"""sampling_vector.json is what make_sampling_vector.py writes, its expectations are the
exact reference's (acceptance_reference.py, not the clients' code), every decision in it
clears the gap that makes float64 ports agree, and its cases reach every path of the rule."""

from __future__ import annotations

import json

import pytest
from acceptance_reference import MIN_GAP, row_verdict, verdicts
from make_sampling_vector import VECTOR_PATH, build_vector, dumps

VECTOR = json.loads(VECTOR_PATH.read_text())


def test_the_file_is_what_the_script_writes() -> None:
    assert VECTOR_PATH.read_text() == dumps(build_vector())


@pytest.mark.parametrize("case", VECTOR["cases"], ids=[c["name"] for c in VECTOR["cases"]])
def test_expectations_are_the_exact_references(case: dict) -> None:
    exact, plain = verdicts(case, exact=True), verdicts(case, exact=False)
    want = {
        "num_accepted": [v.num_accepted for v in exact],
        "next_tokens": [v.next_token for v in exact],
    }
    assert case["expect"] == want
    assert [(v.num_accepted, v.next_token) for v in plain] == [
        (v.num_accepted, v.next_token) for v in exact
    ]
    assert min(v.gap for v in exact) >= MIN_GAP


def test_the_reference_by_hand() -> None:
    """Row 0: draft 1 has p 0.2, q 0.5, kept at u = 0.3 (< 0.4); draft 2 has p 0.6, q 1,
    refused at u = 0.7; the next token comes from max(p - q, 0) = (0.3, 0.1, 0) / 0.4 at
    u = 0.8: token 1. Row 1 keeps its one draft (p >= q) and draws the bonus token from
    (0.1, 0.1, 0.8) at u = 0.05: token 0."""
    target0 = [[0.5, 0.2, 0.3], [0.3, 0.1, 0.6], [1, 0, 0]]
    got = row_verdict([1, 2], [[1, 0], [2, 0]], [[0.5, 0.5], [1.0, 0.0]], target0, 2,
                      [0.3, 0.7, 0.8], exact=True)  # fmt: skip
    assert (got.num_accepted, got.next_token, got.source) == (1, 1, "residual")
    target1 = [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1, 0, 0]]
    got = row_verdict([0, 0], [[0, 1], [0, 1]], [[0.6, 0.4], [1.0, 0.0]], target1, 1,
                      [0.9, 0.0, 0.05], exact=True)  # fmt: skip
    assert (got.num_accepted, got.next_token, got.source) == (1, 0, "bonus")


def _rows(case: dict):
    """(case, row, its count, its verdict) of every row of the vector."""
    k = len(case["drafts"][0])
    counts = case.get("counts") or [k] * len(case["drafts"])
    yield from zip(range(len(counts)), counts, verdicts(case), strict=True)


def test_the_cases_reach_every_path() -> None:
    seen: set[str] = set()
    for case in VECTOR["cases"]:
        k, vocab = len(case["drafts"][0]), len(case["target_probs"][0][0])
        assert len(case["drafts"]) <= 4 and k <= 4 and 8 <= vocab <= 16
        widths = {len(ids) for row in case["q_ids"] for ids in row}
        seen |= {"T=1"} if widths == {1} else {"T=V"} if widths == {vocab} else set()
        seen |= {"counts absent"} if "counts" not in case else set()
        for row, count, verdict in _rows(case):
            seen |= {verdict.source, f"kept {verdict.num_accepted}"}
            seen |= {"count 0"} if count == 0 else {"count < K"} if count < k else set()
            u = case["uniforms"][row]
            seen |= {"u = 0 next"} if u[k] == 0 else set()
            for j in range(min(verdict.num_accepted + 1, count)):
                d, ids = case["drafts"][row][j], case["q_ids"][row][j]
                kept = "kept" if j < verdict.num_accepted else "refused"
                if d not in ids:
                    seen.add(f"outside q {kept}")
                if u[j] == 0:
                    seen.add(f"u = 0 {kept}")
    assert seen >= {
        "bonus", "residual", "target", "T=1", "T=V", "counts absent", "count 0", "count < K",
        "outside q kept", "outside q refused", "u = 0 kept", "u = 0 refused", "u = 0 next",
        *(f"kept {a}" for a in range(5)),
    }  # fmt: skip
