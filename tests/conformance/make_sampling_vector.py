"""Writes tests/conformance/sampling_vector.json: the verifier's acceptance rule (the Python
client's sampling.accept, and its Go, Node.js and C++ ports) case by case.

    python3 tests/conformance/make_sampling_vector.py [--check]

Inputs come from seeded generators, one a case; the uniforms are chosen so that each row
keeps the drafts its case asks for, or lie just off a decision's boundary (1e-9 relative,
far beyond float64's rounding, far inside any sloppiness a port might have). Expectations
come from acceptance_reference.py (exact rational arithmetic over the float64 inputs, never
the code under test), which must agree with its own plain float64 run, and every deciding
comparison must clear its MIN_GAP, so that any float64 implementation decides alike.
`--check` only compares a fresh vector with the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from acceptance_reference import MIN_GAP, verdicts

VECTOR_PATH = Path(__file__).with_name("sampling_vector.json")
FORMAT = "mtpdraft-sampling/1"
NEAR = 1e-9  # how far off a boundary an edge case's uniform lies, relatively

RULES = [
    f"Refuse, with a non-zero exit, a vector whose format is not {FORMAT!r}, whose cases are "
    "missing or empty, or with a case that lacks drafts, q_ids, q_probs, target_probs, "
    "uniforms or expect.",
    "Per case: accept(drafts [B][K], q_ids [B][K][T], q_probs [B][K][T], target_probs "
    "[B][K+1][V], counts [B] (absent: every row K), uniforms [B][K+1]) must give exactly "
    "expect.num_accepted [B] and expect.next_tokens [B].",
    "Floats are float64, written as the shortest decimal that reads back as the same double.",
]


@dataclass
class Row:
    """One row's inputs, filled draft by draft."""

    drafts: list[int] = field(default_factory=list)
    q_ids: list[list[int]] = field(default_factory=list)
    q_probs: list[list[float]] = field(default_factory=list)
    target: list[list[float]] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)

    def ratio(self, j: int) -> float:
        """p_j(d) / q_j(d) of draft j (inf outside q's support)."""
        d = self.drafts[j]
        q = sum(p for i, p in zip(self.q_ids[j], self.q_probs[j], strict=True) if i == d)
        return self.target[j][d] / q if q else float("inf")


def distribution(rng: np.random.Generator, n: int, peak: float = 1.5, zeros=()) -> np.ndarray:
    weights = np.exp(peak * rng.standard_normal(n))
    weights[list(zeros)] = 0.0
    return weights / weights.sum()


def support(rng: np.random.Generator, vocab: int, size: int, width: int):
    """A sparse q: `size` distinct ids and their probabilities, padded to `width` (the
    padding repeats the first id at probability 0)."""
    ids = rng.choice(vocab, size, replace=False)
    probs = distribution(rng, size)
    pad = width - size
    return [*ids.tolist(), *[int(ids[0])] * pad], [*probs.tolist(), *[0.0] * pad]


def keep_uniform(rng: np.random.Generator, ratio: float) -> float:
    """A uniform that keeps a draft whose p / q is `ratio`."""
    return float(rng.uniform(0.05, 0.95) * min(ratio, 1.0))


def refuse_uniform(rng: np.random.Generator, ratio: float) -> float:
    assert ratio < 1, "a draft with p >= q is always kept"
    return float(ratio + (1 - ratio) * rng.uniform(0.05, 0.95))


def sampled_row(
    rng: np.random.Generator,
    vocab: int,
    k: int,
    sizes: list[int],
    width: int,
    count: int,
    accepted: int,
) -> Row:
    """A row of drafts drawn from sparse q's (support sizes `sizes`, padded to `width`),
    with uniforms that keep the first `accepted` of its `count` drafts and refuse the next
    (a draft chosen among the support's ids with p < q)."""
    row = Row()
    for j in range(k):
        ids, probs = support(rng, vocab, sizes[j], width)
        target = distribution(rng, vocab)
        row.q_ids.append(ids)
        row.q_probs.append(probs)
        row.target.append(target.tolist())
        if j == accepted and j < count:
            refusable = [i for i, q in zip(ids, probs, strict=True) if q > target[i]]
            row.drafts.append(int(rng.choice(refusable)))
            row.uniforms.append(refuse_uniform(rng, row.ratio(j)))
        else:
            row.drafts.append(int(rng.choice(ids[: sizes[j]], p=probs[: sizes[j]])))
            row.uniforms.append(keep_uniform(rng, row.ratio(j)))
    row.target.append(distribution(rng, vocab).tolist())
    row.uniforms.append(float(rng.random()))
    return row


