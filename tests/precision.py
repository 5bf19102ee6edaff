"""What a compute dtype may change in a draft, and how the tests tell that from a defect.

Served in bf16, a draft may differ from the float64 oracle's in two ways that no defect
causes:
- a tie: the served token's oracle logit is within the dtype's rounding of the top one
  (`tie_gap`); either token is right;
- a routing flip: a MoE row whose experts (or expert groups) the oracle chose by a margin
  the dtype cannot resolve takes the other side in the service. The row's output then
  differs by a whole expert's share, and so may every later draft of its chain: on the
  tiny DeepSeek checkpoint such flips move a later draft's logits by up to 12, where
  everything else moves them by a few hundredths.

A margin is the oracle's gap between the last value chosen and the first left out: biased
sigmoid scores for GLM and DeepSeek (groups and experts), router logits for Qwen. Both are
measured here in roundings: units of the dtype's unit roundoff times the row's largest
such value. The service's router input is the post-attention norm of a row computed in
the dtype, so its values differ from the oracle's by that rounding carried through the
router: on the tiny checkpoints in bf16, with the rows upstream routed alike, by at most
2.5 roundings (sigmoid scores) and 4.8 (Qwen's logits) on the CPU and an H100
(bench/results/precision_routing*.md). A margin below ROUTING_ROUNDINGS, over twice the
most seen, may go either way; the flips seen were at margins of 0.01 to 3.2.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}
ROUTING_ROUNDINGS = 12
# The layers' roundings that can add up in the largest logit (test_served_gpu's figure:
# the worst seen on an H200 was a third of that in bf16, a tenth in fp32).
TIE_ROUNDINGS = 4


def rounding(dtype: str, terms: int = 0) -> float:
    """One stored value's relative rounding in `dtype`, plus fp32 accumulation over
    `terms` products (sqrt(n) * 2**-24, the kernels' dot products)."""
    return UNIT_ROUNDOFF[dtype] + math.sqrt(terms) * 2.0**-24


def tie_gap(logits: torch.Tensor, u: float) -> float:
    """Logits closer than this to the top one tie: TIE_ROUNDINGS roundings `u` of the
    largest finite logit."""
    return TIE_ROUNDINGS * u * float(logits[logits.isfinite()].abs().max())


def in_roundings(value: float, values: torch.Tensor, u: float) -> float:
    """`value` in roundings `u` of the largest of `values`."""
    return value / (u * float(values.abs().max()))


class Margins:
    """A `route` hook for an oracle that keeps each row's routing margin, in roundings `u`
    (inf for a dense row), and changes nothing."""

    def __init__(self, u: float) -> None:
        self.u, self.by_row = u, {}

    def __call__(self, row: int, ids: torch.Tensor, margin: float, values: torch.Tensor):
        self.by_row[row] = in_roundings(margin, values, self.u)
        return ids

    def near_tie(self, rows: range) -> bool:
        """Whether one of the rows was routed by less than ROUTING_ROUNDINGS."""
        return any(self.by_row.get(r, math.inf) < ROUTING_ROUNDINGS for r in rows)


class Forced:
    """A `route` hook that makes the oracle route each row as the service did (`service`,
    a ServiceRouting), and notes in `seen` how the oracle itself would have routed it then:
    row -> (its margin, whether it chose the service's experts, the largest difference
    between the service's choice values and its own), in roundings `u`. Upstream of each
    row the two route alike, so that difference is the dtype's rounding alone. It leaves
    no near tie: the oracle follows the service through each."""

    def __init__(self, service: ServiceRouting, seen: dict, u: float) -> None:
        self.service, self.seen, self.u = service, seen, u

    def __call__(self, row: int, ids: torch.Tensor, margin: float, values: torch.Tensor):
        chosen = self.service.ids.get(row)
        if chosen is None:
            return ids
        delta = float((self.service.choice[row] - values).abs().max())
        margin, delta = (in_roundings(v, values, self.u) for v in (margin, delta))
        self.seen[row] = (margin, sorted(ids.tolist()) == chosen, delta)
        return torch.tensor(chosen)

    def near_tie(self, rows: range) -> bool:
        return False


class ServiceRouting:
    """The experts an in-process MTPHead routed each row to, by the row's position (so:
    one sequence at a time), and the choice values it chose them by.

    Wraps the head's forward (to learn the rows' positions) and its ops' select_experts;
    works on the eager paths (torch ops, or Triton kernels without CUDA graphs)."""

    def __init__(self, head) -> None:
        self.head, self.ids, self.choice = head, {}, {}
        self._positions: list[int] = []

    def __enter__(self) -> ServiceRouting:
        head, ops = self.head, self.head.ops
        forward, select = head.forward, ops.select_experts

        def recording_forward(batch, kv):
            self._positions = batch.positions.tolist()
            return forward(batch, kv)

        def recording_select(logits, bias, moe, shared):
            ids, weights = select(logits, bias, moe, shared)
            routed = logits[:, : moe.num_experts].double()
            if moe.scoring == "sigmoid":
                routed = routed.sigmoid() + bias.double()
            for row, chosen, values in zip(
                self._positions, ids[:, : moe.top_k].tolist(), routed.cpu(), strict=True
            ):
                self.ids[row], self.choice[row] = sorted(chosen), values
            return ids, weights

        head.forward, ops.select_experts = recording_forward, recording_select
        return self

    def __exit__(self, *exc) -> None:
        del self.head.forward, self.head.ops.select_experts
