"""The forward's ops behind one interface: plain torch (CPU, reference) or Triton kernels (GPU).

The MTP head calls these for everything but its embedding lookup. Matrix products
of a few rows go to a Triton GEMV, the LM head fused with the draft selection;
larger ones stay on cuBLAS through torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import moe as moe_routing
from . import sampling, torch_ops
from .kv_cache import KVCache
from .sampling import RowSampling, Selected
from .tensors import FP8Matrix


class TorchOps:
    """Plain torch: runs anywhere; the reference the kernels are held to."""

    name = "torch"
    reads_fp8 = False  # FP8 weights are dequantized for it at load

    def linear(self, x, weight, bias=None):
        """x @ weight.T + bias."""
        return F.linear(x, weight, bias)

    def draft(self, hidden, lm_head, bitmask):
        """Drafts of the normalized hiddens: select_drafts of the LM head's logits."""
        return torch_ops.select_drafts(F.linear(hidden, lm_head), bitmask)

    def select(
        self, hidden, lm_head, bitmask, rows: RowSampling, positions, index, out=None,
        key_offsets=(0, 0),
    ) -> Selected:  # fmt: skip
        """Each row's draft as its sampling says (sampling.select), drawn for the token
        position and proposal index given (`key_offsets` added); q written into `out`
        ((ids, probabilities) [N, support]) if given."""
        logits = F.linear(hidden, lm_head)
        greedy = torch_ops.select_drafts(logits, bitmask)
        return _sample_eager(
            torch_ops.masked(logits, bitmask), greedy, rows, positions, index, out, key_offsets
        )

    def input_norms(
        self, tokens, table, hiddens, w_embed, w_hidden, positions, eps, embed_first, unit,
        mask_first,
    ):  # fmt: skip
        """The rows' embeddings (looked up in `table`) and hiddens normed, concatenated."""
        embeds = F.embedding(tokens, table)
        if mask_first:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        e = torch_ops.rms_norm(embeds, w_embed, eps, unit)
        h = torch_ops.rms_norm(hiddens, w_hidden, eps, unit)
        return torch.cat([e, h] if embed_first else [h, e], dim=-1)

    def rms_norm(self, x, weight, eps, unit=False):
        """RMSNorm over the last dim (`unit`: scaled by 1 + weight)."""
        return torch_ops.rms_norm(x, weight, eps, unit)

    def qk_norm(self, q, k, q_weight, k_weight, eps, unit):
        """RMSNorm of each head of q and k ([N, heads, D] views of the fused projection)."""
        return torch_ops.rms_norm(q, q_weight, eps, unit), torch_ops.rms_norm(
            k, k_weight, eps, unit
        )

    def add_rms_norm(self, x, delta, weight, eps, unit=False):
        """(x + delta, its RMSNorm): the residual add and the next norm."""
        x = x + delta
        return x, torch_ops.rms_norm(x, weight, eps, unit)

    def rope_write_kv(self, q, k, v, positions, cos_sin, kv: KVCache, slots) -> torch.Tensor:
        """Rotates q and k, writes k and v at the slots; returns the rotated q."""
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        q, k = torch_ops.rope(q, cos, sin), torch_ops.rope(k, cos, sin)
        kv.write(k, v, slots)
        return q

    def paged_attention(
        self, q, kv: KVCache, block_tables, seq_ids, context_lens, scale, gate=None
    ):
        """[N, heads * D]; with a gate [N, heads * D], scaled by its sigmoid."""
        out = torch_ops.paged_attention(q, kv.k, kv.v, block_tables, seq_ids, context_lens, scale)
        out = out.reshape(len(q), -1)
        return out if gate is None else out * torch.sigmoid(gate)

    def rope_interleaved(self, x, positions, cos_sin):
        """x [N, heads, P] (a view) rotated by DeepSeek's interleaved RoPE; a new tensor."""
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        return torch_ops.rope_interleaved(x, cos, sin)

    def mla_write_latent(self, c_kv, k_pe, positions, cos_sin, kv: KVCache, slots):
        """Rotates k_pe [N, P] and writes [c_kv, k_pe] at the slots of the latent cache."""
        k_pe = self.rope_interleaved(k_pe[:, None], positions, cos_sin)
        kv.write(c_kv[:, None], k_pe, slots)

    def mla_attention(
        self, q_latent, q_pe, kv: KVCache, block_tables, seq_ids, context_lens, scale
    ):
        """Absorbed MLA: [q_latent, q_pe] against [c, k_pe], weighting c: [N, heads, R]."""
        q = torch.cat([q_latent, q_pe], dim=-1)
        latent = kv.latent[:, :, None]
        return torch_ops.paged_attention(
            q, latent, kv.k, block_tables, seq_ids, context_lens, scale
        )

    def swiglu(self, gate_up):
        return torch_ops.swiglu(gate_up)

    def router_logits(self, x, router_rows, moe):
        return moe_routing.router_logits(x, router_rows, moe)

    def select_experts(self, logits, bias, moe, shared):
        """Routed ids and weights [N, k], then the `shared` column (expert E), if any."""
        ids, weights = moe_routing.select_experts(logits, bias, moe)
        if shared is None:
            return ids, weights
        e = moe.num_experts
        if shared == "gate":
            extra = torch.sigmoid(logits[:, e : e + 1].float())
        else:
            extra = torch.ones_like(weights[:, :1])
        return torch.cat([ids, torch.full_like(ids[:, :1], e)], 1), torch.cat([weights, extra], 1)

    def moe_experts(self, x, gate_up, down, ids, weights):
        return torch_ops.moe_experts(x, gate_up, down, ids, weights)


