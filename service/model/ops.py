"""The forward's ops behind one interface: plain torch (CPU, reference) or Triton kernels (GPU).

The MTP head calls these and nothing else between its matrix products (which stay
on cuBLAS through torch: at decode batch sizes they are GEMVs that cuBLAS already
streams near the memory bandwidth).
"""

from __future__ import annotations

import torch

from . import torch_ops
from .kv_cache import KVCache


class TorchOps:
    """Plain torch: runs anywhere; the reference the kernels are held to."""

    name = "torch"

    def input_norms(self, embeds, hiddens, w_embed, w_hidden, positions, eps, embed_first):
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        e = torch_ops.rms_norm(embeds, w_embed, eps)
        h = torch_ops.rms_norm(hiddens, w_hidden, eps)
        return torch.cat([e, h] if embed_first else [h, e], dim=-1)

    def rms_norm(self, x, weight, eps):
        return torch_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        """(x + delta, its RMSNorm): the residual add and the next norm."""
        x = x + delta
        return x, torch_ops.rms_norm(x, weight, eps)

    def rope_write_kv(self, q, k, v, positions, cos_sin, kv: KVCache, slots) -> torch.Tensor:
        """Rotates q and k, writes k and v at the slots; returns the rotated q."""
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        q, k = torch_ops.rope(q, cos, sin), torch_ops.rope(k, cos, sin)
        kv.write(k, v, slots)
        return q

    def paged_attention(self, q, kv: KVCache, block_tables, seq_ids, context_lens, scale):
        return torch_ops.paged_attention(q, kv.k, kv.v, block_tables, seq_ids, context_lens, scale)

    def swiglu(self, gate_up):
        return torch_ops.swiglu(gate_up)

    def select_drafts(self, logits, bitmask):
        return torch_ops.select_drafts(logits, bitmask)


class TritonOps:
    """The Triton kernels of mtpdraft.kernels (fused norms, RoPE + KV write, ...)."""

    name = "triton"

    def __init__(self) -> None:
        from mtpdraft import kernels  # imported here: triton is needed only on this path

        self.k = kernels

    def input_norms(self, embeds, hiddens, w_embed, w_hidden, positions, eps, embed_first):
        return self.k.mtp_input_norms(
            embeds, hiddens, w_embed, w_hidden, positions, eps, embed_first=embed_first
        )

    def rms_norm(self, x, weight, eps):
        return self.k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        """One kernel; x is updated in place (it is the forward's own residual stream)."""
        return x, self.k.add_rms_norm(x, delta, weight, eps)

    def rope_write_kv(self, q, k, v, positions, cos_sin, kv: KVCache, slots) -> torch.Tensor:
        """q, k, v may be strided views of the fused projection: rotated where they are."""
        self.k.rope_write_kv(q, k, v, positions, cos_sin, kv.k, kv.v, slots)
        return q

    def paged_attention(self, q, kv: KVCache, block_tables, seq_ids, context_lens, scale):
        return self.k.paged_attention(q, kv.k, kv.v, block_tables, seq_ids, context_lens, scale)

    def swiglu(self, gate_up):
        return self.k.swiglu(gate_up)

    def select_drafts(self, logits, bitmask):
        return self.k.select_drafts(logits.contiguous(), bitmask)


def ops_for(device: torch.device, choice: str = "auto") -> TorchOps | TritonOps:
    """Triton on CUDA, torch elsewhere, unless `choice` names one."""
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        return TritonOps()
    if choice == "torch":
        return TorchOps()
    raise ValueError(f"unknown ops backend {choice!r} (auto, torch or triton)")
