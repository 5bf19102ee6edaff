"""The Python clients give a state a grammar on a propose, change it and clear it: one state
at a time (DrafterClient.propose, a stream's propose) and by rows (propose_batch's
grammars, propose_many's ProposeArgs.grammar)."""

from __future__ import annotations

import pytest
from drafting import hiddens
from grammars import EOS
from servers import PATIENCE, SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, Grammar, ProposeArgs
from mtpdraft.client.errors import InvalidArgument
from mtpdraft.client.messages import grammar_message

FOUR_DIGITS = Grammar(regex="[0-3]{4}")


@pytest.fixture(scope="module")
def client(checkpoint):
    proc = start_server(checkpoint, *SERVER_ARGS, "--grammar-compile-timeout", "20")
    with DrafterClient(proc.address, timeout=PATIENCE) as client:
        yield client
    proc.stop()


def fresh(client: DrafterClient) -> int:
    state = client.alloc_state()
    client.prefill(state, [1, 2, 3], hiddens(3, state % 1000), 1)
    return state


def digits_then_stop(drafts: list[int]) -> bool:
    """What [0-3]{4} allows after "1": three digits, then the stop token."""
    return len(drafts) == 4 and all(ord("0") <= d <= ord("3") for d in drafts[:3]) and (
        drafts[3] == EOS
    )  # fmt: skip


def test_a_propose_gives_changes_and_clears_the_grammar(client):
    state = fresh(client)
    got = client.propose(state, ord("1"), hiddens(1, 1)[0], 4, 4, grammar=FOUR_DIGITS,
                         return_bitmasks=True)  # fmt: skip
    assert digits_then_stop(got.tokens) and got.bitmasks.shape[0] == 5
    cleared = client.propose(state, ord("x"), hiddens(1, 2)[0], 5, 4, previous=0,
                             grammar=Grammar(none=True), return_bitmasks=True)  # fmt: skip
    # "x" is no digit: the old grammar would have refused it; no grammar, no masks.
    assert cleared.bitmasks is None and len(cleared.tokens) == 4
    client.free_state(state)


def test_batch_rows_and_a_streams_propose_carry_grammars(client):
    a, b, c, d = (fresh(client) for _ in range(4))
    got = client.propose_batch(
        [a, b], [ord("1")] * 2, [4, 4], hiddens(2, 3), 4, return_bitmasks=True,
        grammars={0: FOUR_DIGITS, 1: Grammar(regex="[0-")},
    )  # fmt: skip
    assert digits_then_stop(got.proposal(0).tokens) and 0 in got.bitmasks
    assert isinstance(got.errors[1], InvalidArgument) and got.errors[1].reason == "GRAMMAR_INVALID"
    many = client.propose_many([ProposeArgs(c, ord("1"), hiddens(1, 4)[0], 4, 4,
                                            grammar=FOUR_DIGITS)])  # fmt: skip
    assert digits_then_stop(many.proposal(0).tokens)
    with client.stream() as stream:
        one = stream.propose(d, ord("1"), hiddens(1, 5)[0], 4, 4, grammar=FOUR_DIGITS)
    assert digits_then_stop(one.tokens)
    for state in (a, b, c, d):
        client.free_state(state)


@pytest.mark.parametrize("grammar", [Grammar(), Grammar(regex="a", none=True)])
def test_a_grammar_is_one_kind_or_none(grammar):
    with pytest.raises(ValueError, match="exactly one of"):
        grammar_message(grammar)
