"""The drafter lifecycle over a real server on loopback, checked against the oracle."""

from __future__ import annotations

import asyncio

import pytest
import torch
from drafting import Expected, H, V, hiddens, tokens
from mtp_reference import Reference
from servers import SERVER_ARGS, start_server

from mtpdraft.client import AsyncDrafterClient, DrafterClient, ProposeArgs, Verdict


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


def assert_proposal(got, drafts: list[int], probs: list[float]) -> None:
    assert got.tokens == drafts
    assert got.probs == pytest.approx(probs, abs=2e-4)
    assert got.confidence == pytest.approx(min(probs), abs=2e-4)


def prefilled(client: DrafterClient, ref: Reference, n: int, seed: int) -> tuple[int, Expected]:
    state, exp = client.alloc_state(), Expected(ref)
    toks, hid = tokens(n, seed), hiddens(n, seed)
    result = client.prefill(state, toks, hid, start_position=1)
    exp.add(toks, hid)
    assert (result.num_rows, result.next_position) == (n, n + 1)
    return state, exp


def test_info_describes_the_model(client: DrafterClient) -> None:
    info = client.info()
    assert (info.model_family, info.hidden_size, info.vocab_size) == ("mimo", H, V)
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, 2, 16)
    assert info.compute_dtype == "float32" and info.device == "cpu"
    assert (info.max_drafts, info.max_batch, info.max_states) == (8, 8, 32)
    assert info.kv_block_size == 4 and info.kv_blocks_total == 256
    assert info.bitmask_words == (V + 31) // 32
    assert not info.draining


def test_lifecycle_in_chunks_matches_reference(client: DrafterClient, ref: Reference) -> None:
    state, exp = client.alloc_state(), Expected(ref)
    toks, hid = tokens(37, 1), hiddens(37, 1)
    # 5 rows of fp32 x 64 per message: the prompt arrives in 8 chunks.
    result = client.prefill(state, toks, hid, 1, chunk_bytes=5 * H * 4 + 64)
    exp.add(toks, hid)
    assert result.next_position == 38
    position = 38
    for step, accepted in enumerate([2, 0, 4, 1]):
        token, hidden = tokens(1, 100 + step)[0], hiddens(1, 100 + step)
        got = client.propose(state, token, hidden, position, 4)
        assert got.first_position == position + 1
        assert_proposal(got, *exp.propose(token, hidden, 4))
        after = client.after_verify(state, accepted)
        exp.verdict(accepted)
        position += accepted + 1
        assert after.next_position == position == exp.next_position
    assert client.free_state(state) is True
    assert client.free_state(state) is False  # idempotent


@pytest.mark.parametrize("fused", [False, True], ids=["after_verify", "fused"])
@pytest.mark.parametrize("refeed", [False, True], ids=["own_hiddens", "refeed"])
@pytest.mark.parametrize("accepted", [0, 1, 3], ids=["none", "some", "all"])
def test_after_verify_leaves_exactly_the_designed_rows(
    client: DrafterClient, ref: Reference, accepted: int, refeed: bool, fused: bool
) -> None:
    """Each case of DESIGN.md: the next drafts equal the oracle's over the expected rows."""
    state, exp = prefilled(client, ref, 6, seed=accepted)
    x, h = tokens(1, 7)[0], hiddens(1, 7)
    assert_proposal(client.propose(state, x, h, 7, 3), *exp.propose(x, h, 3))
    refeed_hiddens = hiddens(accepted, 8) if refeed else None
    exp.verdict(accepted, refeed_hiddens)
    bonus, h_next = tokens(1, 9)[0], hiddens(1, 9)
    position = 7 + accepted + 1
    if fused:
        verdict = Verdict(accepted, refeed_hiddens)
        got = client.propose(state, bonus, h_next, position, 3, previous=verdict)
    else:
        result = client.after_verify(state, accepted, refeed_hiddens=refeed_hiddens)
        assert (result.num_rows, result.next_position) == (position - 1, position)
        got = client.propose(state, bonus, h_next, position, 3)
    assert_proposal(got, *exp.propose(bonus, h_next, 3))
    client.after_verify(state, 0)
    client.free_state(state)


