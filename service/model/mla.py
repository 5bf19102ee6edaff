"""DeepSeek's multi-head latent attention (MLA) over a paged latent cache, absorbed form.

Per token the cache keeps only the compressed latent c (kv_lora_rank R values, after
kv_a_layernorm) and the rotated k_pe (qk_rope_head_dim P values, shared by every
head): what vLLM and SGLang cache. Decode attention never rebuilds K and V: kv_b_proj
splits per head into W_UK [nope, R] and W_UV [v, R], the query's nope part is absorbed
into the latent space (q_latent = q_nope @ W_UK), scores are q_latent . c + q_pe . k_pe,
and the attention output in the latent space is mapped back by W_UV. RoPE is
DeepSeek's: interleaved pairs, YaRN-scaled, and the softmax scale carries YaRN's mscale
squared (rope.py).

Its config keys are DeepSeek's (kv_lora_rank, q_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim), its tensors those of DeepSeek-V2/V3's self_attn.
"""

from __future__ import annotations

import torch

from .batch import RowBatch
from .config import ConfigReader, MLAConfig, MTPConfig
from .kv_cache import KVCache
from .rope import yarn_mscale


def read_mla(c: ConfigReader) -> MLAConfig:
    """The latent attention's sizes, by DeepSeek's keys."""
    return MLAConfig(
        q_lora_rank=c.int("q_lora_rank", 0),
        kv_lora_rank=c.positive("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim"),
        qk_rope_head_dim=c.positive("qk_rope_head_dim"),
        v_head_dim=c.positive("v_head_dim"),
    )


def mla_names(attention: str, m: MLAConfig) -> dict[str, str]:
    """Family-neutral key -> published name of each tensor under `attention` (self_attn.)."""
    keys = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    keys += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if m.q_lora_rank else ["q_proj"]
    return {k: f"{attention}{k}.weight" for k in keys}


def mla_shapes(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    m, h, heads = c.mla, c.hidden_size, c.num_attention_heads
    return {
        "q_proj": (heads * m.qk_head_dim, h),
        "q_a_proj": (m.q_lora_rank, h),
        "q_a_layernorm": (m.q_lora_rank,),
        "q_b_proj": (heads * m.qk_head_dim, m.q_lora_rank),
        "kv_a_proj_with_mqa": (m.kv_lora_rank + m.qk_rope_head_dim, h),
        "kv_a_layernorm": (m.kv_lora_rank,),
        "kv_b_proj": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "o_proj": (h, heads * m.v_head_dim),
    }


class LatentAttention:
    """One layer's MLA, its weights on one device."""

    def __init__(self, c: MTPConfig, t: dict[str, torch.Tensor], ops) -> None:
        m = c.mla
        self.c, self.m, self.ops = c, m, ops
        self.q_a, self.q_a_norm = t.get("q_a_proj"), t.get("q_a_layernorm")
        self.q_b = t["q_b_proj"] if m.q_lora_rank else t["q_proj"]
        self.kv_a, self.kv_a_norm = t["kv_a_proj_with_mqa"], t["kv_a_layernorm"]
        kv_b = t["kv_b_proj"].view(c.num_attention_heads, -1, m.kv_lora_rank)
        self.w_uk = kv_b[:, : m.qk_nope_head_dim].contiguous()  # [heads, nope, R]
        self.w_uv_t = kv_b[:, m.qk_nope_head_dim :].transpose(1, 2).contiguous()  # [heads, R, v]
        mscale = yarn_mscale(c.yarn.factor, c.yarn.mscale_all_dim) if c.yarn else 1.0
        self.scale = m.qk_head_dim**-0.5 * mscale * mscale

    def __call__(
        self, y: torch.Tensor, batch: RowBatch, kv: KVCache, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        """The heads' outputs [N, heads * v_head_dim] of the normed rows y (before o_proj)."""
        c, m, ops, n = self.c, self.m, self.ops, len(batch)
        eps, positions = c.rms_norm_eps, batch.positions
        x = y if self.q_a is None else ops.rms_norm(ops.linear(y, self.q_a), self.q_a_norm, eps)
        q = ops.linear(x, self.q_b).view(n, c.num_attention_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent = ops.linear(y, self.kv_a)
        c_kv = ops.rms_norm(latent[:, : m.kv_lora_rank].contiguous(), self.kv_a_norm, eps)
        ops.mla_write_latent(
            c_kv, latent[:, m.kv_lora_rank :], positions, cos_sin, kv, batch.slot_mapping
        )
        q_pe = ops.rope_interleaved(q_pe, positions, cos_sin)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [N, heads, R]
        out = ops.mla_attention(
            q_latent.contiguous(), q_pe, kv, batch.block_tables, batch.seq_ids,
            batch.context_lens, self.scale,
        )  # fmt: skip
        return torch.bmm(out.transpose(0, 1), self.w_uv_t).transpose(0, 1).reshape(n, -1)
