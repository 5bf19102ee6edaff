"""DESIGN's rule for the drafts kept when the drafter chooses K, by brute force in float64
(imports nothing of the service)."""

from __future__ import annotations

import math


def chosen(probs: list[float], b: list[float] | float, cost: float) -> int:
    """The first k in 0 .. len(probs) that maximises the expected tokens of a verify step
    over its cost: the first j drafts accepted with probability
    s_j = min(1, b_j prod_{i <= j} p_i), made non-increasing in j."""
    b = [b] * len(probs) if isinstance(b, float) else b
    reach, s = [], 1.0
    for j in range(len(probs)):
        s = min(s, 1.0, b[j] * math.prod(probs[: j + 1]))
        reach.append(s)
    best, best_value = 0, 1.0
    for k in range(1, len(probs) + 1):
        value = (1 + sum(reach[:k])) / (1 + cost * k)
        if value > best_value:
            best, best_value = k, value
    return best


class Calibration:
    """A state's calibration per depth, as its verdicts make it: per depth j, the
    proposals whose first j + 1 drafts were accepted and the probability their drafts
    gave that, each sum decayed by 0.9 per verdict, b_j = (accepted + 1) / (predicted + 1)."""

    def __init__(self, depth: int) -> None:
        self.accepted, self.predicted = [0.0] * depth, [0.0] * depth

    def b(self) -> list[float]:
        return [(a + 1) / (p + 1) for a, p in zip(self.accepted, self.predicted, strict=True)]

    def verdict(self, probs: list[float], accepted: int) -> None:
        for j in range(len(self.accepted)):
            hit = float(j < accepted)
            predicted = math.prod(probs[: j + 1]) if j < len(probs) else 0.0
            self.accepted[j] = 0.9 * self.accepted[j] + hit
            self.predicted[j] = 0.9 * self.predicted[j] + predicted