def test_min_confidence_stops_the_chain(client: DrafterClient, ref: Reference) -> None:
    state, exp = prefilled(client, ref, 5, seed=11)
    x, h = tokens(1, 12)[0], hiddens(1, 12)
    full = client.propose(state, x, h, 6, 8)
    drafts, probs = exp.propose(x, h, 8)
    assert_proposal(full, drafts, probs)
    client.after_verify(state, 0)
    exp.verdict(0)
    # A threshold between two running minima cuts the chain right before it drops.
    running = [min(probs[: i + 1]) for i in range(8)]
    cut = next(i for i in range(1, 8) if running[i] < running[i - 1])
    tau = (running[cut] + running[cut - 1]) / 2
    x2, h2 = tokens(1, 13)[0], hiddens(1, 13)
    short = client.propose(state, x2, h2, 7, 8, min_confidence=tau)
    drafts2, probs2 = exp.propose(x2, h2, 8)
    running2 = [min(probs2[: i + 1]) for i in range(8)]
    keep = next((i for i in range(8) if running2[i] < tau), 8)
    assert short.tokens == drafts2[:keep]
    assert all(p >= tau for p in short.probs)
    if keep < 8:
        assert short.confidence == pytest.approx(running2[keep], abs=2e-4)
        assert short.confidence < tau
    # Accepting every returned draft keeps their rows (the stopping row included).
    client.after_verify(state, keep)
    exp.verdict(keep)
    x3, h3 = tokens(1, 14)[0], hiddens(1, 14)
    assert_proposal(client.propose(state, x3, h3, 7 + keep + 1, 2), *exp.propose(x3, h3, 2))
    client.after_verify(state, 2)
    client.free_state(state)


