"""A float64 oracle of the MTP draft chain of GLM-4.5/4.6 and Qwen3-Next/3.5/3.6 checkpoints.

Written straight from the published modeling code, sharing nothing with
mtpdraft.service; it reads the safetensors itself (one file or a sharded set with
model.safetensors.index.json), keeps no KV cache (every call recomputes the whole
sequence with full causal attention) and has the interface of
tests/mtp_reference.Reference (`rows`, `logits`, `propose`, the `store` hook), and a
`route` hook that sees, and may replace, each MoE row's choice of experts. What the
oracles share (norms, RoPE, routing, the chain of drafts) is tests/reference_common.py.

Sources (vLLM and transformers, as published):
- GLM: vllm/model_executor/models/glm4_moe_mtp.py (Glm4MoeMultiTokenPredictorLayer.forward,
  Glm4MoeMultiTokenPredictor.compute_logits, _rewrite_spec_layer_name), glm4_moe.py
  (Glm4MoeAttention, Glm4MoE, Glm4MoeDecoderLayer), fused_moe/router/grouped_topk_router.py
  (grouped_topk); transformers models/glm4_moe/modeling_glm4_moe.py (Glm4MoeRMSNorm,
  apply_rotary_pos_emb, Glm4MoeMoE.route_tokens_to_experts, Glm4MoeNaiveMoe).
- Qwen: vllm/model_executor/models/qwen3_next_mtp.py (Qwen3NextMultiTokenPredictor.forward,
  Qwen3NextMTP.compute_logits / load_weights), qwen3_next.py (Qwen3NextAttention,
  Qwen3NextSparseMoeBlock, Qwen3NextDecoderLayer), qwen3_5_mtp.py and qwen3_5.py
  (Qwen3_5MTP.load_weights name mapping, Qwen3_5DecoderLayer's MoE/dense choice);
  transformers models/qwen3_next/modeling_qwen3_next.py (Qwen3NextRMSNorm,
  Qwen3NextAttention, Qwen3NextTopKRouter, Qwen3NextSparseMoeBlock, Qwen3NextExperts).

What each family computes for a row (token x at position p, hidden h), p numbering the
row by its hidden's position as vLLM does:
- GLM: e = embed(x), zeroed at p == 0; x0 = eh_proj(cat[enorm(e), hnorm(h)]); a pre-norm
  decoder block (GQA with q/k/v bias, per-head RMSNorm of q and k before RoPE when
  use_qk_norm, NeoX RoPE on the first head_dim * partial_rotary_factor dims; MoE: sigmoid
  scores, + e_score_correction_bias for the choice only, group-limited top-k over n_group
  groups scored by the sum of their top 2, weights = unbiased scores, renormalised if
  norm_topk_prob, times routed_scaling_factor, plus the shared experts). The hidden
  passed on is the block output; logits = shared_head.head(shared_head.norm(out)).
- Qwen: no masking at p == 0; x0 = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]);
  every RMSNorm scales by (1 + w); attention has q_proj rows per head as [q | gate],
  per-head q_norm/k_norm before RoPE, and sigmoid(gate) multiplies the attention output
  before o_proj; MoE: softmax router, top-k, renormalised if norm_topk_prob, plus
  sigmoid(shared_expert_gate(y)) * shared_expert(y); Qwen3.6 dense: SwiGLU MLP. The hidden
  passed on is mtp.norm(out), the same one the logits (lm_head) are taken from.

Where vLLM and transformers differ, this follows vLLM: grouped routing masks the groups
left out with -inf (transformers fills 0.0; the same whenever the biased scores are
positive, as in tests/family_checkpoints), and the renormalisation has no 1e-20 term.
The GLM router's logits are computed in float32 by both; `store` is not applied to them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from reference_common import (
    Float64Checkpoint,
    Route,
    Store,
    grouped_attention,
    input_projection,
    inv_freq,
    mixed_experts,
    rms_norm,
    rope_neox,
    row_pick,
    same,
    sigmoid_routing,
    softmax_topk,
    swiglu,
)


@dataclass
class FamilyReference(Float64Checkpoint):
    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.text
        self.qwen = any(k.startswith("mtp.") for k in self.w)
        self.hidden = t["hidden_size"]
        self.heads, self.kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
        self.hd = t.get("head_dim") or self.hidden // self.heads
        self.eps = t["rms_norm_eps"]
        rope = t.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", t.get("rope_theta"))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor"))
        if partial is None:  # the config classes' defaults
            partial = 0.25 if self.qwen else 0.5
        self.rot = int(self.hd * partial)
        if self.qwen:
            self.n_layers = t.get("mtp_num_hidden_layers", t.get("num_nextn_predict_layers", 1))
            self.embed = next(
                k
                for k in ("model.embed_tokens", "model.language_model.embed_tokens")
                if k + ".weight" in self.w
            )
            self.head = "lm_head" if "lm_head.weight" in self.w else self.embed
        else:
            self.n_layers = t.get("num_nextn_predict_layers", 1)
            self.first = t["num_hidden_layers"]

    def prefix(self, step: int = 0) -> str:
        """The MTP layer used for draft `step` (vLLM: spec_step_idx % num_mtp_layers)."""
        k = step % self.n_layers
        return f"mtp.layers.{k}." if self.qwen else f"model.layers.{self.first + k}."

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.t(name), self.eps, self.qwen)

    def _mlp_weights(self, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.t(p + m) for m in ("gate_proj", "up_proj", "down_proj"))

    def _expert(self, row: torch.Tensor, p: str, s: Store, e: int) -> torch.Tensor:
        """Routed expert e's output for the row."""
        fused = p + "mlp.experts.gate_up_proj"
        if fused in self.w:  # transformers 5 / Qwen3.5 layout: [E, 2I, H], gate rows first
            g, u = self.w[fused][e].chunk(2, 0)
            return swiglu(row, g, u, self.w[p + "mlp.experts.down_proj"][e], s)
        return swiglu(row, *self._mlp_weights(p + f"mlp.experts.{e}."), s)

    def _moe(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        t = self.text
        out = []
        for i, row in enumerate(y):
            if self.qwen:
                ids, wts = softmax_topk(
                    s(row @ self.t(p + "mlp.gate").T),
                    t["num_experts_per_tok"],
                    t.get("norm_topk_prob", True),
                    row_pick(route, i),
                )
            else:
                bias = self.w[p + "mlp.gate.e_score_correction_bias"]
                logits = row @ self.t(p + "mlp.gate").T
                ids, wts = sigmoid_routing(t, logits, bias, row_pick(route, i))
            acc = mixed_experts(row, ids, wts, functools.partial(self._expert, row, p, s))
            shared = "shared_expert." if self.qwen else "shared_experts."
            sh = swiglu(row, *self._mlp_weights(p + f"mlp.{shared}"), s)
            if self.qwen:
                sh = torch.sigmoid(s(row @ self.t(p + "mlp.shared_expert_gate").T)) * sh
            out.append(s(s(acc) + sh))
        return torch.stack(out)

    def _mlp(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        if p + "mlp.gate.weight" in self.w:
            return self._moe(y, p, s, route)
        return swiglu(y, *self._mlp_weights(p + "mlp."), s)

    def _attention(self, y: torch.Tensor, pos: torch.Tensor, p: str, s: Store) -> torch.Tensor:
        n, heads, kv_heads, hd = len(y), self.heads, self.kv_heads, self.hd

        def proj(name: str) -> torch.Tensor:
            return self.linear(y, p + f"self_attn.{name}", s)

        q = proj("q_proj")
        gate = None
        if self.qwen and q.shape[-1] == 2 * heads * hd:  # attn_output_gate: per head [q | gate]
            q, gate = q.reshape(n, heads, 2 * hd).chunk(2, -1)
            gate = gate.reshape(n, heads * hd)
        q = q.reshape(n, heads, hd)
        k = proj("k_proj").reshape(n, kv_heads, hd)
        v = proj("v_proj").reshape(n, kv_heads, hd)
        if p + "self_attn.q_norm.weight" in self.w:
            q = s(self._norm(q, p + "self_attn.q_norm"))
            k = s(self._norm(k, p + "self_attn.k_norm"))
        q, k = (s(rope_neox(x, pos, inv_freq(self.rot, self.theta), s=s)) for x in (q, k))
        a = s(grouped_attention(q, k, v))
        if gate is not None:
            a = s(a * torch.sigmoid(gate))
        return s(a @ self.t(p + "self_attn.o_proj").T)

    def rows(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        store: Store | None = None,
        step: int = 0,
        route: Route | None = None,
    ) -> torch.Tensor:
        """Output hiddens (the ones passed on) of rows 0..n-1 of one sequence; `route` sees
        (and may change) each MoE row's choice of experts."""
        s = store or same
        n, p = len(tokens), self.prefix(step)
        pos = torch.arange(n)
        if self.qwen:
            e = self.t(self.embed)[torch.tensor(tokens)]
            inputs = ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc")
        else:
            e = self.own(p + "embed_tokens", "model.embed_tokens")[torch.tensor(tokens)].clone()
            e[pos == 0] = 0
            inputs = (p + "enorm", p + "hnorm", p + "eh_proj")
        weights = [self.t(name) for name in inputs]
        x = input_projection(e, hiddens, weights, self.eps, True, s, self.qwen)
        y = s(self._norm(x, p + "input_layernorm"))
        x = s(x + self._attention(y, pos, p, s))
        y = s(self._norm(x, p + "post_attention_layernorm"))
        x = s(x + self._mlp(y, p, s, route))
        return s(self._norm(x, "mtp.norm")) if self.qwen else x

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or same
        if self.qwen:
            return s(out @ self.t(self.head).T)
        p = self.prefix(step)
        out = s(self._norm(out, p + "shared_head.norm"))
        return s(out @ self.own(p + "shared_head.head", "lm_head").T)