def case(name: str, about: str, rows: list[Row], counts: list[int] | None) -> dict:
    made = {
        "name": name,
        "about": about,
        "drafts": [r.drafts for r in rows],
        "q_ids": [r.q_ids for r in rows],
        "q_probs": [r.q_probs for r in rows],
        "target_probs": [r.target for r in rows],
        "uniforms": [r.uniforms for r in rows],
    }
    if counts is not None:
        made["counts"] = counts
    return made


def greedy() -> dict:
    rng = np.random.default_rng(101)
    vocab, k = 10, 3
    rows = []
    for accepted in range(k + 1):
        row = Row()
        for j in range(k):
            target = distribution(rng, vocab)
            d = int(np.argmax(target)) if j % 2 == 0 else int(rng.integers(vocab))
            row.drafts.append(d)
            row.q_ids.append([d])
            row.q_probs.append([1.0])
            row.target.append(target.tolist())
            keep = j < accepted
            row.uniforms.append((keep_uniform if keep else refuse_uniform)(rng, row.ratio(j)))
        row.target.append(distribution(rng, vocab).tolist())
        row.uniforms.append(float(rng.random()))
        rows.append(row)
    return case(
        "greedy",
        "one-hot q (T = 1): a draft is kept when u < p(draft); rows keep 0, 1, 2, 3 drafts; "
        "counts absent (every row K)",
        rows,
        None,
    )


def sparse() -> dict:
    rng = np.random.default_rng(102)
    vocab, k, width = 16, 4, 8
    rows = [
        sampled_row(rng, vocab, k, [int(s) for s in rng.integers(3, 9, k)], width, k, accepted)
        for accepted in (1, 4, 2, 0)
    ]
    return case(
        "sparse",
        "sampled drafts, q with supports of 3 to 8 ids padded to T = 8 (probability 0)",
        rows,
        [k] * 4,
    )


def full() -> dict:
    rng = np.random.default_rng(103)
    vocab, k = 12, 3
    rows = [sampled_row(rng, vocab, k, [vocab] * k, vocab, k, a) for a in (3, 0, 2)]
    return case(
        "full",
        "q over the whole vocabulary (T = V), its ids in a shuffled order",
        rows,
        [k] * 3,
    )


def short_counts() -> dict:
    rng = np.random.default_rng(104)
    vocab, k, width = 10, 4, 4
    plan = [(0, 0), (1, 1), (3, 1), (3, 3)]  # (count, accepted)
    rows = [sampled_row(rng, vocab, k, [width] * k, width, c, a) for c, a in plan]
    return case(
        "short-counts",
        "counts 0, 1, 3, 3 of K = 4: the bonus token from p at position count, or a refusal "
        "inside the count; the drafts past a count are never tested",
        rows,
        [c for c, _ in plan],
    )


def outside_support() -> dict:
    """Drafts q gives no mass: kept whatever u where p has some, refused (even at u = 0)
    where p has none."""
    rng = np.random.default_rng(105)
    vocab, k, width = 8, 2, 3
    rows = []
    for outside_at, p_outside, u_outside in ((0, 0.3, 0.9), (0, 0.0, 0.3), (1, 0.0, 0.0)):
        row = sampled_row(rng, vocab, k, [width] * k, width, k, k)
        j = outside_at
        d = next(i for i in range(vocab) if i not in row.q_ids[j])
        target = np.array(row.target[j])
        target[d] = 0
        target *= (1 - p_outside) / target.sum()
        target[d] = p_outside
        row.drafts[j], row.target[j], row.uniforms[j] = d, target.tolist(), u_outside
        rows.append(row)
    return case(
        "outside-support",
        "a draft outside q's support (q = 0): kept at u = 0.9 where p(draft) = 0.3; refused "
        "where p(draft) = 0, at u = 0.3 and at u = 0",
        rows,
        [k] * 3,
    )


