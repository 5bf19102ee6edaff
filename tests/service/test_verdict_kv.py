"""A verdict that accepts every draft may need one more KV block than its proposal held:
the row of the last draft, computed only then. With the pool full that verdict is
RESOURCE_EXHAUSTED (AfterVerify, or a Propose that carries it) and changes nothing."""

from __future__ import annotations

import pytest
from drafting import hiddens, tokens
from servers import InProcessServer, small_engine

from mtpdraft.client import DrafterClient, ResourceExhausted, Verdict


@pytest.fixture(scope="module")
def tiny_pool(mimo_checkpoint):
    """4 blocks of 4 rows."""
    server = InProcessServer(small_engine(mimo_checkpoint, kv_blocks=4))
    yield server
    server.stop()


@pytest.mark.parametrize("carried_by", ["AfterVerify", "Propose"])
def test_a_verdict_needing_a_block_of_a_full_pool_is_refused_whole(tiny_pool, carried_by) -> None:
    with DrafterClient(tiny_pool.address, timeout=30) as c:
        state, filler = c.alloc_state(), c.alloc_state()
        c.prefill(state, tokens(3, 1), hiddens(3, 1), 1)
        c.propose(state, 4, hiddens(1, 2)[0], 4, 1)  # its row 4 fills block 1
        c.prefill(filler, tokens(12, 3), hiddens(12, 3), 1)  # blocks 2 to 4: none free
        assert c.info().kv_blocks_free == 0

        def accept_all():  # the draft's row 5 needs a fifth block
            if carried_by == "AfterVerify":
                return c.after_verify(state, 1)
            return c.propose(state, 6, hiddens(1, 4)[0], 6, 1, previous=Verdict(1))

        with pytest.raises(ResourceExhausted) as err:
            accept_all()
        assert err.value.reason == "KV_BLOCKS_EXHAUSTED"
        # Nothing changed: the proposal is still pending and takes the verdict later.
        c.free_state(filler)
        accept_all()
        assert c.info().kv_blocks_free == 4 - 2
        c.free_state(state)