class TritonOps:
    """The Triton kernels of mtpdraft.kernels (fused norms, RoPE + KV write, ...)."""

    name = "triton"
    reads_fp8 = True  # fused_moe and the GEMV read FP8 weights with their block scales

    # Measured on an H200 (bf16, MiMo-7B shapes, each in a CUDA graph): the Triton
    # GEMV beats cuBLAS up to 16 rows (2-21% per matrix, kernels.gemv.gemv_config)
    # and loses at 32; the fused LM head beats cuBLAS + select_drafts up to 32 rows
    # (281-293 us vs 302-319) and ties at 64.
    GEMV_ROWS, LM_HEAD_ROWS = 16, 32

    def __init__(self) -> None:
        from mtpdraft import kernels  # imported here: triton is needed only on this path

        self.k = kernels

    def linear(self, x, weight, bias=None):
        if isinstance(weight, FP8Matrix):  # the GEMV, half the bytes of bf16
            rows = self.k.gemv_max_rows  # a prefill chunk goes through it rows at a time
            if x.shape[0] > rows:
                parts = [self.linear(x[i : i + rows], weight, bias) for i in range(0, len(x), rows)]
                return torch.cat(parts)
            return self.k.gemv(
                x, weight.values, bias, weight_scale=weight.scale, scale_block=weight.block
            )
        if 0 < x.shape[0] <= self.GEMV_ROWS:
            return self.k.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def draft(self, hidden, lm_head, bitmask):
        if 0 < hidden.shape[0] <= self.LM_HEAD_ROWS:
            return self.k.lm_head_drafts(hidden, lm_head, bitmask)
        return self.k.select_drafts(F.linear(hidden, lm_head), bitmask)

    def select(
        self, hidden, lm_head, bitmask, rows: RowSampling, positions, index, out=None,
        key_offsets=(0, 0),
    ) -> Selected:  # fmt: skip
        """The head read once: the fused LM head writes its logits as it drafts, or, past
        its rows, select_drafts writes the group maxima top_support starts from. The
        support is ranked without sorting the vocabulary and drawn in one kernel; a batch
        where a row's top_k is wider than the support goes the plain torch way."""
        n, vocab, support = hidden.shape[0], lm_head.shape[0], rows.support
        maxima = None
        if 0 < n <= self.LM_HEAD_ROWS:
            logits = hidden.new_empty(n, vocab)
            greedy = self.k.lm_head_drafts(hidden, lm_head, bitmask, logits)
        else:
            logits = F.linear(hidden, lm_head)
            if not rows.wide:
                group = self.k.top_support_group(vocab, support)
                maxima = (logits.new_empty(n, -(-vocab // group), dtype=torch.float32), group)
            greedy = self.k.select_drafts(logits, bitmask, maxima=maxima)
            logits = torch_ops.masked(logits, bitmask)
        if rows.wide:
            return _sample_eager(logits, greedy, rows, positions, index, out, key_offsets)
        p = rows.params
        params = (p.temperature, p.top_k, p.top_p, p.min_p)
        top = self.k.top_support(logits, support, maxima=maxima, params=params)
        return Selected(*self.k.sample_top(
            top, params, (rows.seeds, rows.states, positions, index), greedy, support, out,
            key_offsets,
        ))  # fmt: skip

    def input_norms(
        self, tokens, table, hiddens, w_embed, w_hidden, positions, eps, embed_first, unit,
        mask_first,
    ):  # fmt: skip
        """One kernel, the embedding lookup included."""
        return self.k.mtp_input_norms(
            table, hiddens, w_embed, w_hidden, positions, eps, embed_first=embed_first,
            unit_offset=unit, mask_first=mask_first, tokens=tokens,
        )  # fmt: skip

    def rms_norm(self, x, weight, eps, unit=False):
        return self.k.rms_norm(x, weight, eps, unit_offset=unit)

    def qk_norm(self, q, k, q_weight, k_weight, eps, unit):
        """One kernel, in place in the fused projection's output (the forward's own)."""
        self.k.qk_norm(q, k, q_weight, k_weight, eps, unit_offset=unit)
        return q, k

    def add_rms_norm(self, x, delta, weight, eps, unit=False):
        """One kernel; x is updated in place (it is the forward's own residual stream)."""
        return x, self.k.add_rms_norm(x, delta, weight, eps, unit_offset=unit)

    def rope_write_kv(self, q, k, v, positions, cos_sin, kv: KVCache, slots) -> torch.Tensor:
        """q, k, v may be strided views of the fused projection: rotated where they are."""
        self.k.rope_write_kv(q, k, v, positions, cos_sin, kv.k, kv.v, slots)
        return q

    def paged_attention(
        self, q, kv: KVCache, block_tables, seq_ids, context_lens, scale, gate=None
    ):
        """The gate applied as the output is written."""
        out = self.k.paged_attention(
            q, kv.k, kv.v, block_tables, seq_ids, context_lens, scale, gate=gate
        )
        return out.reshape(len(q), -1)

    def rope_interleaved(self, x, positions, cos_sin):
        self.k.rope_interleaved(x, positions, cos_sin)  # in place, x may be a strided view
        return x

    def mla_write_latent(self, c_kv, k_pe, positions, cos_sin, kv: KVCache, slots):
        self.k.mla_write_latent(c_kv, k_pe, positions, cos_sin, kv.latent, slots)

    def mla_attention(
        self, q_latent, q_pe, kv: KVCache, block_tables, seq_ids, context_lens, scale
    ):
        return self.k.mla_decode(
            q_latent, q_pe, kv.latent, block_tables, seq_ids, context_lens, scale
        )

    def swiglu(self, gate_up):
        return self.k.swiglu(gate_up)

    def router_logits(self, x, router_rows, moe):
        """Sigmoid scoring's router in fp32 (as vLLM); softmax's in the GEMV."""
        if moe.scoring == "sigmoid":
            return F.linear(x.float(), router_rows)
        return self.linear(x, router_rows)

    def select_experts(self, logits, bias, moe, shared):
        return self.k.moe_route(
            logits, bias, num_experts=moe.num_experts, top_k=moe.top_k, scoring=moe.scoring,
            norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.routed_scaling_factor,
            n_group=moe.n_group, topk_group=moe.topk_group, shared=shared,
        )  # fmt: skip

    def moe_experts(self, x, gate_up, down, ids, weights, **scales):
        """Only the routed experts' weights are read, on the device: capturable in a graph.
        FP8 experts come with `gate_up_scale`, `down_scale` and `scale_block`."""
        return self.k.fused_moe(x, gate_up, down, ids, weights, **scales)


def ops_for(device: torch.device, choice: str = "auto") -> TorchOps | TritonOps:
    """Triton on CUDA, torch elsewhere, unless `choice` names one."""
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        return TritonOps()
    if choice == "torch":
        return TorchOps()
    raise ValueError(f"unknown ops backend {choice!r} (auto, torch or triton)")


def _sample_eager(logits, greedy, rows, positions, index, out, key_offsets) -> Selected:
    """sampling.select of the logits, q copied into `out` if given."""
    position_offset, index_offset = key_offsets
    positions, index = positions + position_offset, index + index_offset
    chosen = sampling.select(logits, greedy, rows, positions, index)
    if out is not None:
        out[0].copy_(chosen.q_ids)
        out[1].copy_(chosen.q_probs)
        chosen.q_ids, chosen.q_probs = out
    return chosen
