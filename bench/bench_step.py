"""`make bench`: the draft step on the GPU against the HBM roofline, eager torch and
torch.compile + CUDA graph, in the MiMo-7B MTP shape with random weights.

One draft step = one MTP row per state (embedding + hidden in, KV written, paged
attention over the state's context) plus its logits and the draft (argmax and
top-1 probability): what each chained draft costs. Measured for this project's
served path (Triton kernels, cuBLAS GEMMs, replayed from a CUDA graph: one replay
per step, its inputs staged before the chain), the same math in eager torch (the
reference ops), and the same math written densely and compiled with
torch.compile(mode="reduce-overhead") (CUDA graphs; its inputs copied in per
call), all in one run. Also the whole served chain of K = 4 drafts per draft
(staging, 4 replays and the host's wait for the results: what a proposal costs).
Roofline = (weight bytes + KV bytes read) / device copy bandwidth measured in the
same run. Writes bench/results/step.json and step.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from results_file import write_results
from scratch import scratch_folder
from shapes import MIMO_7B, SMALL

from mtpdraft.service.model.batch import RowBatch
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.decode_chain import ChainInputs
from mtpdraft.service.model.decode_graphs import DecodeGraphs
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

BLOCK = 16
CHAIN = 4  # drafts per proposal in the chain column


def timed(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds of fn() over iters calls, after warm-up."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (bytes read + written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 20, device)
    return 2 * n / (ms / 1e3)


def weight_bytes(head: MTPHead, batch: int) -> int:
    """Bytes one draft step must read: every matrix once, and B embedding rows."""
    mats = [head.input_proj, head.qkv, head.o_proj, head.gate_up, head.down_proj, head.lm_head]
    total = sum(m.numel() * m.element_size() for m in mats)
    return total + batch * head.embed.shape[1] * head.embed.element_size()


def make_chain(head: MTPHead, b: int, ctx: int, gen: torch.Generator) -> tuple[ChainInputs, int]:
    """b states of ctx rows each (the last one computed by the step); blocks for CHAIN more."""
    per_seq = math.ceil((ctx + CHAIN) / BLOCK)
    chain = ChainInputs(
        tokens=torch.randint(0, head.config.vocab_size, (b,), generator=gen).numpy(),
        hiddens=torch.randn(b, head.config.hidden_size, generator=gen).to(head.dtype),
        positions=np.full(b, ctx - 1),
        limits=np.ones(b, dtype=np.int64),
        block_tables=torch.randperm(b * per_seq, generator=gen).reshape(b, per_seq).int().numpy(),
    )
    return chain, b * per_seq


def first_step(chain: ChainInputs, device: torch.device) -> RowBatch:
    positions, slots, context_lens = torch.from_numpy(chain.step_rows(BLOCK)[0]).to(device)
    return RowBatch(
        tokens=torch.from_numpy(chain.tokens).to(device),
        hiddens=chain.hiddens.to(device),
        positions=positions,
        seq_ids=torch.arange(len(chain), dtype=torch.int32, device=device),
        slot_mapping=slots,
        block_tables=torch.from_numpy(chain.block_tables).to(device),
        context_lens=context_lens,
    )


def timed_replay(graphs: DecodeGraphs, chain: ChainInputs, iters: int) -> float:
    """Median milliseconds of one step's graph replay, its inputs staged (untimed) before."""
    for _ in range(3):
        graphs.stage(chain).replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        graph = graphs.stage(chain)
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def timed_chain(graphs: DecodeGraphs, chain: ChainInputs, iters: int) -> float:
    """Median wall milliseconds per draft of a whole served chain (stage, replays, wait)."""
    times = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        graphs.run(chain)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3 / chain.steps)
    return statistics.median(times)


def dense_step(head: MTPHead):
    """The same math over a dense [B, L, Hkv, D] cache, as one would write it for compile."""
    c, eps = head.config, head.config.rms_norm_eps

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def rope(x, cos, sin):
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
        return torch.cat([rot, x[..., 2 * half :]], -1)

    def step(tokens, hiddens, pos, k_cache, v_cache):
        b = tokens.shape[0]
        e = norm(F.embedding(tokens, head.embed), head.norm_embed)
        h = norm(hiddens, head.norm_hidden)
        x = F.linear(torch.cat([h, e], -1), head.input_proj)
        y = norm(x, head.input_layernorm)
        q, k, v = F.linear(y, head.qkv, head.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], -1)
        cos, sin = head.cos_sin[pos].chunk(2, -1)
        cos, sin = cos[:, None], sin[:, None]
        q = rope(q.view(b, c.num_attention_heads, c.head_dim), cos, sin)
        k = rope(k.view(b, c.num_key_value_heads, c.head_dim), cos, sin)
        rows = torch.arange(b, device=tokens.device)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v.view(b, c.num_key_value_heads, c.head_dim)
        attn = F.scaled_dot_product_attention(
            q[:, :, None], k_cache.transpose(1, 2), v_cache.transpose(1, 2), enable_gqa=True
        )
        x = x + F.linear(attn.reshape(b, c.q_size), head.o_proj)
        y = norm(x, head.post_attention_layernorm)
        g, u = F.linear(y, head.gate_up).chunk(2, -1)
        x = x + F.linear((F.silu(g.float()) * u.float()).to(x.dtype), head.down_proj)
        logits = F.linear(norm(x, head.final_norm), head.lm_head).float()
        best, token = logits.max(-1)
        return token, 1.0 / torch.exp(logits - best[:, None]).sum(-1)

    return step