def _mask(allowed_tokens: list[list[int]], words: int) -> torch.Tensor:
    mask = torch.zeros(len(allowed_tokens), words, dtype=torch.int64)
    for row, allowed in enumerate(allowed_tokens):
        for t in allowed:
            mask[row, t // 32] |= 1 << (t % 32)
    return mask.to(torch.int32)  # wraps bit 31 into the sign, as xgrammar's int32 words do


def test_bitmask_is_respected(client: DrafterClient, ref: Reference) -> None:
    state, exp = prefilled(client, ref, 4, seed=21)
    x, h = tokens(1, 22)[0], hiddens(1, 22)
    free = client.propose(state, x, h, 5, 3)
    client.after_verify(state, 0)
    # Forbid the free choice of each position; allow a few tokens including bit 31.
    allowed = [[t for t in (31, 63, 95, 150, 199, free.tokens[0]) if t != free.tokens[0]]]
    allowed.append([t for t in range(V) if t != free.tokens[1]])
    words = (V + 31) // 32
    mask = _mask(allowed, words)
    x2, h2 = tokens(1, 23)[0], hiddens(1, 23)
    exp.propose(x, h, 3)
    exp.verdict(0)
    got = client.propose(state, x2, h2, 6, 3, bitmask=mask)
    allow = torch.zeros(2, V, dtype=torch.bool)
    for row, toks in enumerate(allowed):
        allow[row, toks] = True
    drafts, probs = exp.propose(x2, h2, 3, allow)
    assert_proposal(got, drafts, probs)
    assert got.tokens[0] in allowed[0]
    assert all(t != free.tokens[1] for t in got.tokens[1:])  # row 2 also masks draft 3
    client.after_verify(state, 0)
    exp.verdict(0)
    # A 1-D mask shorter than the vocabulary: uncovered tokens are disallowed.
    short = _mask([[3, 17, 40]], 2)[0]
    got = client.propose(state, x2, h2, 7, 4, bitmask=short)
    assert set(got.tokens) <= {3, 17, 40}
    client.after_verify(state, 4)
    client.free_state(state)


def test_propose_batch_equals_propose_per_state(client: DrafterClient, ref: Reference) -> None:
    singles, batched = [], []
    for seed in range(3):
        singles.append(prefilled(client, ref, 3 + 4 * seed, seed=30 + seed)[0])
        batched.append(prefilled(client, ref, 3 + 4 * seed, seed=30 + seed)[0])
    for step in range(3):
        requests, expected = [], []
        for i, (one, many) in enumerate(zip(singles, batched, strict=True)):
            n = 3 + 4 * i
            position = n + 1 + step * 3  # each step accepts 2 of 4 drafts
            x, h = tokens(1, 40 + step * 3 + i)[0], hiddens(1, 40 + step * 3 + i)
            previous = Verdict(2, hiddens(2, 50 + i)) if step else None
            if previous:
                client.after_verify(one, 2, refeed_hiddens=previous.refeed_hiddens)
            expected.append(client.propose(one, x, h, position, 4))
            requests.append(ProposeArgs(many, x, h, position, 4, previous=previous))
        got = client.propose_many(requests).proposals()
        for g, e in zip(got, expected, strict=True):
            assert g.tokens == e.tokens
            assert g.probs == pytest.approx(e.probs, abs=1e-5)
    for state in singles + batched:
        client.after_verify(state, 0)
        client.free_state(state)


def test_take_then_install_gives_the_same_next_drafts(
    client: DrafterClient, ref: Reference
) -> None:
    donor, exp = prefilled(client, ref, 9, seed=60)
    x, h = tokens(1, 61)[0], hiddens(1, 61)
    client.propose(donor, x, h, 10, 3)
    exp.propose(x, h, 3)
    client.after_verify(donor, 3)
    exp.verdict(3)
    free_before = client.info().kv_blocks_free
    handle = client.take_kv(donor)
    assert handle.num_rows == 13 and client.info().kv_handles == 1
    assert client.info().kv_blocks_free == free_before  # the handle holds the blocks
    # The donor is empty again: a fresh prompt starts at position 1.
    client.prefill(donor, [1], hiddens(1, 62), 1)
    receiver = client.alloc_state()
    result = client.install_kv(receiver, handle)
    assert (result.num_rows, result.next_position) == (13, 14)
    bonus, hb = tokens(1, 63)[0], hiddens(1, 63)
    assert_proposal(client.propose(receiver, bonus, hb, 14, 4), *exp.propose(bonus, hb, 4))
    client.after_verify(receiver, 1)
    for state in (donor, receiver):
        client.free_state(state)


def test_async_client_runs_the_same_lifecycle(server, ref: Reference) -> None:
    async def run() -> None:
        async with AsyncDrafterClient(server.address, timeout=30.0) as c:
            state, exp = await c.alloc_state(), Expected(ref)
            toks, hid = tokens(6, 70), hiddens(6, 70)
            await c.prefill(state, toks, hid, 1)
            exp.add(toks, hid)
            x, h = tokens(1, 71)[0], hiddens(1, 71)
            assert_proposal(await c.propose(state, x, h, 7, 3), *exp.propose(x, h, 3))
            exp.verdict(2, hiddens(2, 72))
            x2, h2 = tokens(1, 73)[0], hiddens(1, 73)
            got = await c.propose(state, x2, h2, 10, 2, previous=Verdict(2, hiddens(2, 72)))
            assert_proposal(got, *exp.propose(x2, h2, 2))
            await c.after_verify(state, 2)
            handle = await c.take_kv(state)
            assert handle.num_rows == 12 and (await c.info()).kv_handles == 1
            other = await c.alloc_state()
            assert (await c.install_kv(other, handle)).next_position == 13
            assert await c.free_state(state) and await c.free_state(other)
            info = await c.info()
            assert info.live_states == 0 and info.kv_blocks_free == info.kv_blocks_total

    asyncio.run(run())


def test_deepseek_glm_checkpoint_over_the_wire(deepseek_checkpoint) -> None:
    """The DeepSeek/GLM naming (sharded, q/k/v biases, partial RoPE) serves the oracle's drafts."""
    ref, proc = Reference(deepseek_checkpoint), start_server(deepseek_checkpoint, *SERVER_ARGS)
    try:
        with DrafterClient(proc.address, timeout=30) as c:
            assert c.info().model_family == "deepseek"
            state, exp = prefilled(c, ref, 7, seed=80)
            for step, accepted in enumerate([3, 1]):
                x, h = tokens(1, 81 + step)[0], hiddens(1, 81 + step)
                assert_proposal(c.propose(state, x, h, exp.next_position, 3), *exp.propose(x, h, 3))
                refeed = hiddens(accepted, 90 + step) if step else None
                c.after_verify(state, accepted, refeed_hiddens=refeed)
                exp.verdict(accepted, refeed)
            assert c.free_state(state)
    finally:
        proc.stop()
