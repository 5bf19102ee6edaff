"""How a state's drafts are chosen: greedy, or drawn from the head's processed distribution.

A state holds its sampling parameters (vLLM's: temperature, top_k, top_p, min_p, and a
seed) from AllocState on; any propose row may change them from its step on. A step
carries the changes as one column (`CHANGES`, `set` false where a row changes nothing);
the state table keeps them as columns (`PARAMS`), and a chain reads its rows' as a
ChainSampling (model/decode_chain.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..model.decode_chain import ChainSampling
from .errors import InvalidArgument

PARAMS = np.dtype(
    [("temperature", "f8"), ("top_k", "i8"), ("top_p", "f8"), ("min_p", "f8"), ("seed", "u8")]
)
CHANGES = np.dtype([("set", "?"), *((name, PARAMS[name]) for name in PARAMS.names)])


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy. top_k 0 or -1: no cut; top_p 0 (unset) or 1: no cut;
    min_p 0: none. The seed keys the draws with the state, position and draft index."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def checked(self, field: str) -> Sampling:
        """The parameters, unset ones given their meaning (top_p 0 is 1, top_k -1 is 0),
        or INVALID_ARGUMENT naming the first value no state accepts."""
        column = changes([self])
        bad = first_bad(column)
        if bad[0]:
            raise sampling_error(column, 0, bad[0], field)
        return Sampling(*(column[0][name].item() for name in PARAMS.names))


GREEDY = Sampling()

# Each check: (the field, whether a value fails it, what it must be).
_CHECKS = (
    ("temperature", lambda c: ~(np.isfinite(c["temperature"]) & (c["temperature"] >= 0)),
     "finite and >= 0 (0: greedy)"),
    ("top_k", lambda c: c["top_k"] < -1, ">= 0 (0 or -1: no cut)"),
    ("top_p", lambda c: ~((c["top_p"] > 0) & (c["top_p"] <= 1)), "in (0, 1] (0: unset)"),
    ("min_p", lambda c: ~((c["min_p"] >= 0) & (c["min_p"] <= 1)), "in [0, 1]"),
)  # fmt: skip


def changes(values: list[Sampling | None]) -> np.ndarray:
    """A step's column of changes, one per row (None: no change), unset values given
    their meaning: top_p 0 is 1, top_k -1 is 0."""
    column = np.zeros(len(values), CHANGES)
    if values.count(None) == len(values):  # the usual step: no row changes
        return column
    for i, v in enumerate(values):
        if v is not None:
            top_p = 1.0 if v.top_p == 0 else v.top_p
            column[i] = (True, v.temperature, v.top_k, top_p, v.min_p, v.seed)
    column["top_k"][column["top_k"] == -1] = 0
    return column


def first_bad(column: np.ndarray) -> np.ndarray:
    """Per row of a changes column, 1 + the index of its first failed check, 0 if none."""
    first = np.zeros(len(column), np.int64)
    if not column["set"].any():  # the usual step: no row changes its sampling
        return first
    for c in range(len(_CHECKS), 0, -1):
        first[column["set"] & _CHECKS[c - 1][1](column)] = c
    return first


def sampling_error(column: np.ndarray, row: int, check: int, field: str) -> InvalidArgument:
    name, _, rule = _CHECKS[check - 1]
    value = column[row][name].item()
    shown = value if math.isfinite(value) else str(value)
    return InvalidArgument(
        f"{field}.{name}: {shown}; it must be {rule}", reason="BAD_SAMPLING", field=field
    )


def chain_sampling(
    params: np.ndarray, states: np.ndarray, first_index: np.ndarray, support: int
) -> ChainSampling | None:
    """The rows' sampling for a chain (their PARAMS rows, state ids and first draft
    indexes), or None when every row is greedy (the captured greedy chain)."""
    if not (params["temperature"] > 0).any():
        return None
    return ChainSampling(
        temperature=params["temperature"],
        top_k=params["top_k"],
        top_p=params["top_p"],
        min_p=params["min_p"],
        seeds=params["seed"].view(np.int64),
        states=states.astype(np.uint64).view(np.int64),
        first_index=first_index,
        support=support,
    )