def measure(
    fast: MTPHead,
    eager: MTPHead,
    compiled,
    b: int,
    ctx: int,
    gen: torch.Generator,
    bandwidth: float,
    kv_per_token: int,
    iters: int,
) -> dict:
    """One (batch, context) point: every peer on the same inputs."""
    device, c = fast.device, fast.config
    chain, blocks = make_chain(fast, b, ctx, gen)
    batch = first_step(chain, device)
    kv = fast.new_kv_cache(blocks, BLOCK)
    kv.k.normal_()
    kv.v.normal_()
    row: dict = {"batch": b, "context": ctx}
    row["roofline_ms"] = (weight_bytes(fast, b) + b * ctx * kv_per_token) / bandwidth * 1e3
    if device.type == "cuda":
        graphs = DecodeGraphs(fast, kv, b, CHAIN, buckets=(b,), masks=(False,))
        row["mtpdraft_ms"] = timed_replay(graphs, chain, iters)
        chain.limits = np.full(b, CHAIN)
        row["chain_ms_per_draft"] = timed_chain(graphs, chain, iters)
    else:
        row["mtpdraft_ms"] = timed(lambda: fast.decode_chain(kv, chain), 5, device)
    row["eager_torch_ms"] = timed(
        lambda: eager.draft(eager.forward(batch, kv), None), max(5, iters // 5), device
    )
    if compiled is not None:
        shape_kv = (b, ctx, c.num_key_value_heads, c.head_dim)
        k_dense = torch.randn(shape_kv, device=device, dtype=fast.dtype)
        v_dense = torch.randn(shape_kv, device=device, dtype=fast.dtype)
        inputs = (batch.tokens, batch.hiddens, batch.positions, k_dense, v_dense)
        try:
            row["compile_graph_ms"] = timed(lambda: compiled(*inputs), iters, device)
        except Exception as exc:  # record it, keep measuring the rest
            row["compile_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["vs_roofline"] = row["mtpdraft_ms"] / row["roofline_ms"]
    if "compile_graph_ms" in row:
        row["vs_compile_graph"] = row["mtpdraft_ms"] / row["compile_graph_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    shape = SMALL if args.small else MIMO_7B
    folder = scratch_folder("bench-step-", in_memory=True)
    write_random_checkpoint(
        folder, "mimo", **shape, dtype=torch.bfloat16, seed=0,
        extra_config={"max_position_embeddings": 32768},
    )  # fmt: skip
    weights = load_mtp_weights(folder)
    fast = MTPHead(weights, device, ops="triton" if device.type == "cuda" else "torch")
    eager = MTPHead(weights, device, ops="torch")
    bandwidth = copy_bandwidth(device)
    c = fast.config
    kv_per_token = 2 * c.num_key_value_heads * c.head_dim * fast.embed.element_size()
    compiled = None
    if not args.no_compile:
        compiled = torch.compile(dense_step(eager), mode="reduce-overhead")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in contexts:
        for b in batches:
            row = measure(fast, eager, compiled, b, ctx, gen, bandwidth, kv_per_token, args.iters)
            print(json.dumps(row), flush=True)
            rows.append(row)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    reserve = 4 << 30  # activations, graphs and the allocator's slack
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        "dtype": "bfloat16",
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "weight_bytes_batch1": weight_bytes(fast, 1),
        "kv_bytes_per_token": kv_per_token,
        "max_states_at_8k_context": max(0, (free - reserve) // (8192 * kv_per_token)),
        "rows": rows,
    }
    write_results(args.out_dir, "step", report, markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"Draft step (one MTP row per state + logits + draft), {report['device']}, "
        f"{report['dtype']}, hidden {report['shape']['hidden_size']}, vocab "
        f"{report['shape']['vocab_size']}. Copy bandwidth "
        f"{report['copy_bandwidth_tb_s']:.2f} TB/s; "
        f"KV {report['kv_bytes_per_token']} B/token; at most "
        f"{report['max_states_at_8k_context']} states of 8k context fit.",
        "",
        f"Command: `{report['command']}`",
        "",
        "mtpdraft ms: one draft step (its graph replayed, inputs in place, as every step of "
        f"a chain runs); chain ms/draft: a whole served chain of {CHAIN} drafts (staging, "
        f"{CHAIN} replays, the host's wait) over {CHAIN}.",
        "",
        "| batch | context | roofline ms | mtpdraft ms | chain ms/draft | eager torch ms "
        "| compile+graph ms | mtpdraft / roofline | mtpdraft / compile+graph "
        "| chain / compile+graph |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        comp = f"{r['compile_graph_ms']:.3f}" if "compile_graph_ms" in r else "n/a"
        ratio = f"{r['vs_compile_graph']:.2f}x" if "vs_compile_graph" in r else "n/a"
        chain = f"{r['chain_ms_per_draft']:.3f}" if "chain_ms_per_draft" in r else "n/a"
        chain_ratio = (
            f"{r['chain_ms_per_draft'] / r['compile_graph_ms']:.2f}x"
            if "chain_ms_per_draft" in r and "compile_graph_ms" in r
            else "n/a"
        )
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['roofline_ms']:.3f} | {r['mtpdraft_ms']:.3f} "
            f"| {chain} | {r['eager_torch_ms']:.3f} | {comp} | {r['vs_roofline']:.2f}x "
            f"| {ratio} | {chain_ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
