"""The verifier's acceptance rule row by row, in plain Python: the expectations of
sampling_vector.json (make_sampling_vector.py), independent of client/sampling.py.

Plain loops over the inputs, in either of two arithmetics: float64 as written, or exact
(each float64 input taken as the rational it is, fractions.Fraction), where every verdict
is the mathematically exact one. The exact run also gives the smallest gap of any
comparison that decided the row. A vector whose gaps all clear MIN_GAP, far above the
rounding of the few float64 operations between an input and a comparison (~1e-15), is
decided alike by every float64 implementation of the rule, whatever order it sums in.

The rule, per row with `count` drafts, uniforms u[0..K]: draft j is kept if
u[j] * q_j(d_j) < p_j(d_j) (q_j(d) sums the support's probabilities at ids equal to d);
the kept ones are those before the first refused. Refused at position a: the next token
comes from max(p_a - q_a, 0) (q_a dense), or from p_a where that has no mass; all kept:
from p at position `count` (the bonus token). It is drawn with u[K] by inverse CDF: the
first token whose normalised cumulative mass exceeds u[K] (the last token if none does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

#: The smallest gap a vector's deciding comparisons may have: relative for a draft's test
#: (|u q - p| / max(u q, p)), absolute for the CDF against u (both lie in [0, 1]).
MIN_GAP = 1e-10


@dataclass(frozen=True)
class RowVerdict:
    num_accepted: int
    next_token: int
    #: where the next token came from: "bonus" (all kept), "residual" (a draft refused) or
    #: "target" (a draft refused where max(p - q, 0) has no mass)
    source: str
    #: the smallest gap of a deciding comparison (exact arithmetic only; else None). Both
    #: sides exactly zero (u = 0 against an empty p or CDF) is no gap: float64 has them exact.
    gap: float | None


def row_verdict(
    drafts: Sequence[int],
    q_ids: Sequence[Sequence[int]],
    q_probs: Sequence[Sequence[float]],
    target: Sequence[Sequence[float]],
    count: int,
    uniforms: Sequence[float],
    *,
    exact: bool,
) -> RowVerdict:
    """One row: drafts [K], q_ids and q_probs [K][T], target [K + 1][V], uniforms [K + 1]."""
    num = Fraction if exact else float
    k, vocab = len(drafts), len(target[0])
    gaps: list[Fraction] = []

    def q_dense(j: int) -> list:
        dense = [num(0)] * vocab
        for token, prob in zip(q_ids[j], q_probs[j], strict=True):
            dense[token] += num(prob)
        return dense

    accepted = 0
    while accepted < count:
        d = drafts[accepted]
        test = num(uniforms[accepted]) * q_dense(accepted)[d]
        p = num(target[accepted][d])
        if test or p:
            gaps.append(abs(test - p) / max(test, p))
        if not test < p:
            break
        accepted += 1

    p_next = [num(x) for x in target[accepted]]
    if accepted < count:
        residual = [max(p - q, num(0)) for p, q in zip(p_next, q_dense(accepted), strict=True)]
        dist, source = (residual, "residual") if sum(residual) > 0 else (p_next, "target")
    else:
        dist, source = p_next, "bonus"

    u, total, cumulative, token = num(uniforms[k]), sum(dist), num(0), None
    for i, mass in enumerate(dist):
        cumulative += mass
        cdf = cumulative / total
        if cdf or u:
            gaps.append(abs(cdf - u))
        if token is None and cdf > u:
            token = i
    token = vocab - 1 if token is None else token
    gap = float(min(gaps)) if exact and gaps else None
    return RowVerdict(accepted, token, source, gap)


def verdicts(case: dict, *, exact: bool = True) -> list[RowVerdict]:
    """Each row's verdict on a vector case (its `counts` absent: every row has K drafts)."""
    k = len(case["drafts"][0])
    counts = case.get("counts") or [k] * len(case["drafts"])
    return [
        row_verdict(
            case["drafts"][b],
            case["q_ids"][b],
            case["q_probs"][b],
            case["target_probs"][b],
            counts[b],
            case["uniforms"][b],
            exact=exact,
        )
        for b in range(len(case["drafts"]))
    ]
