"""A float64 oracle of the MTP draft chain of DeepSeek-V3 / R1 / V3.1 (and V2-style q_proj).

Written straight from the published code, sharing nothing with mtpdraft.service: it
reads the safetensors itself (one file or a sharded set with model.safetensors.index.json),
dequantizes FP8 weights with their block scales, keeps no KV cache (every call recomputes
the whole sequence with full causal attention, in the plain, non-absorbed MLA form) and
has the interface of tests/family_reference.FamilyReference (`rows`, `logits`,
`propose`, the `store` and `route` hooks). What the oracles share (norms, RoPE, reading
the checkpoint with its FP8 weights, routing, the chain of drafts) is
tests/reference_common.py.

Sources (as published):
- vLLM vllm/model_executor/models/deepseek_mtp.py: DeepSeekMultiTokenPredictorLayer.forward
  (embedding zeroed at position 0, enorm / hnorm, eh_proj(cat[e, h]), the block, hidden
  passed on = residual + block output, before shared_head.norm), SharedHead.forward and
  DeepSeekMultiTokenPredictor.compute_logits (head(norm(h))), the step -> layer choice
  spec_step_idx % num_nextn_predict_layers, _rewrite_spec_layer_name (embed_tokens shared).
- vLLM vllm/model_executor/models/deepseek_v2.py: DeepseekV2Attention.__init__ / forward
  (q_a_proj -> q_a_layernorm -> q_b_proj or q_proj; [q_nope | q_pe] per head;
  kv_a_proj_with_mqa -> [latent | k_pe], kv_a_layernorm(latent), kv_b_proj -> [k_nope | v]
  per head; get_rope(..., is_neox_style=False); scaling = qk_head_dim**-0.5 * mscale**2
  with mscale = yarn_get_mscale(factor, mscale_all_dim)), yarn_get_mscale, DeepseekV2MoE.
- vLLM vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py
  (DeepseekScalingRotaryEmbedding._compute_inv_freq, _compute_cos_sin_cache: cos/sin times
  yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)) and common.py
  (rotate_gptj, yarn_find_correction_dim, yarn_find_correction_range, yarn_linear_ramp_mask);
  rotary_embedding/__init__.py get_rope, "deepseek_yarn": the rope's max position is
  rope_scaling.original_max_position_embeddings.
- transformers models/deepseek_v3/modeling_deepseek_v3.py: apply_rotary_pos_emb_interleave
  (de-interleave, then rotate_half: the same pair rotation as rotate_gptj, the output
  permuted identically for q and k, so the scores agree), yarn_get_mscale,
  DeepseekV3Attention (the same scaling), DeepseekV3TopkRouter / DeepseekV3MoE (routing);
  modeling_rope_utils._compute_yarn_parameters.
- DeepSeek-V3 inference/fp8_cast_bf16.py (main: a weight with element_size 1 has
  `<name>_scale_inv`) and inference/kernel.py (weight_dequant_kernel: y = x * s per
  128 x 128 block, the block size taken here from quantization_config.weight_block_size).

RoPE: interleaved (GPT-J): dims (2i, 2i+1) of the qk_rope_head_dim part rotate together
by pos * inv_freq[i]. YaRN: inv_freq = inter * (1 - mask) + extra * mask, extra =
base**(-2i/d), inter = extra / factor, mask = 1 - clamp((i - low) / (high - low), 0, 1),
low = max(floor(c(beta_fast)), 0), high = min(ceil(c(beta_slow)), d - 1),
c(r) = d ln(L / (2 pi r)) / (2 ln base), L = original_max_position_embeddings.

Where sources differ: grouped routing masks the left-out groups with -inf (vLLM) and not
0.0 (the HF code; the same whenever the biased scores are positive, as in
tests/deepseek_checkpoints); the renormalisation has no 1e-20 term; the yarn factor is
rope_scaling["factor"] (vLLM, DeepSeek) where some transformers versions use
max_position_embeddings / original_max_position_embeddings instead (the same for the
published and the tiny configs). The router logits are not passed through `store`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from reference_common import (
    Float64Checkpoint,
    Route,
    Store,
    causal_attention,
    input_projection,
    inv_freq,
    mixed_experts,
    rms_norm,
    rope_interleaved,
    row_pick,
    same,
    sigmoid_routing,  # DeepSeek-V3's routing is GLM's
    swiglu,
    yarn_get_mscale,
    yarn_inv_freq,
)


@dataclass
class DeepseekReference(Float64Checkpoint):
    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.cfg
        self.hidden, self.heads = c["hidden_size"], c["num_attention_heads"]
        self.nope, self.rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.vd, self.kv_rank = c["v_head_dim"], c["kv_lora_rank"]
        self.eps = c["rms_norm_eps"]
        self.first = c["num_hidden_layers"]
        self.n_layers = c.get("num_nextn_predict_layers", 1)
        # transformers 4: rope_theta + rope_scaling {"type": "yarn", ...};
        # transformers 5: rope_parameters {"rope_theta", "rope_type", ...}.
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or rope
        theta = rope.get("rope_theta", c.get("rope_theta"))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        if kind == "yarn":
            factor = scaling["factor"]
            self.inv_freq = yarn_inv_freq(
                self.rope,
                theta,
                factor,
                scaling["original_max_position_embeddings"],
                scaling.get("beta_fast", 32),
                scaling.get("beta_slow", 1),
            )
            # vLLM's defaults when a key is absent: mscale 1, mscale_all_dim 0.
            mscale, all_dim = scaling.get("mscale", 1), scaling.get("mscale_all_dim", 0)
            self.cos_mscale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim)
            if all_dim:
                self.softmax_scale *= yarn_get_mscale(factor, all_dim) ** 2
        else:
            self.inv_freq = inv_freq(self.rope, theta)
            self.cos_mscale = 1.0
        self.rotate = rope_interleaved

    def prefix(self, step: int = 0) -> str:
        """The MTP layer of draft `step` (vLLM: spec_step_idx % num_nextn_predict_layers)."""
        return f"model.layers.{self.first + step % self.n_layers}."

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.t(name), self.eps)

    def _swiglu(self, y: torch.Tensor, p: str, s: Store) -> torch.Tensor:
        return swiglu(y, self.t(p + "gate_proj"), self.t(p + "up_proj"), self.t(p + "down_proj"), s)

    def _expert(self, row: torch.Tensor, p: str, s: Store, e: int) -> torch.Tensor:
        """Routed expert e's output for the row."""
        return self._swiglu(row[None], p + f"mlp.experts.{e}.", s)[0]

    def _moe(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        out = []
        for i, row in enumerate(y):
            bias = self.w[p + "mlp.gate.e_score_correction_bias"]
            logits = row @ self.t(p + "mlp.gate").T
            ids, wts = sigmoid_routing(self.cfg, logits, bias, row_pick(route, i))
            acc = mixed_experts(row, ids, wts, functools.partial(self._expert, row, p, s))
            shared = self._swiglu(row[None], p + "mlp.shared_experts.", s)[0]
            out.append(s(s(acc) + shared))
        return torch.stack(out)

    def _mlp(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        if p + "mlp.gate.weight" in self.w:
            return self._moe(y, p, s, route)
        return self._swiglu(y, p + "mlp.", s)

    def _qkv(
        self, y: torch.Tensor, pos: torch.Tensor, p: str, s: Store
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q [n, H, nope+rope], k [n, H, nope+rope] and v [n, H, v_head_dim]."""
        n, heads, nope = len(y), self.heads, self.nope
        a = p + "self_attn."
        if a + "q_a_proj.weight" in self.w:
            q = s(y @ self.t(a + "q_a_proj").T)
            q = s(self._norm(q, a + "q_a_layernorm"))
            q = s(q @ self.t(a + "q_b_proj").T)
        else:
            q = s(y @ self.t(a + "q_proj").T)
        q = q.reshape(n, heads, nope + self.rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent = s(y @ self.t(a + "kv_a_proj_with_mqa").T)
        c, k_pe = latent[:, : self.kv_rank], latent[:, self.kv_rank :]
        c = s(self._norm(c, a + "kv_a_layernorm"))
        kv = s(c @ self.t(a + "kv_b_proj").T).reshape(n, heads, nope + self.vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_pe = s(self.rotate(q_pe, pos, self.inv_freq, self.cos_mscale, s))
        k_pe = s(self.rotate(k_pe[:, None], pos, self.inv_freq, self.cos_mscale, s))
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe.expand(n, heads, self.rope)], -1)
        return q, k, v

    def _attention(self, y: torch.Tensor, pos: torch.Tensor, p: str, s: Store) -> torch.Tensor:
        q, k, v = self._qkv(y, pos, p, s)
        a = s(causal_attention(torch.einsum("qhd,khd->hqk", q, k) * self.softmax_scale, v))
        return s(a @ self.t(p + "self_attn.o_proj").T)

    def rows(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        store: Store | None = None,
        step: int = 0,
        route: Route | None = None,
    ) -> torch.Tensor:
        """Output hiddens (the ones passed on: before shared_head.norm) of rows 0..n-1;
        `route` sees (and may change) each MoE row's choice of experts."""
        s = store or same
        n, p = len(tokens), self.prefix(step)
        pos = torch.arange(n)
        e = self.own(p + "embed_tokens", "model.embed_tokens")[torch.tensor(tokens)].clone()
        e[pos == 0] = 0
        weights = [self.t(p + m) for m in ("enorm", "hnorm", "eh_proj")]
        x = input_projection(e, hiddens, weights, self.eps, True, s)
        y = s(self._norm(x, p + "input_layernorm"))
        x = s(x + self._attention(y, pos, p, s))
        y = s(self._norm(x, p + "post_attention_layernorm"))
        return s(x + self._mlp(y, p, s, route))

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or same
        p = self.prefix(step)
        out = s(self._norm(out, p + "shared_head.norm"))
        return s(out @ self.own(p + "shared_head.head", "lm_head").T)
