"""The MTP forward against the float64 oracle, for both namings, over a paged KV cache."""

from __future__ import annotations

import pytest
import torch
from mtp_reference import Reference

from mtpdraft.service.model.batch import RowBatch
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

CASES = {
    "mimo": {},
    "deepseek-glm": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "deepseek": {},
}


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_the_oracle_over_scattered_blocks(tmp_path, case: str) -> None:
    family = case.split("-")[0]
    write_random_checkpoint(tmp_path, family, seed=5, extra_config=CASES[case])
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"))
    ref = Reference(tmp_path)
    kv = head.new_kv_cache(num_blocks=16, block_size=4)
    gen = torch.Generator().manual_seed(0)
    # Two sequences of 11 and 6 rows in non-contiguous blocks, in two forwards each.
    lengths, tables = [11, 6], [[9, 2, 14], [5, 0]]
    toks = [torch.randint(0, 200, (n,), generator=gen) for n in lengths]
    hids = [torch.randn(n, 64, generator=gen) for n in lengths]
    outs: list[list[torch.Tensor]] = [[], []]
    for lo, hi in [(0, 5), (5, None)]:
        rows = [(s, r) for s in range(2) for r in range(lengths[s])[lo:hi]]
        batch = RowBatch(
            tokens=torch.stack([toks[s][r] for s, r in rows]),
            hiddens=torch.stack([hids[s][r] for s, r in rows]),
            positions=torch.tensor([r for _, r in rows]),
            seq_ids=torch.tensor([s for s, _ in rows], dtype=torch.int32),
            slot_mapping=torch.tensor([tables[s][r // 4] * 4 + r % 4 for s, r in rows]),
            block_tables=torch.tensor([tables[0], [*tables[1], 0]], dtype=torch.int32),
        )
        out = head.forward(batch, kv)
        for (s, _), o in zip(rows, out, strict=True):
            outs[s].append(o)
    for s in range(2):
        expected = ref.rows(toks[s].tolist(), hids[s])
        got = torch.stack(outs[s]).double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            head.logits(torch.stack(outs[s])).double(), ref.logits(expected), atol=1e-3, rtol=1e-4
        )


def test_embedding_is_zeroed_only_at_position_zero(tmp_path) -> None:
    """Row 0 ignores its token (vLLM masks it); later rows depend on theirs."""
    write_random_checkpoint(tmp_path, "mimo", seed=6)
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"))
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))

    def first_row(token: int, position: int) -> torch.Tensor:
        kv = head.new_kv_cache(4, 4)
        batch = RowBatch(
            tokens=torch.tensor([token]),
            hiddens=hidden,
            positions=torch.tensor([position]),
            seq_ids=torch.tensor([0], dtype=torch.int32),
            slot_mapping=torch.tensor([position]),
            block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        )
        return head.forward(batch, kv)

    assert torch.equal(first_row(3, 0), first_row(150, 0))
    assert not torch.allclose(first_row(3, 5), first_row(150, 5))
