"""A dense, float64 MTP layer written straight from the published checkpoints: the oracle.

It shares no code with mtpdraft.service: it reads the safetensors itself, keeps no
KV cache (every call recomputes the whole sequence with full causal attention),
and follows DESIGN.md's vLLM conventions (row position = hidden position, the
embedding zeroed at position 0, MiMo passes the final-norm output on, DeepSeek
the pre-norm hidden). What the oracles share (norms, RoPE, reading the checkpoint,
the chain of drafts) is tests/reference_common.py.

`rows` and `logits` take an optional `store`: a function applied to every value a
real implementation keeps in its compute dtype (each op's output, the cached K/V,
the RoPE table, the hidden passed on), so that an emulation of bf16 or fp32 can
round or perturb them there; without it the computation is exact float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from reference_common import (
    Float64Checkpoint,
    Store,
    grouped_attention,
    input_projection,
    inv_freq,
    rms_norm,
    rope_neox,
    same,
    swiglu,
)

__all__ = ["Reference", "Store"]


@dataclass
class Reference(Float64Checkpoint):
    def __post_init__(self) -> None:
        super().__post_init__()
        if any(k.startswith("model.mtp_layers.") for k in self.w):
            self.mimo, p = True, "model.mtp_layers.0."
            self.names = (p + "token_layernorm", p + "hidden_layernorm", p + "input_proj")
            self.out_norm = p + "final_layernorm"
        else:
            self.mimo, p = False, f"model.layers.{self.cfg['num_hidden_layers']}."
            self.names = (p + "enorm", p + "hnorm", p + "eh_proj")
            self.out_norm = p + "shared_head.norm"
        self.p = p

    def rows(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        store: Store | None = None,
        step: int = 0,
        route: object = None,
    ) -> torch.Tensor:
        """Output hiddens (the ones passed on) of rows 0..n-1 of one sequence (one MTP
        layer: the same for every draft `step`; a dense MLP: `route` never called)."""
        c, p, eps = self.cfg, self.p, self.cfg["rms_norm_eps"]
        s = store or same
        n, h = len(tokens), c["hidden_size"]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        hd = h // heads
        pos = torch.arange(n)
        emb = self.t("model.embed_tokens")[torch.tensor(tokens)].clone()
        emb[pos == 0] = 0
        weights = [self.t(name) for name in self.names]
        x = input_projection(emb, hiddens, weights, eps, not self.mimo, s)

        y = s(rms_norm(x, self.t(p + "input_layernorm"), eps))

        attn = p + "self_attn."
        q = self.linear(y, attn + "q_proj", s).reshape(n, heads, hd)
        k = self.linear(y, attn + "k_proj", s).reshape(n, kv_heads, hd)
        v = self.linear(y, attn + "v_proj", s).reshape(n, kv_heads, hd)
        rot = int(hd * c.get("partial_rotary_factor", 1.0))
        q, k = (s(rope_neox(t, pos, inv_freq(rot, c["rope_theta"]), s=s)) for t in (q, k))
        a = s(grouped_attention(q, k, v))
        x = s(x + s(a @ self.t(attn + "o_proj").T))

        y = s(rms_norm(x, self.t(p + "post_attention_layernorm"), eps))
        mlp = (self.t(p + f"mlp.{m}") for m in ("gate_proj", "up_proj", "down_proj"))
        x = s(x + swiglu(y, *mlp, s))
        return s(rms_norm(x, self.t(self.out_norm), eps)) if self.mimo else x

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or same
        if not self.mimo:
            out = s(rms_norm(out, self.t(self.out_norm), self.cfg["rms_norm_eps"]))
        return s(out @ self.own(self.p + "shared_head.head", "lm_head").T)
