"""Every family served in the dtypes users run (bf16, float32, DeepSeek's FP8 weights), each
draft checked against its float64 oracle within what the dtype may change
(tests/served_chains.py, tests/precision.py).

On a GPU (marked gpu): `mtpdraft serve --device cuda --dtype D`, the Triton kernels and the
K-step chain as one CUDA graph, for a tiny checkpoint of each family in bf16 as published.
Per server, two states with prompts long enough to reach each family's RoPE regime
(DeepSeek's past its YaRN original_max_position_embeddings of 1024), then 12 steps of
K = 4 with random verdicts (none / some / all accepted, own hiddens or refed, AfterVerify
or carried by the next Propose). A draft must tie with the oracle's top-1 within
TIE_ROUNDINGS roundings of the largest logit and have its probability within twice
that; a draft off that after a routing near tie of its chain counts as flipped (at most
a tenth may).

On the CPU: the checker itself fails when a later chain step is perturbed.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from precision import rounding
from served_chains import PROMPT_ROWS, Sequence, Tally, bf16_checkpoint, random_session
from servers import InProcessServer, start_server

from mtpdraft.client import DrafterClient
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

SERVER = ("--kv-blocks", "512", "--block-size", "16", "--max-drafts", "8", "--max-batch", "8")
STEPS, K = 12, 4
SUM_TERMS = 2048  # the longest fp32 sum: attention over the context (1100 rows and more)


def sessions(ref, client, name: str, dtype: str, seeds=(1, 2)) -> Tally:
    """Random sessions on states of `name`'s prompt length; their tallies summed."""
    total = Tally()
    for seed in seeds:
        seq = Sequence(ref, client, PROMPT_ROWS[name], seed, dtype, rounding(dtype, SUM_TERMS))
        total.add(random_session(seq, STEPS, K, seed))
    return total


SERVED = [(name, dtype) for name in PROMPT_ROWS for dtype in ("bfloat16", "float32")]


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "dtype"), SERVED, ids=["-".join(s) for s in SERVED])
def test_served_drafts_match_the_oracle_in_the_dtype(tmp_path, name: str, dtype: str) -> None:
    ref = bf16_checkpoint(tmp_path, name)
    proc = start_server(tmp_path, "--device", "cuda", "--dtype", dtype, *SERVER)
    try:
        with DrafterClient(proc.address, timeout=120) as client:
            assert client.info().compute_dtype == dtype
            tally = sessions(ref, client, name, dtype)
            assert client.info().live_states == 0
    finally:
        proc.stop()
    assert_few_flipped(tally, 2 * STEPS * K)


def assert_few_flipped(tally: Tally, drafts: int) -> None:
    """Every draft checked, and at most a tenth of them off the oracle after a near tie."""
    assert tally.checked + tally.flipped == drafts
    assert tally.flipped <= 0.1 * drafts, f"{tally.flipped} of {drafts} drafts flipped"


@contextmanager
def later_steps_perturbed(head: MTPHead, scale: float):
    """The head with every chain step after the first fed its hidden times (1 + scale * z),
    z standard normal: a later step that reads its input a little wrong."""
    chain, decode = head.decode_chain, head.decode
    gen = torch.Generator(head.device).manual_seed(0)

    def perturbed_chain(kv, inputs, before_wait=None):
        steps = 0

        def decode_step(batch, kv, bitmask):
            nonlocal steps
            if steps:
                noise = torch.randn(batch.hiddens.shape, generator=gen, device=head.device)
                hiddens = (batch.hiddens.float() * (1 + scale * noise)).to(batch.hiddens.dtype)
                batch = dataclasses.replace(batch, hiddens=hiddens)
            steps += 1
            return decode(batch, kv, bitmask)

        head.decode = decode_step
        try:
            return chain(kv, inputs, before_wait)
        finally:
            del head.decode

    head.decode_chain = perturbed_chain
    try:
        yield head
    finally:
        del head.decode_chain


# How far off chain steps 2..K read their hidden in the perturbed sessions: 6% in float32
# and 15% in bf16, about fifteen and forty bf16 roundings (6% moved bf16 drafts' log
# probabilities by 0.2 on an H100, inside bf16's tolerance). A defect reading the wrong
# row, position or precision is off by far more.
PERTURBED = {"float32": 0.06, "bfloat16": 0.15}


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)],
)
def test_a_perturbed_later_chain_step_fails_the_check(tmp_path, device: str, dtype: str):
    """The same sessions pass as served, and fail once chain steps 2..K read their hidden
    a little off (PERTURBED)."""
    ref = bf16_checkpoint(tmp_path, "deepseek-v3")
    ops = "triton" if device == "cuda" else "torch"
    head = MTPHead(load_mtp_weights(tmp_path), torch.device(device), getattr(torch, dtype), ops)
    # Eager, so that the chain's steps run through head.decode (a graph replays them).
    config = ServeConfig(kv_blocks=64, block_size=16, max_drafts=8, cuda_graphs=False)
    engine = DraftEngine(head, config)
    server = InProcessServer(engine)
    try:
        with DrafterClient(server.address, timeout=120) as client:
            seq = Sequence(ref, client, 40, 3, dtype, rounding(dtype, SUM_TERMS))
            assert_few_flipped(random_session(seq, STEPS, K, seed=3), STEPS * K)
            # Off the oracle outright, or off it after so many routing near ties that a
            # served session would fail.
            with (
                later_steps_perturbed(head, PERTURBED[dtype]),
                pytest.raises(AssertionError, match=r"draft [1-9]|drafts flipped"),
            ):
                seq = Sequence(ref, client, 40, 3, dtype, rounding(dtype, SUM_TERMS))
                tally = random_session(seq, STEPS, K, seed=3)
                assert_few_flipped(tally, STEPS * K)
    finally:
        server.stop()