def no_residual_mass() -> dict:
    """p equal to q at the refused position: max(p - q, 0) is all zeros, so the next token
    comes from p itself."""
    rng = np.random.default_rng(106)
    vocab, k, width = 8, 2, 3
    rows = []
    for refused_at in (0, 1):
        row = sampled_row(rng, vocab, k, [width] * k, width, k, k)
        j = refused_at
        dense = np.zeros(vocab)
        np.add.at(dense, row.q_ids[j], row.q_probs[j])
        row.target[j] = dense.tolist()
        row.drafts[j] = next(i for i in range(vocab) if dense[i] == 0)
        rows.append(row)
    return case(
        "no-residual-mass",
        "p = q at the refused position (a draft outside the support, p = 0 there): the next "
        "token is drawn from p",
        rows,
        [k] * 2,
    )


def _cdf(dist: np.ndarray) -> np.ndarray:
    return np.cumsum(dist) / dist.sum()


def edge_uniforms() -> dict:
    """Uniforms at 0, just either side of a draft's p / q and of a CDF step, and near 1."""
    rng = np.random.default_rng(107)
    vocab, k, width = 10, 2, 3
    rows = []

    # u = 0: a draft with 0 < p < q kept, one with p = 0 < q refused; the next token is the
    # first with residual mass (tokens 0 and 1 carry none: p <= q there).
    row = sampled_row(rng, vocab, k, [width] * k, width, k, k)
    row.q_ids[1], row.q_probs[1] = [0, 1, 5], [0.25, 0.35, 0.4]
    row.target[1] = (distribution(rng, vocab, zeros=(0, 1, 5))).tolist()
    row.drafts[1] = 5
    row.uniforms = [0.0, 0.0, 0.0]
    d0 = row.drafts[0]
    row.target[0][d0] = min(row.target[0][d0], row.q_probs[0][row.q_ids[0].index(d0)] / 2)
    rows.append(row)

    # Just below p / q (kept), just above (refused), then just past a CDF step: token i + 1.
    row = sampled_row(rng, vocab, k, [width] * k, width, k, 1)
    row.drafts[0] = _refusable(rng, row, 0)
    row.uniforms[0] = row.ratio(0) * (1 - NEAR)
    row.uniforms[1] = row.ratio(1) * (1 + NEAR)
    cdf = _cdf(np.maximum(np.array(row.target[1]) - _dense(row, 1, vocab), 0))
    row.uniforms[k] = float(cdf[np.argmax(cdf > 0.3)] * (1 + NEAR))
    rows.append(row)

    # Every draft kept just below p / q, then the bonus token just below a CDF step: token i.
    row = sampled_row(rng, vocab, k, [width] * k, width, k, k)
    for j in range(k):
        row.drafts[j] = _refusable(rng, row, j)
        row.uniforms[j] = row.ratio(j) * (1 - NEAR)
    cdf = _cdf(np.array(row.target[k]))
    row.uniforms[k] = float(cdf[np.argmax(cdf > 0.5)] * (1 - NEAR))
    rows.append(row)

    # Near 1: a draft with p > q kept, then one refused, and the next token is the last with
    # residual mass (the last two tokens carry none).
    row = sampled_row(rng, vocab, k, [width] * k, width, k, 1)
    row.target[0][row.drafts[0]] = 1.0  # p > q (not normalised: the rule does not ask it)
    row.target[1] = distribution(rng, vocab, zeros=(vocab - 2, vocab - 1)).tolist()
    d1 = row.drafts[1]
    row.target[1][d1] = row.q_probs[1][row.q_ids[1].index(d1)] / 2
    row.uniforms = [1 - NEAR, 1 - NEAR, 1 - NEAR]
    rows.append(row)
    return case(
        "edge-uniforms",
        "u = 0 (keeps any draft with p > 0, refuses p = 0; the first token with mass), u just "
        "either side of p / q and of a CDF step, u = 1 - 1e-9 (the last token with mass)",
        rows,
        [k] * 4,
    )


def _refusable(rng: np.random.Generator, row: Row, j: int) -> int:
    """An id of draft j's support with p < q (a draft whose p / q is below 1)."""
    ids, probs = row.q_ids[j], row.q_probs[j]
    return int(rng.choice([i for i, q in zip(ids, probs, strict=True) if q > row.target[j][i]]))


