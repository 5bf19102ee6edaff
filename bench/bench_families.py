"""`make bench` (second part): the MoE families' draft step against their roofline and
torch.compile + CUDA graph, at GLM-4.5-Air's and Qwen3-Next-80B's published MTP shapes
(bench/shapes.py; random weights, built in GPU memory).

A MoE decode step reads only the experts its batch routes to, so the roofline is
(the dense weights + the distinct experts the batch's routing touched + the KV read)
over the device copy bandwidth measured in the same run. The distinct experts are
counted from the routing of the measured step itself. Peers, in the same run: the
same math in eager torch (the reference ops), and written densely for
torch.compile(mode="reduce-overhead") (CUDA graphs) in its two natural MoE forms,
every expert over every row weighted by its routing weight ("dense"), or each row's
k experts gathered ("gather"); the faster form is the peer. Also the GPU memory of
the weights and of a KV pool for 64 states of 8k context.
Writes bench/results/families.json and families.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import numpy as np
import torch
import torch.nn.functional as F
from bench_step import (
    BLOCK,
    CHAIN,
    copy_bandwidth,
    first_step,
    make_chain,
    timed,
    timed_chain,
    timed_replay,
)  # fmt: skip
from results_file import write_results
from shapes import DEEPSEEK_V3, GLM_45_AIR, QWEN3_NEXT_80B, SMALL_MLA, SMALL_MOE

from mtpdraft.service.model import moe as moe_module
from mtpdraft.service.model.checkpoint import mtp_weights_from
from mtpdraft.service.model.decode_graphs import DecodeGraphs
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import random_tensors
from mtpdraft.service.model.tensors import FP8Matrix, TensorDict, dequantize_blocks

FAMILIES = {
    "glm-4.5-air": ("glm4_moe", GLM_45_AIR),
    "qwen3-next-80b": ("qwen3_next", QWEN3_NEXT_80B),
    "deepseek-v3": ("deepseek", DEEPSEEK_V3),
}
DT = torch.bfloat16


def tensors_of(*values) -> list:
    """The values, an FP8 matrix as its two tensors (values and scales)."""
    return [p for v in values for p in ((v.values, v.scale) if isinstance(v, FP8Matrix) else (v,))]


def nbytes(*tensors: torch.Tensor | FP8Matrix | None) -> int:
    """Bytes of the tensors (an FP8 matrix: its values and its scales)."""
    return sum(p.numel() * p.element_size() for p in tensors_of(*tensors) if p is not None)


# The matrices DeepSeek-V3's published checkpoint stores as FP8 (by their last name part).
FP8_MATRICES = (
    "q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def fp8_weights(cfg: dict, tensors: dict) -> dict:
    """The weights a block-FP8 checkpoint stores as FP8 (the experts, the shared expert,
    the attention's matrices), so stored when cfg says FP8 (in place, one tensor at a
    time): e4m3 values and one fp32 scale per block."""
    block = (cfg.get("quantization_config") or {}).get("weight_block_size")
    if not block:
        return tensors
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in FP8_MATRICES]:
        w = tensors.pop(name)
        r, c = w.shape
        blocks = F.pad(w.float(), (0, -c % block[1], 0, -r % block[0]))
        blocks = blocks.view(-(-r // block[0]), block[0], -(-c // block[1]), block[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
        tensors[f"{name}_scale_inv"] = scale
        full = scale.repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]
        tensors[name] = (w.float() / full).to(torch.float8_e4m3fn)
    return tensors


def step_bytes(head: MTPHead, batch: int, experts_touched: int) -> int:
    """Bytes a draft step reads: dense matrices, the touched experts, B embedding rows."""
    m, a = head.moe, head.mla
    attention = (
        nbytes(head.qkv, head.qkv_bias)
        if a is None
        else nbytes(a.q_a, a.q_a_norm, a.q_b, a.kv_a, a.w_uk, a.w_uv_t)
    )
    dense = attention + nbytes(head.input_proj, head.o_proj, head.lm_head, m.router)
    dense += nbytes(m.shared_gate_up, m.shared_down, m.shared_gate)
    per_expert = nbytes(m.experts_gate_up[0], m.experts_down[0])
    if m.scales:  # FP8 experts: their bytes and their block scales
        per_expert += nbytes(m.scales["gate_up_scale"][0], m.scales["down_scale"][0])
    return dense + experts_touched * per_expert + batch * nbytes(head.embed[0])


def experts_touched(head: MTPHead, batch, kv) -> int:
    """Distinct experts the step's routing picks (one eager forward, its router recorded)."""
    seen = []
    select = moe_module.select_experts

    def recording(*args, **kwargs):
        ids, weights = select(*args, **kwargs)
        seen.append(ids)
        return ids, weights

    moe_module.select_experts = recording
    try:
        head.forward(batch, kv)
    finally:
        moe_module.select_experts = select
    return int(seen[0].unique().numel())  # routed experts only (the shared one is dense)


