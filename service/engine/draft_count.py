"""How many drafts to hand a verifier that leaves K to the drafter (num_drafts 0).

A verify step over k drafts yields 1 + (the drafts it accepts) tokens and costs
1 + c k, c being what verifying one more token costs as a fraction of a step (the
client's verify_token_cost). The first j drafts are taken to be accepted with probability
s_j = min(1, b_j prod_{i <= j} p_i): p_i is draft i's probability under the head, b_j
the state's calibration at depth j, the number of its proposals whose first j drafts
its verifier accepted over the number the p's predicted, both counted with a decay so
that recent verdicts weigh most (a head's probabilities are calibrated differently at
each depth of its chain). The count kept is the k in 0 .. cap that maximises
(1 + sum_{j <= k} s_j) / (1 + c k), s made non-increasing in j: the chain's drafts are
computed up to the cap, and cut there.
"""

from __future__ import annotations

import numpy as np

# Per verdict, the weight left to the verdicts before it: about the last ten count.
DECAY = 0.9
# A calibration starts at 1 as if PRIOR proposals had been predicted and accepted.
PRIOR = 1.0


def counts(probs: np.ndarray, caps: np.ndarray, calibration: np.ndarray, costs: np.ndarray):
    """[n] the count of drafts each row keeps, given its drafts' probabilities [n, width]
    (its first caps[i] computed), calibration [n, width] and verify token cost [n]."""
    width = probs.shape[1]
    computed = np.arange(width)[None, :] < caps[:, None]
    reach = np.minimum(1.0, calibration[:, :width] * np.cumprod(probs, axis=1))
    reach = np.minimum.accumulate(np.where(computed, reach, 0.0), axis=1)
    expected = 1.0 + np.concatenate([np.zeros((len(probs), 1)), np.cumsum(reach, axis=1)], 1)
    k = np.arange(width + 1)[None, :]  # the tokens a step is expected to yield with k drafts
    value = np.where(k <= caps[:, None], expected / (1.0 + costs[:, None] * k), -np.inf)
    return value.argmax(axis=1)


def verdicts(
    probs: np.ndarray, counts: np.ndarray, accepted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per depth j [n, width]: whether each proposal's first j + 1 drafts were accepted,
    and the probability its drafts' probabilities [n, width] gave that (0 past its count)."""
    depth = np.arange(probs.shape[1])[None, :]
    kept = depth < counts[:, None]
    return (depth < accepted[:, None]).astype(np.float64), np.where(
        kept, np.cumprod(np.where(kept, probs, 1.0), axis=1), 0.0
    )


def calibration(accepted: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """The calibration [n, width] of states whose decayed sums per depth of proposals
    accepted and predicted are given."""
    return (accepted + PRIOR) / (predicted + PRIOR)
