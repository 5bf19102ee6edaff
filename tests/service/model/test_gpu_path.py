"""The served GPU path (Triton kernels, CUDA graphs) against the torch reference path.

On the CPU the Triton ops run under the interpreter at a small shape; on the GPU
(marker `gpu`) at a larger bf16 shape. Drafts must be equal, except where the
reference's top two logits are within bf16 rounding of each other: there either
token is right, so such a position counts as a tie, not a bug, and the chain is
compared no further (later drafts depend on which one was taken).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from proposing import ProposeArgs, propose_batch, step_of
from sampling_reference import dense_q, drawn, uniform

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.ids import EPOCH_SHIFT
from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.decode_chain import ChainInputs, ChainSampling
from mtpdraft.service.model.kv_cache import KVCache
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint
from mtpdraft.service.model.tensors import FP8Matrix

# Triton's kernels take CPU tensors only under its interpreter, which tests/conftest.py
# sets where no GPU is; where one is, the GPU tests below hold the same kernels.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is present: no Triton interpreter"
)

# A logit gap this small relative to the logits' scale is within bf16 rounding of
# the layers before it (bf16 keeps 8 bits: 2**-8 ~ 4e-3, times a few roundings).
TIE_GAP = 2e-2


def _chain(
    head: MTPHead, lengths: list[int], limits: list[int], block_size: int, seed: int
) -> ChainInputs:
    """Chains from the last row of each of len(lengths) sequences (contexts already cached)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    width = max(
        -(-(length + limit) // block_size) for length, limit in zip(lengths, limits, strict=True)
    )
    return ChainInputs(
        tokens=torch.randint(0, head.config.vocab_size, (n,), generator=gen).numpy(),
        hiddens=torch.randn(n, head.config.hidden_size, generator=gen).to(head.dtype),
        positions=np.array(lengths) - 1,
        limits=np.array(limits),
        block_tables=torch.randperm(n * width, generator=gen).reshape(n, width).int().numpy(),
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


def _kv_pair(a: MTPHead, b: MTPHead, blocks: int) -> tuple[KVCache, KVCache]:
    """Two caches of the same random contents."""
    kv_a, kv_b = a.new_kv_cache(blocks, 16), b.new_kv_cache(blocks, 16)
    torch.manual_seed(0)
    kv_a.k.normal_()
    kv_a.v.normal_()
    kv_b.k.copy_(kv_a.k)
    kv_b.v.copy_(kv_a.v)
    return kv_a, kv_b


def _compare(folder, device: torch.device, lengths: list[int], graphs: bool) -> None:
    """One step of the fast head's chain (graphed or not) against the torch ops' chain."""
    ref, fast = _heads(folder, device)
    chain = _chain(ref, lengths, [1] * len(lengths), 16, seed=1)
    kv_ref, kv_fast = _kv_pair(ref, fast, len(lengths) * chain.block_tables.shape[1])
    if graphs:
        fast.capture_decode_graphs(kv_fast, max_batch=8, max_steps=4)
    want = ref.decode_chain(kv_ref, chain)
    h_ref = want.hiddens[0]
    logits = ref.logits(h_ref)
    t_ref = torch.tensor(want.tokens[0], device=device)
    p_ref = torch.tensor(want.probs[0], device=device)
    out = fast.decode_chain(kv_fast, chain)
    h_fast = out.hiddens[0]
    t_fast = torch.tensor(out.tokens[0], device=device)
    p_fast = torch.tensor(out.probs[0], device=device)
    tol = 1e-3 if ref.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(h_fast.float(), h_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kv_fast.k.float(), kv_ref.k.float(), atol=tol, rtol=tol)
    _assert_drafts_match(logits, t_ref, t_fast)
    torch.testing.assert_close(p_fast, p_ref.float(), atol=tol, rtol=tol)


# DeepSeek-V3's MLA (YaRN RoPE) over a MoE, small.
MLA = {
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


@interpreted
@pytest.mark.parametrize("family", ["mimo", "glm4_moe", "qwen3_next", "deepseek"])
def test_triton_ops_match_torch_ops_on_the_cpu(tmp_path, family: str) -> None:
    extra = MLA if family == "deepseek" else None
    write_random_checkpoint(
        tmp_path, family, hidden_size=64, vocab_size=200, seed=7, extra_config=extra
    )
    _compare(tmp_path, torch.device("cpu"), [5, 33, 17], graphs=False)


# The MoE families at a larger shape: 16 experts of 512, top 4 (GLM: in 2 groups).
GPU_MOE = {
    "glm4_moe": {"n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
                 "n_group": 2, "topk_group": 1, "head_dim": 128},
    "qwen3_next": {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "head_dim": 128},
    "deepseek": MLA | {"n_routed_experts": 16, "num_experts_per_tok": 4,
                       "moe_intermediate_size": 512, "kv_lora_rank": 512, "q_lora_rank": 256,
                       "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
}  # fmt: skip


def _gpu_checkpoint(tmp_path, family: str, seed: int, extra_config=None) -> None:
    """A bf16 checkpoint of the GPU tests' shape: hidden 1024, 8 heads, a 32000 vocabulary."""
    write_random_checkpoint(
        tmp_path, family, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=2816, vocab_size=32000, dtype=torch.bfloat16, seed=seed,
        extra_config=extra_config,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mimo", "glm4_moe", "qwen3_next", "deepseek"])
def test_graphed_triton_path_matches_torch_on_the_gpu(tmp_path, family: str) -> None:
    _gpu_checkpoint(tmp_path, family, seed=8, extra_config=GPU_MOE.get(family))
    _compare(tmp_path, torch.device("cuda"), [1, 300, 77, 1024, 5], graphs=True)


def _sampling(n: int, support: int, seed: int) -> ChainSampling:
    """Row 1 greedy, the others sampled each its own way (top-p over the whole vocabulary,
    min-p, top-k within the support)."""
    cases = [(0.8, 0, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.2, 20, 1.0, 0.05), (0.5, 0, 1.0, 0.1)]
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*cases, strict=True))
    rows = np.arange(n) % len(cases)
    return ChainSampling(
        temperature=temperature[rows], top_k=top_k[rows], top_p=top_p[rows], min_p=min_p[rows],
        seeds=np.full(n, seed), states=np.arange(n) + 40, first_index=np.arange(n) * 3,
        support=support,
    )  # fmt: skip


@interpreted
@pytest.mark.parametrize("rows", [4, 36])
def test_triton_sampled_chain_matches_torch_on_the_cpu(tmp_path, rows: int) -> None:
    """Sampled drafts through the Triton path and through plain torch: the same drafts, q
    within float32's rounding. 4 rows: the fused LM head writes its logits; 36 (past its
    rows), under a grammar's masks: the greedy pass writes the group maxima top_support
    starts from."""
    write_random_checkpoint(tmp_path, "mimo", hidden_size=64, vocab_size=300, seed=5)
    ref, fast = _heads(tmp_path, torch.device("cpu"))
    assert (rows > fast.ops.LM_HEAD_ROWS) == (rows == 36)
    lengths = [5, 33, 17, 9] * (rows // 4)
    chain = _chain(ref, lengths, [3, 3, 2, 3] * (rows // 4), 16, seed=3)
    chain.sampling = _sampling(rows, 16, seed=11)
    if rows > 4:  # step j allows the tokens of one residue mod (j + 2), and a few more
        allowed = torch.stack([
            (torch.arange(320) % (j + 2) == i % (j + 2)) | (torch.arange(320) < 3 * i)
            for j in range(3) for i in range(rows)
        ]).view(3, rows, 10, 32).int()  # fmt: skip
        chain.bitmasks = (allowed << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    kv_ref, kv_fast = _kv_pair(ref, fast, rows * chain.block_tables.shape[1])
    want, got = ref.decode_chain(kv_ref, chain), fast.decode_chain(kv_fast, chain)
    for i, limit in enumerate(chain.limits):  # drafts past a row's limit are meaningless
        assert (got.tokens[:limit, i] == want.tokens[:limit, i]).all()
        np.testing.assert_allclose(got.q_probs[:limit, i], want.q_probs[:limit, i], atol=1e-5)
        live = want.q_probs[:limit, i] > 0
        assert (got.q_ids[:limit, i][live] == want.q_ids[:limit, i][live]).all()
    assert (got.q_probs[:, 1, 0] == 1).all()  # the greedy row: its draft alone


@pytest.mark.gpu
@pytest.mark.parametrize(("masked", "sampled"), [(False, False), (True, False), (False, True),
                                                 (True, True)])  # fmt: skip
def test_graphed_chain_equals_the_same_kernels_launched_one_by_one(
    tmp_path, masked, sampled
) -> None:
    """Chains of different lengths (masked, sampled): drafts, their q, hiddens and KV equal
    bit for bit."""
    _gpu_checkpoint(tmp_path, "mimo", seed=10)
    weights = load_mtp_weights(tmp_path)
    graphed = MTPHead(weights, torch.device("cuda"), ops="triton")
    eager = MTPHead(weights, torch.device("cuda"), ops="triton")
    limits = [4, 1, 3, 4, 2]
    chain = _chain(graphed, [40, 7, 300, 1, 129], limits, 16, seed=2)
    if masked:  # step j allows only the tokens of one residue mod (j + 2)
        words = (32000 + 31) // 32
        allowed = [
            torch.arange(32 * words) % (j + 2) == i % (j + 2) for j in range(4) for i in range(5)
        ]
        bits = torch.stack(allowed).view(4, 5, words, 32).int()
        chain.bitmasks = (bits << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    if sampled:
        chain.sampling = _sampling(5, 64, seed=7)
    kv_g, kv_e = _kv_pair(graphed, eager, len(limits) * chain.block_tables.shape[1])
    graphed.capture_decode_graphs(kv_g, max_batch=8, max_steps=4, support=64)
    assert graphed._graphs.fits(chain)
    seen: list[torch.Tensor] = []  # before_wait's hiddens, read on the device after the chain
    for _ in range(2):  # a second run reuses the graphs' buffers
        seen.clear()
        got = graphed.decode_chain(kv_g, chain, lambda hiddens: seen.append(hiddens.clone()))
        want = eager.decode_chain(kv_e, chain)
        assert len(seen) == 1 and torch.equal(seen[0], got.hiddens)
        assert (got.tokens == want.tokens).all()
        assert (got.probs == want.probs).all()
        if sampled:
            assert (got.q_ids == want.q_ids).all() and (got.q_probs == want.q_probs).all()
            assert (got.q_probs[:, 1, 1:] == 0).all() and (got.q_probs[:, 0, 1:] > 0).any()
        for i, limit in enumerate(limits):  # outputs past a chain's limit are meaningless
            assert torch.equal(got.hiddens[:limit, i], want.hiddens[:limit, i])
        assert torch.equal(kv_g.k, kv_e.k) and torch.equal(kv_g.v, kv_e.v)
    if masked:
        for j in range(4):
            for i in range(5):
                assert got.tokens[j][i] % (j + 2) == i % (j + 2)


def _issue_ids_in_order(engine: DraftEngine) -> None:
    """State ids 1, 2, ... of epoch 7: a draw is keyed by its state's id, so engines compared
    draw alike only if they issue the same ids."""
    issued = itertools.count(1)
    engine.ids.new = lambda taken: (7 << EPOCH_SHIFT) | next(issued)


def _prefilled(engine: DraftEngine, prompt: torch.Tensor, sampling: Sampling) -> int:
    state = engine.alloc_state(sampling=sampling)
    session = engine.begin_prefill(state, 1)
    session.append(list(range(1, len(prompt) + 1)), prompt)
    session.finish()
    return state


@pytest.mark.gpu
def test_a_sampled_state_drafts_alike_alone_and_in_a_batch_of_64(tmp_path) -> None:
    """One state (its id, seed and prompt alike) on two graphed bf16 engines: alone on one,
    beside 63 others on the other. Each draft is its key's draw from its own q; the two q
    agree within bf16 rounding (one row and 64 rows run different GEMM kernels); so the
    drafts are equal wherever that rounding cannot move the draw."""
    _gpu_checkpoint(tmp_path, "mimo", seed=9)
    weights = load_mtp_weights(tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randn(40 + i, 1024, generator=gen) for i in range(64)]
    sampling, k = Sampling(0.8, top_p=0.95, seed=11), 4
    proposals = []
    for batch in (1, 64):
        config = ServeConfig(kv_blocks=64 * 8, max_batch=64, max_drafts=k)
        engine = DraftEngine(MTPHead(weights, torch.device("cuda")), config)
        _issue_ids_in_order(engine)
        states = [_prefilled(engine, prompt, sampling) for prompt in prompts[:batch]]
        requests = [ProposeArgs(s, 5, prompts[i][-1], len(prompts[i]) + 1, k)
                    for i, s in enumerate(states)]  # fmt: skip
        proposals.append(propose_batch(engine, requests)[0])
        del engine
    alone, batched = proposals
    state = (7 << EPOCH_SHIFT) | 1
    for j in range(k):
        q_alone, q_batched = (dense_q(p, j, 32000) for p in proposals)
        torch.testing.assert_close(q_batched, q_alone, atol=2e-2, rtol=0)
        u = uniform(sampling.seed, state, alone.first_position + j, j)
        for p, q in ((alone, q_alone), (batched, q_batched)):
            want = drawn(q, u, 1e-6)
            assert want is None or p.tokens[j] == want, f"draft {j} is not its key's draw"
        # Rounding moves no cumulative boundary by more than the two q's L1 distance.
        if drawn(q_alone, u, float((q_alone - q_batched).abs().sum()) + 1e-6) is not None:
            assert alone.tokens[j] == batched.tokens[j], f"draft {j}: alone and batched differ"
        if alone.tokens[j] != batched.tokens[j]:
            break  # the chains part: later drafts follow different tokens


@pytest.mark.gpu
def test_a_chain_on_another_kv_cache_is_not_replayed_on_the_captured_one(tmp_path) -> None:
    """A head's graphs read and write the KV they were captured on: a chain handed
    another cache (another engine's, on the same head) runs, step by step, on that one,
    as a head without graphs runs it, and leaves the captured cache as it was."""
    _gpu_checkpoint(tmp_path, "mimo", seed=10)
    weights = load_mtp_weights(tmp_path)
    head = MTPHead(weights, torch.device("cuda"), ops="triton")
    plain = MTPHead(weights, torch.device("cuda"), ops="triton")
    limits = [2, 1, 3]
    chain = _chain(head, [40, 7, 300], limits, 16, seed=3)
    blocks = len(limits) * chain.block_tables.shape[1]
    captured, other = _kv_pair(head, head, blocks)
    _, alone = _kv_pair(head, plain, blocks)  # the same contents again
    head.capture_decode_graphs(captured, max_batch=8, max_steps=4)
    assert head._graphs.fits(chain)
    untouched = captured.k.clone(), captured.v.clone()
    got = head.decode_chain(other, chain)
    want = plain.decode_chain(alone, chain)
    assert torch.equal(captured.k, untouched[0]) and torch.equal(captured.v, untouched[1])
    assert torch.equal(other.k, alone.k) and torch.equal(other.v, alone.v)
    assert (got.tokens == want.tokens).all() and (got.probs == want.probs).all()


@pytest.mark.gpu
def test_engine_with_graphs_equals_engine_without(tmp_path) -> None:
    """The same calls on two GPU engines, graphed and eager: the same drafts (greedy and
    sampled), bit for bit. A draw is keyed by its state's id, so both engines issue the
    same ids."""
    _gpu_checkpoint(tmp_path, "mimo", seed=9)
    weights = load_mtp_weights(tmp_path)
    engines = [
        DraftEngine(MTPHead(weights, torch.device("cuda")),
                    ServeConfig(kv_blocks=512, max_batch=4, cuda_graphs=graphs))
        for graphs in (True, False)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, 1024, generator=gen) for n in (40, 7, 300, 1)]
    results = []
    for engine in engines:
        _issue_ids_in_order(engine)
        states, got = [], []
        for i, prompt in enumerate(prompts):
            sampling = Sampling(0.8, top_p=0.9, seed=i) if i % 2 else Sampling()
            states.append(_prefilled(engine, prompt, sampling))
        for step in range(3):
            requests = [
                ProposeArgs(s, 5 + step, prompts[i][-1], len(prompts[i]) + 1 + 4 * step, 4,
                            previous=Verdict(3) if step else None)
                for i, s in enumerate(states)
            ]  # fmt: skip
            got.append([(p.tokens, p.probs, p.q_ids, p.q_probs)
                        for p in propose_batch(engine, requests)])  # fmt: skip
        results.append(got)
    fields = ("tokens", "probs", "q_ids", "q_probs")
    for step, (graphed, eager) in enumerate(zip(*results, strict=True)):
        for row, (a, b) in enumerate(zip(graphed, eager, strict=True)):
            for name, x, y in zip(fields, a, b, strict=True):
                assert x == y, f"step {step}, row {row}: {name} {x} != {y}"


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_graphed_chain_writes_nothing_for_a_refused_hidden(tmp_path, bad: float) -> None:
    """On a graphed bf16 engine, a verdict sent with a non-finite hidden beside a good row
    is refused (checked while the graph drafts; the graph stops the row at its head): the
    pending rows stay, so a verdict accepting more drafts then drafts, and leaves the KV,
    as the twin state that never saw the refused one."""
    _gpu_checkpoint(tmp_path, "mimo", seed=12)
    config = ServeConfig(kv_blocks=64, max_batch=4, max_drafts=4)
    engine = DraftEngine(MTPHead(load_mtp_weights(tmp_path), torch.device("cuda")), config)
    prompt = torch.randn(40, 1024, generator=torch.Generator().manual_seed(5))
    sampling = Sampling()
    states = [_prefilled(engine, prompt, sampling) for _ in range(3)]
    propose_batch(engine, [ProposeArgs(s, 5, prompt[-1], 41, 4) for s in states])
    refused, untouched, beside = states
    hidden = prompt[7].clone()
    hidden[100] = bad
    step = engine.step(step_of(
        [ProposeArgs(refused, 6, hidden, 43, 4, previous=Verdict(1)),
         ProposeArgs(beside, 6, prompt[8], 43, 4, previous=Verdict(1))], engine.step_shape,
    ))  # fmt: skip
    assert list(step.errors) == [0] and step.errors[0].reason == "NOT_FINITE"
    assert step.counts[1] == 4
    later = [ProposeArgs(s, 7, prompt[9], 45, 4, previous=Verdict(3)) for s in states[:2]]
    got, want = (propose_batch(engine, [args])[0] for args in later)
    assert (got.tokens, got.probs) == (want.tokens, want.probs)
    rows = 40 + 4 + 4  # the prompt, R0 and 3 accepted drafts, the new proposal's rows
    for cache in (engine.kv.k, engine.kv.v):
        a, b = (cache[torch.tensor(engine.states[s].blocks)].flatten(0, 1)[:rows]
                for s in (refused, untouched))  # fmt: skip
        assert torch.equal(a, b)


@interpreted
def test_fp8_weights_read_by_the_kernels_match_the_dequantized_ones_on_the_cpu(tmp_path) -> None:
    """DeepSeek's FP8 weights: fused_moe (the experts, the shared one as expert E) and the
    GEMV (every other matrix but kv_b_proj, which MLA absorbs) scale them block by block on
    the Triton path; the torch path multiplies them out at load. Same drafts."""
    from deepseek_checkpoints import write_deepseek_checkpoint

    write_deepseek_checkpoint(tmp_path, fp8=True, seed=2)
    weights = load_mtp_weights(tmp_path)
    assert weights.tensors["experts_gate_up"].dtype == torch.float8_e4m3fn
    fast, plain = (MTPHead(weights, torch.device("cpu"), ops=o) for o in ("triton", "torch"))
    assert isinstance(fast.o_proj, FP8Matrix) and plain.o_proj.dtype == torch.float32
    assert isinstance(fast.mla.q_b, FP8Matrix) and isinstance(fast.moe.shared_down, FP8Matrix)
    assert fast.moe.shared_column == "one" and fast.moe.experts_down.shape[0] == 9  # 8 + shared
    _compare(tmp_path, torch.device("cpu"), [5, 33, 17], graphs=False)


def test_an_fp8_matrix_takes_a_prefill_chunk_past_the_gemv_rows() -> None:
    """70 rows (a prefill chunk) through the GEMV 64 at a time: the product with the matrix
    dequantized, as the torch ops compute it."""
    from mtpdraft.service.model.ops import ops_for

    gen = torch.Generator().manual_seed(4)
    scale = torch.rand(3, 2, generator=gen) / 64 + 1e-3
    values = (torch.randn(40, 32, generator=gen) * 100).to(torch.float8_e4m3fn)
    matrix = FP8Matrix(values, scale, (16, 16))
    x = torch.randn(70, 32, generator=gen)
    triton_ops, torch_ops = (ops_for(torch.device("cpu"), o) for o in ("triton", "torch"))
    got = triton_ops.linear(x, matrix)
    want = torch_ops.linear(x, matrix.dequantized(torch.float32))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