def dense_step(head: MTPHead, form: str):
    """The same math over a dense [B, L, Hkv, D] cache, written for torch.compile."""
    c, m, eps = head.config, head.moe, head.config.rms_norm_eps

    def norm(x, w):
        scale = 1.0 + w.float() if c.norm_unit_offset else w.float()
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)

    def rope(x, cos, sin):
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
        return torch.cat([rot, x[..., 2 * half :]], -1)

    def swiglu(gu):
        g, u = gu.float().chunk(2, -1)
        return (F.silu(g) * u).to(gu.dtype)

    def weights(name, ids=None):
        """Experts (all, or those of `ids`), FP8 ones scaled in the compiled graph."""
        w = getattr(m, f"experts_{name}")[: m.moe.num_experts]  # the shared one may follow
        w = w if ids is None else w[ids]
        if not m.scales:
            return w
        scale = m.scales[f"{name}_scale"]
        scale = scale if ids is None else scale[ids]
        return dequantize_blocks(w, scale, m.scales["scale_block"]).to(DT)

    def experts(y, ids, w):
        if form == "dense":  # every expert over every row; unrouted rows weigh 0
            weight = torch.zeros(y.shape[0], m.moe.num_experts, device=y.device)
            weight = weight.scatter(1, ids, w)
            act = swiglu(torch.einsum("bh,eih->ebi", y, weights("gate_up")))
            out = torch.einsum("ebi,ehi->ebh", act, weights("down")).float()
            return (out * weight.T[..., None]).sum(0).to(y.dtype)
        act = swiglu(torch.einsum("bh,bkih->bki", y, weights("gate_up", ids)))
        out = torch.einsum("bki,bkhi->bkh", act, weights("down", ids)).float()
        return (out * w[..., None]).sum(1).to(y.dtype)

    def gqa(y, pos, k_cache, v_cache):
        b, heads, kvh, d = y.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        gate_size = c.q_size if c.attn_output_gate else 0
        q, gate, k, v = F.linear(y, head.qkv, head.qkv_bias).split(
            [c.q_size, gate_size, c.kv_size, c.kv_size], -1
        )
        q, k = q.view(b, heads, d), k.view(b, kvh, d)
        if c.qk_norm:
            q, k = norm(q, head.q_norm), norm(k, head.k_norm)
        cos, sin = head.cos_sin[pos].chunk(2, -1)
        q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
        rows = torch.arange(b, device=y.device)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v.view(b, kvh, d)
        attn = F.scaled_dot_product_attention(
            q[:, :, None], k_cache.transpose(1, 2), v_cache.transpose(1, 2), enable_gqa=True
        ).reshape(b, c.q_size)
        return attn * torch.sigmoid(gate) if gate_size else attn

    def mla(y, pos, latent):  # absorbed, over a dense [B, L, R + P] latent cache
        a, m, b = head.mla, c.mla, y.shape[0]
        x = y if a.q_a is None else norm(F.linear(y, a.q_a), a.q_a_norm)
        q = F.linear(x, a.q_b).view(b, c.num_attention_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        kv = F.linear(y, a.kv_a)
        c_kv, k_pe = norm(kv[:, : m.kv_lora_rank], a.kv_a_norm), kv[:, m.kv_lora_rank :]
        cos, sin = head.cos_sin[pos].chunk(2, -1)
        q_pe = rope_pairs(q_pe, cos[:, None], sin[:, None])
        k_pe = rope_pairs(k_pe[:, None], cos[:, None], sin[:, None])[:, 0]
        latent[torch.arange(b, device=y.device), pos] = torch.cat([c_kv, k_pe], -1)
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, a.w_uk)
        scores = torch.einsum("bhr,blr->bhl", torch.cat([q_latent, q_pe], -1), latent).float()
        probs = (scores * a.scale).softmax(-1).to(y.dtype)
        out = torch.einsum("bhl,blr->bhr", probs, latent[..., : m.kv_lora_rank])
        return torch.einsum("bhr,hrv->bhv", out, a.w_uv_t).reshape(b, -1)

    def rope_pairs(x, cos, sin):
        even, odd = x[..., 0::2].float(), x[..., 1::2].float()
        rot = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1)
        return rot.flatten(-2).to(x.dtype)

    def step(tokens, hiddens, pos, k_cache, v_cache):
        e, h = (
            norm(F.embedding(tokens, head.embed), head.norm_embed),
            norm(hiddens, head.norm_hidden),
        )
        x = F.linear(torch.cat([e, h], -1), head.input_proj)
        y = norm(x, head.input_layernorm)
        attn = gqa(y, pos, k_cache, v_cache) if c.mla is None else mla(y, pos, k_cache)
        x = x + F.linear(attn, head.o_proj)
        y = norm(x, head.post_attention_layernorm)
        logits = moe_module.router_logits(y, m.router, m.moe)
        ids, w = moe_module.select_experts(logits, m.router_bias, m.moe)
        mlp = experts(y, ids, w)
        if m.shared_gate_up is not None:
            shared = F.linear(swiglu(F.linear(y, m.shared_gate_up)), m.shared_down)
            if m.shared_gate is not None:
                shared = torch.sigmoid(F.linear(y, m.shared_gate)) * shared
            mlp = mlp + shared
        logits = F.linear(norm(x + mlp, head.final_norm), head.lm_head).float()
        best, token = logits.max(-1)
        return token, 1.0 / torch.exp(logits - best[:, None]).sum(-1)

    return step


