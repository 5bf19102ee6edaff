"""ChainInputs.step_rows, and the eager chain against one forward per step."""

from __future__ import annotations

import numpy as np
import torch

from mtpdraft.service.model.batch import RowBatch
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.decode_chain import ChainInputs
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint


def _chain(hidden_size: int = 8) -> ChainInputs:
    return ChainInputs(
        tokens=np.array([3, 4]),
        hiddens=torch.zeros(2, hidden_size),
        positions=np.array([6, 1]),
        limits=np.array([3, 1]),
        block_tables=np.array([[9, 2, 7], [5, 0, 0]], dtype=np.int32),
    )


def test_step_rows_walk_positions_and_stop_writing_past_the_limit() -> None:
    rows = _chain().step_rows(block_size=4)
    assert rows.shape == (3, 3, 2)
    positions, slots, context_lens = (rows[:, i] for i in range(3))
    # Sequence 0 writes rows 6, 7, 8 (blocks 2, 2, 7); sequence 1 writes row 1 only,
    # then repeats it (a valid context) without writing.
    assert positions.tolist() == [[6, 1], [7, 1], [8, 1]]
    assert slots.tolist() == [[2 * 4 + 2, 5 * 4 + 1], [2 * 4 + 3, -1], [7 * 4 + 0, -1]]
    assert (context_lens == positions + 1).all()


def test_eager_chain_feeds_each_step_its_predecessor(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "mimo", hidden_size=64, vocab_size=200, seed=3)
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"))
    chain = _chain(64)
    chain.hiddens = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    kv_chain, kv_steps = head.new_kv_cache(10, 4), head.new_kv_cache(10, 4)
    for kv in (kv_chain, kv_steps):
        kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)))
        kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)))
    seen: list[torch.Tensor] = []
    out = head.decode_chain(kv_chain, chain, lambda hiddens: seen.append(hiddens))
    # The caller's host work ran once, given the steps' output hiddens.
    assert len(seen) == 1 and torch.equal(seen[0], out.hiddens)
    tokens, hiddens = torch.from_numpy(chain.tokens), chain.hiddens
    for j, (positions, slots, context_lens) in enumerate(torch.from_numpy(chain.step_rows(4))):
        batch = RowBatch(
            tokens, hiddens, positions, torch.arange(2, dtype=torch.int32), slots,
            torch.from_numpy(chain.block_tables), context_lens,
        )  # fmt: skip
        hiddens, drafts, probs = head.decode(batch, kv_steps, None)
        assert out.tokens[j].tolist() == drafts.tolist()
        torch.testing.assert_close(torch.tensor(out.probs[j]), probs)
        torch.testing.assert_close(out.hiddens[j], hiddens)
        tokens = drafts
    assert torch.equal(kv_chain.k, kv_steps.k) and torch.equal(kv_chain.v, kv_steps.v)
