"""Served in bf16, the MoE families draft as float64 does but where a router's choice is a
near tie: shown row by row, with the service's own routing (tests/precision.py).

A server in-process (its engine on the eager path: torch ops on the CPU, the Triton kernels
without CUDA graphs on a GPU) serves a tiny checkpoint of each MoE family in bf16 (DeepSeek-V3
also with its FP8 weights), one state at a time: a prompt long enough to reach DeepSeek's
YaRN band (past original_max_position_embeddings), chains of K = 4, verdicts with and
without refeed. The experts it routes every row to are recorded, and the float64 oracle is
made to route each row the same way (precision.Forced). Then:
- every served draft is that oracle's top-1 within the bf16 tie gap, its probability
  within twice the gap: nothing else (the latent cache, the absorbed projections, a later
  chain step, the draft-KV writes) separates the service from float64;
- every row the oracle, routing as the service did upstream, would have routed otherwise
  was a near tie: its margin is below ROUTING_ROUNDINGS bf16 roundings of its largest
  choice value.
On the tiny DeepSeek checkpoint the plain oracle disagrees with a few drafts in a hundred,
by up to 12 logits; each follows such a flip (bench/results/precision_routing.md).
"""

from __future__ import annotations

import pytest
import torch
from precision import ROUTING_ROUNDINGS, UNIT_ROUNDOFF, Forced, ServiceRouting, rounding
from served_chains import PROMPT_ROWS, Sequence, bf16_checkpoint, random_session
from servers import InProcessServer

from mtpdraft.client import DrafterClient
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

FAMILIES = ("deepseek-v3", "deepseek-v3-fp8", "glm-4.5", "qwen3-next")  # the MoE ones
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_drafts_differ_from_float64_only_by_routing_near_ties(tmp_path, name, device):
    ref = bf16_checkpoint(tmp_path, name)
    ops = "triton" if device == "cuda" else "torch"
    head = MTPHead(load_mtp_weights(tmp_path), torch.device(device), torch.bfloat16, ops)
    # Eager: the recorder sees every forward (a graph's replay would hide the chain's).
    config = ServeConfig(kv_blocks=160, block_size=16, max_drafts=8, cuda_graphs=False)
    engine = DraftEngine(head, config)
    server = InProcessServer(engine)
    seen: dict[int, tuple[float, bool, float]] = {}
    u = UNIT_ROUNDOFF["bfloat16"]
    try:
        with DrafterClient(server.address, timeout=120) as client, ServiceRouting(head) as routed:
            seq = Sequence(
                ref, client, PROMPT_ROWS[name], seed=1, dtype="bfloat16",
                u=rounding("bfloat16"), route=lambda: Forced(routed, seen, u),
            )  # fmt: skip
            tally = random_session(seq, steps=12, k=4, seed=2)
    finally:
        server.stop()
    assert tally.flipped == 0 and tally.checked == 12 * 4
    flips = {row: margin for row, (margin, same, _) in seen.items() if not same}
    assert all(m < ROUTING_ROUNDINGS for m in flips.values()), flips
    # The service's router saw the oracle's values but for bf16's rounding.
    assert max(delta for *_, delta in seen.values()) < ROUTING_ROUNDINGS
