"""The Python client's accept (client/sampling.py), numpy and torch, reproduces every case
of sampling_vector.json exactly: each row's number of drafts kept and its next token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mtpdraft.client.sampling import accept

CASES = json.loads(Path(__file__).with_name("sampling_vector.json").read_text())["cases"]


def _inputs(case: dict, as_torch: bool) -> tuple[list, dict]:
    ints, floats = (torch.int64, torch.float64) if as_torch else (np.int64, np.float64)
    make = torch.tensor if as_torch else np.array

    def array(key: str, dtype):
        return make(case[key], dtype=dtype)

    args = [array("drafts", ints), array("q_ids", ints)]
    args += [array("q_probs", floats), array("target_probs", floats)]
    counts = array("counts", ints) if "counts" in case else None
    return args, {"counts": counts, "uniforms": array("uniforms", floats)}


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_accept_reproduces_the_case(case: dict, as_torch: bool) -> None:
    args, options = _inputs(case, as_torch)
    got = accept(*args, **options)
    assert got.num_accepted.tolist() == case["expect"]["num_accepted"]
    assert got.next_tokens.tolist() == case["expect"]["next_tokens"]
