"""The served GPU path (Triton kernels, CUDA graphs) against the torch reference path.

On the CPU the Triton ops run under the interpreter at a small shape; on the GPU
(marker `gpu`) at a larger bf16 shape. Drafts must be equal, except where the
reference's top two logits are within bf16 rounding of each other: there either
token is right, so such a position counts as a tie, not a bug, and the chain is
compared no further (later drafts depend on which one was taken).
"""

from __future__ import annotations

import pytest
import torch

from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.types import ProposeArgs, Verdict
from mtpdraft.service.model.batch import RowBatch
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

# A logit gap this small relative to the logits' scale is within bf16 rounding of
# the layers before it (bf16 keeps 8 bits: 2**-8 ~ 4e-3, times a few roundings).
TIE_GAP = 2e-2


def _batch(head: MTPHead, lengths: list[int], block_size: int, seed: int) -> RowBatch:
    """The last row of each of len(lengths) sequences, with contexts already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    dev, n = head.device, len(lengths)
    width = max(-(-length // block_size) for length in lengths)
    perm = torch.randperm(n * width, generator=gen).reshape(n, width).to(torch.int32)
    pos = torch.tensor(lengths) - 1
    slots = perm[torch.arange(n), pos // block_size].long() * block_size + pos % block_size
    return RowBatch(
        tokens=torch.randint(0, head.config.vocab_size, (n,), generator=gen).to(dev),
        hiddens=torch.randn(n, head.config.hidden_size, generator=gen).to(dev, head.dtype),
        positions=pos.to(dev),
        seq_ids=torch.arange(n, dtype=torch.int32, device=dev),
        slot_mapping=slots.to(dev),
        block_tables=perm.to(dev),
    )


def _assert_drafts_match(ref_logits: torch.Tensor, ref: torch.Tensor, got: torch.Tensor) -> None:
    top2 = ref_logits.float().topk(2, dim=-1).values
    scale = ref_logits.float().abs().amax(dim=-1).clamp_min(1.0)
    tie = (top2[:, 0] - top2[:, 1]) / scale < TIE_GAP
    mismatch = (ref != got) & ~tie
    assert not mismatch.any(), f"drafts differ where no tie: rows {mismatch.nonzero().tolist()}"


def _heads(folder, device: torch.device) -> tuple[MTPHead, MTPHead]:
    weights = load_mtp_weights(folder)
    return MTPHead(weights, device, ops="torch"), MTPHead(weights, device, ops="triton")


def _compare(folder, device: torch.device, lengths: list[int], graphs: bool) -> None:
    ref, fast = _heads(folder, device)
    blocks = len(lengths) * max(-(-length // 16) for length in lengths)
    kv_ref = ref.new_kv_cache(blocks, 16)
    torch.manual_seed(0)
    kv_ref.k.normal_()
    kv_ref.v.normal_()
    kv_fast = fast.new_kv_cache(blocks, 16)
    kv_fast.k.copy_(kv_ref.k)
    kv_fast.v.copy_(kv_ref.v)
    if graphs:
        fast.capture_decode_graphs(kv_fast, max_batch=8)
    batch = _batch(ref, lengths, 16, seed=1)
    h_ref = ref.forward(batch, kv_ref)
    logits = ref.logits(h_ref)
    t_ref, p_ref = ref.draft(h_ref, None)
    h_fast, t_fast, p_fast = fast.decode(batch, kv_fast, None)
    tol = 1e-3 if ref.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(h_fast.float(), h_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kv_fast.k.float(), kv_ref.k.float(), atol=tol, rtol=tol)
    _assert_drafts_match(logits, t_ref, t_fast)
    torch.testing.assert_close(p_fast, p_ref.float(), atol=tol, rtol=tol)


def test_triton_ops_match_torch_ops_on_the_cpu(tmp_path) -> None:
    write_random_checkpoint(tmp_path, "mimo", hidden_size=64, vocab_size=200, seed=7)
    _compare(tmp_path, torch.device("cpu"), [5, 33, 17], graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mimo", "deepseek"])
def test_graphed_triton_path_matches_torch_on_the_gpu(tmp_path, family: str) -> None:
    write_random_checkpoint(
        tmp_path, family, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=2816, vocab_size=32000, dtype=torch.bfloat16, seed=8,
    )  # fmt: skip
    _compare(tmp_path, torch.device("cuda"), [1, 300, 77, 1024, 5], graphs=True)


@pytest.mark.gpu
def test_engine_with_graphs_equals_engine_without(tmp_path) -> None:
    """The same calls on two GPU engines, graphed and eager: the same drafts, bit for bit."""
    write_random_checkpoint(
        tmp_path, "mimo", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=2816, vocab_size=32000, dtype=torch.bfloat16, seed=9,
    )  # fmt: skip
    weights = load_mtp_weights(tmp_path)
    engines = [
        DraftEngine(MTPHead(weights, torch.device("cuda")), kv_blocks=512, max_batch=4,
                    cuda_graphs=graphs)
        for graphs in (True, False)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, 1024, generator=gen) for n in (40, 7, 300, 1)]
    results = []
    for engine in engines:
        states, got = [], []
        for prompt in prompts:
            state = engine.alloc_state()
            session = engine.begin_prefill(state, 1)
            session.append(list(range(1, len(prompt) + 1)), prompt)
            session.finish()
            states.append(state)
        for step in range(3):
            requests = [
                ProposeArgs(s, 5 + step, prompts[i][-1], len(prompts[i]) + 1 + 4 * step, 4,
                            previous=Verdict(3) if step else None)
                for i, s in enumerate(states)
            ]  # fmt: skip
            got.append([(p.tokens, p.probs) for p in engine.propose_batch(requests)])
        results.append(got)
    assert results[0] == results[1]