def measure_point(fast, eager, compiled, b: int, args, gen, bandwidth: float) -> dict:
    """One batch size: every peer on the same inputs."""
    device, c = fast.device, fast.config
    kv_per_token = fast.kv_row_values * fast.embed.element_size()
    chain, blocks = make_chain(fast, b, args.context, gen)
    batch = first_step(chain, device)
    kv = fast.new_kv_cache(blocks, BLOCK)
    kv.k.normal_()
    kv.v.normal_()
    touched = experts_touched(eager, batch, kv)
    row = {"batch": b, "context": args.context, "experts_touched": touched}
    kv_bytes = b * args.context * kv_per_token
    row["roofline_ms"] = (step_bytes(fast, b, touched) + kv_bytes) / bandwidth * 1e3
    if device.type == "cuda":
        graphs = DecodeGraphs(fast, kv, b, CHAIN, buckets=(b,), masks=(False,))
        row["mtpdraft_ms"] = timed_replay(graphs, chain, args.iters)
        chain.limits = np.full(b, CHAIN)
        row["chain_ms_per_draft"] = timed_chain(graphs, chain, args.iters)
        del graphs
    else:
        row["mtpdraft_ms"] = timed(lambda: fast.decode_chain(kv, chain), 3, device)
    row["eager_torch_ms"] = timed(
        lambda: eager.draft(eager.forward(batch, kv), None), max(3, args.iters // 10), device
    )
    for form, fn in compiled.items():
        shape_kv = (b, args.context, c.num_key_value_heads, c.head_dim)
        if c.mla is not None:  # one dense latent cache; v_cache unused
            shape_kv = (b, args.context, fast.kv_row_values)
        k_dense = torch.randn(shape_kv, device=device, dtype=DT)
        v_dense = torch.randn(shape_kv, device=device, dtype=DT)
        inputs = (batch.tokens, batch.hiddens, batch.positions, k_dense, v_dense)
        try:
            row[f"compile_{form}_ms"] = timed(lambda fn=fn, x=inputs: fn(*x), args.iters, device)
        except Exception as exc:  # record it (e.g. out of memory), keep measuring
            row[f"compile_{form}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        del k_dense, v_dense
    peers = {f: row[f"compile_{f}_ms"] for f in args.forms if f"compile_{f}_ms" in row}
    if peers:
        row["compile_best"] = min(peers, key=peers.get)
        row["compile_graph_ms"] = peers[row["compile_best"]]
        row["vs_compile_graph"] = row["mtpdraft_ms"] / row["compile_graph_ms"]
    row["vs_roofline"] = row["mtpdraft_ms"] / row["roofline_ms"]
    return row


def held_bytes(head: MTPHead) -> int:
    """GPU bytes of the weights a head holds, each storage once (views of one tensor, as
    the shared expert stored beside the routed ones, count once)."""
    storages = {}
    for part in (head, head.moe, head.mla):
        for value in vars(part).values() if part is not None else ():
            values = value.values() if isinstance(value, dict) else (value,)
            for t in tensors_of(*values):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_family(name: str, args, device: torch.device, bandwidth: float) -> dict:
    family, shape = FAMILIES[name]
    small = (SMALL_MOE | (SMALL_MLA if family == "deepseek" else {})) if args.small else {}
    cfg = shape | small
    torch.cuda.empty_cache() if device.type == "cuda" else None
    weights = mtp_weights_from(
        cfg, TensorDict(fp8_weights(cfg, random_tensors(cfg, family, dtype=DT, device=device)))
    )
    fast = MTPHead(weights, device, ops="triton" if device.type == "cuda" else "torch")
    kv_per_token = fast.kv_row_values * fast.embed.element_size()
    report: dict = {"family": family, "shape": cfg, "kv_bytes_per_token": kv_per_token}
    if device.type == "cuda":
        report["weights_gib"] = held_bytes(fast) / 2**30
        report["kv_pool_64x8k_gib"] = 64 * 8192 * kv_per_token / 2**30
    eager = MTPHead(weights, device, ops="torch")
    compiled = {}
    if not args.no_compile:
        # Every family compiles the same `step` code: without a reset, dynamo's guards can
        # hand one family another's graph (its experts; an index out of bounds).
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = 4 * len(args.batches) * len(args.forms)
        compiled = {
            f: torch.compile(dense_step(eager, f), mode="reduce-overhead") for f in args.forms
        }
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batches:
        row = measure_point(fast, eager, compiled, b, args, gen, bandwidth)
        print(json.dumps({"family": name} | row), flush=True)
        rows.append(row)
    del fast, eager, weights, compiled
    report["rows"] = rows
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--forms", default="dense,gather", help="compiled MoE forms")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.forms = args.forms.split(",")
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "families": {},
    }
    for name in args.families.split(","):  # written after each family: a cut run keeps some
        report["families"][name] = measure_family(name, args, device, bandwidth)
        write_results(args.out_dir, "families", report, markdown(report))
    print(markdown(report))
    return 0


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "n/a"


def markdown(report: dict) -> str:
    lines = [
        f"MoE families' draft step (one MTP row per state + logits + draft), {report['device']}, "
        f"{report['dtype']}, random weights at the published shapes. Copy bandwidth "
        f"{report['copy_bandwidth_tb_s']:.2f} TB/s. Roofline: dense weights + the distinct "
        "experts the step's routing touched + KV, at that bandwidth. compile+graph: the "
        "faster of the two compiled MoE forms (dense over every expert, or each row's "
        "experts gathered).",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    for name, fam in report["families"].items():
        memory = (
            f" Weights {fam['weights_gib']:.2f} GiB on the GPU; KV {fam['kv_bytes_per_token']} "
            f"B/token, {fam['kv_pool_64x8k_gib']:.2f} GiB for 64 states of 8k context."
            if "weights_gib" in fam
            else ""
        )
        lines += [
            f"**{name}** ({fam['family']}).{memory}",
            "",
            "| batch | context | experts touched | roofline ms | mtpdraft ms | chain ms/draft "
            "| eager torch ms | compile+graph ms (form) | mtpdraft / roofline "
            "| mtpdraft / compile+graph |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in fam["rows"]:
            comp = _ms(r, "compile_graph_ms") + (
                f" ({r['compile_best']})" if "compile_best" in r else ""
            )
            ratio = f"{r['vs_compile_graph']:.2f}x" if "vs_compile_graph" in r else "n/a"
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['experts_touched']} "
                f"| {r['roofline_ms']:.3f} | {r['mtpdraft_ms']:.3f} "
                f"| {_ms(r, 'chain_ms_per_draft')} "
                f"| {r['eager_torch_ms']:.3f} | {comp} | {r['vs_roofline']:.2f}x | {ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