def _dense(row: Row, j: int, vocab: int) -> np.ndarray:
    dense = np.zeros(vocab)
    np.add.at(dense, row.q_ids[j], row.q_probs[j])
    return dense


def mixed() -> dict:
    """Everything drawn at random: supports, drafts from q, counts, uniforms."""
    rng = np.random.default_rng(108)
    vocab, k, width, b = 16, 4, 5, 4
    rows = []
    for _ in range(b):
        row = Row()
        for _ in range(k):
            ids, probs = support(rng, vocab, int(rng.integers(1, width + 1)), width)
            row.q_ids.append(ids)
            row.q_probs.append(probs)
            row.drafts.append(int(rng.choice(ids, p=probs)))
            # A target close to the drafter's, as a trained drafter's is: most drafts kept.
            near = 0.7 * _dense(row, len(row.q_ids) - 1, vocab) + 0.3 * distribution(rng, vocab)
            row.target.append(near.tolist())
        row.target.append(distribution(rng, vocab, peak=2.5).tolist())
        row.uniforms = rng.random(k + 1).tolist()
        rows.append(row)
    return case(
        "mixed",
        "random supports of 1 to 5 ids, drafts drawn from q, targets near q, random uniforms; "
        "counts absent",
        rows,
        None,
    )


CASES: list[Callable[[], dict]] = [
    greedy,
    sparse,
    full,
    short_counts,
    outside_support,
    no_residual_mass,
    edge_uniforms,
    mixed,
]


def well_formed(c: dict) -> None:
    """The vector's own rules for its inputs (AssertionError names the fault)."""
    b, k, vocab = len(c["drafts"]), len(c["drafts"][0]), len(c["target_probs"][0][0])
    counts = c.get("counts") or [k] * b
    assert all(0 <= n <= k for n in counts) and len(counts) == b
    for r in range(b):
        assert len(c["drafts"][r]) == k and len(c["uniforms"][r]) == k + 1
        assert all(0 <= u < 1 for u in c["uniforms"][r])
        assert all(len(p) == vocab and min(p) >= 0 for p in c["target_probs"][r])
        assert all(0 <= d < vocab for d in c["drafts"][r])
        for ids, probs in zip(c["q_ids"][r], c["q_probs"][r], strict=True):
            assert len(ids) == len(probs) and all(0 <= i < vocab for i in ids)
            assert min(probs) >= 0
            # One id once with mass: q(d) and the dense q are then exact in float64.
            held = [i for i, p in zip(ids, probs, strict=True) if p > 0]
            assert len(held) == len(set(held)), f"{c['name']}: an id twice in q's support"


def with_expectations(c: dict) -> dict:
    exact, plain = verdicts(c, exact=True), verdicts(c, exact=False)
    for row, (e, f) in enumerate(zip(exact, plain, strict=True)):
        assert (e.num_accepted, e.next_token) == (f.num_accepted, f.next_token), (c["name"], row)
        assert e.gap >= MIN_GAP, f"{c['name']} row {row}: a comparison within {e.gap:.1e}"
    c["expect"] = {
        "num_accepted": [v.num_accepted for v in exact],
        "next_tokens": [v.next_token for v in exact],
    }
    return c


def build_vector() -> dict:
    cases = []
    for make in CASES:
        c = make()
        well_formed(c)
        cases.append(with_expectations(c))
    return {"format": FORMAT, "rules": RULES, "min_gap": MIN_GAP, "cases": cases}


def dumps(vector: dict) -> str:
    """One line per case field: short enough to read, stable to diff."""
    head = {key: value for key, value in vector.items() if key != "cases"}
    lines = ["{"]
    lines += [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in head.items()]
    cases = []
    for c in vector["cases"]:
        fields = [f"    {json.dumps(key)}: {json.dumps(value)}" for key, value in c.items()]
        cases.append("   {\n" + ",\n".join(fields) + "\n   }")
    lines += ['  "cases": [', ",\n".join(cases), "  ]", "}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file only")
    parser.add_argument("--out", type=Path, default=VECTOR_PATH)
    args = parser.parse_args()
    text = dumps(build_vector())
    if args.check:
        same = args.out.read_text() == text
        print(f"{args.out}: {'current' if same else 'differs from a fresh vector'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
