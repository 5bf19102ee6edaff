"""The MoE, gated-attention and MLA families served over gRPC, drafts equal to the oracles.

One server per family (fp32, CPU; and, marked gpu, on CUDA with the Triton kernels and
CUDA graphs, fp32), each going through every AfterVerify case (none / some / all
accepted, own or refed hiddens, separate or fused with the next Propose), KV taken,
installed, exported and imported, and a ProposeBatch, each proposal checked against the
float64 oracle.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deepseek_checkpoints import write_deepseek_checkpoint
from deepseek_reference import DeepseekReference
from drafting import Expected, hiddens, tokens
from family_checkpoints import write_family_checkpoint
from family_reference import FamilyReference
from servers import SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, ProposeArgs, Verdict

CHECKPOINTS = {
    "glm-4.5": {"n_group": 2, "topk_group": 1},  # group-limited routing, q/k norms
    "qwen3-next": {},  # gated attention, softmax MoE with a gated shared expert
    "qwen3.6-dense": {},  # the same attention over a dense MLP
    "deepseek-v3": {"fp8": True},  # MLA over the latent cache, YaRN, FP8 weights
}


SERVED = [
    *((name, "cpu") for name in CHECKPOINTS),
    *(pytest.param((name, "cuda"), marks=pytest.mark.gpu) for name in CHECKPOINTS),
]


@pytest.fixture(scope="module", params=SERVED, ids=lambda p: "-".join(p))
def served(request, tmp_path_factory) -> Iterator[tuple[DrafterClient, FamilyReference]]:
    name, device = request.param
    folder = tmp_path_factory.mktemp(name)
    if name.startswith("deepseek"):
        write_deepseek_checkpoint(folder, name, seed=5, shards=2, **CHECKPOINTS[name])
        ref = DeepseekReference(folder)
    else:
        write_family_checkpoint(folder, name, seed=5, shards=2, **CHECKPOINTS[name])
        ref = FamilyReference(folder)
    proc = start_server(folder, *SERVER_ARGS, "--device", device, "--dtype", "float32")
    try:
        with DrafterClient(proc.address, timeout=60) as client:
            yield client, ref
            info = client.info()
            assert info.live_states == 0 and info.kv_blocks_free == info.kv_blocks_total
    finally:
        proc.stop()


def _assert_proposal(got, drafts: list[int], probs: list[float]) -> None:
    assert got.tokens == drafts
    assert got.probs == pytest.approx(probs, abs=2e-4)


def _prefilled(client: DrafterClient, ref: FamilyReference, n: int, seed: int):
    state, exp = client.alloc_state(), Expected(ref)
    toks, hid = tokens(n, seed), hiddens(n, seed)
    client.prefill(state, toks, hid, start_position=1)
    exp.add(toks, hid)
    return state, exp


@pytest.mark.parametrize("fused", [False, True], ids=["after_verify", "fused"])
@pytest.mark.parametrize("refeed", [False, True], ids=["own_hiddens", "refeed"])
@pytest.mark.parametrize("accepted", [0, 1, 3], ids=["none", "some", "all"])
def test_every_after_verify_case(served, accepted: int, refeed: bool, fused: bool) -> None:
    client, ref = served
    state, exp = _prefilled(client, ref, 6, seed=accepted + 10)
    x, h = tokens(1, 7)[0], hiddens(1, 7)
    _assert_proposal(client.propose(state, x, h, 7, 3), *exp.propose(x, h, 3))
    refeed_hiddens = hiddens(accepted, 8) if refeed else None
    exp.verdict(accepted, refeed_hiddens)
    bonus, h_next = tokens(1, 9)[0], hiddens(1, 9)
    position = 7 + accepted + 1
    if fused:
        verdict = Verdict(accepted, refeed_hiddens)
        got = client.propose(state, bonus, h_next, position, 3, previous=verdict)
    else:
        client.after_verify(state, accepted, refeed_hiddens=refeed_hiddens)
        got = client.propose(state, bonus, h_next, position, 3)
    _assert_proposal(got, *exp.propose(bonus, h_next, 3))
    client.after_verify(state, 0)
    assert client.free_state(state)


def test_take_install_and_export_import_keep_the_next_drafts(served) -> None:
    """KV moved by a handle, or as bytes into a new state: the next drafts are the oracle's."""
    client, ref = served
    state, exp = _prefilled(client, ref, 9, seed=50)
    moved = client.alloc_state()
    client.install_kv(moved, client.take_kv(state))
    imported = client.alloc_state()
    client.import_kv(imported, client.export_kv(client.take_kv(moved)))
    x, h = tokens(1, 51)[0], hiddens(1, 51)
    _assert_proposal(client.propose(imported, x, h, exp.next_position, 3), *exp.propose(x, h, 3))
    client.after_verify(imported, 0)
    for s in (state, moved, imported):
        client.free_state(s)


def test_a_batch_of_states_drafts_as_each_alone(served) -> None:
    client, ref = served
    states = [_prefilled(client, ref, 3 + 4 * i, seed=30 + i) for i in range(3)]
    requests, expected = [], []
    for i, (state, exp) in enumerate(states):
        x, h = tokens(1, 40 + i)[0], hiddens(1, 40 + i)
        requests.append(ProposeArgs(state, x, h, exp.next_position, 4))
        expected.append(exp.propose(x, h, 4))
    for got, want in zip(client.propose_many(requests).proposals(), expected, strict=True):
        _assert_proposal(got, *want)
    for state, _ in states:
        client.after_verify(state, 0)
        client.free_state(state)
