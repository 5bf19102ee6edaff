"""A float64 oracle of the MTP draft chain of DeepSeek-V3 / R1 / V3.1 (and V2-style q_proj).

Written straight from the published code, sharing nothing with mtpdraft.service: it
reads the safetensors itself (one file or a sharded set with model.safetensors.index.json),
dequantizes FP8 weights with their block scales, keeps no KV cache (every call recomputes
the whole sequence with full causal attention, in the plain, non-absorbed MLA form) and
has the interface of tests/family_reference.FamilyReference (`rows`, `logits`,
`propose`, the `store` and `route` hooks).

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
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from family_reference import Route, sigmoid_grouped_topk  # DeepSeek-V3's routing is GLM's
from mtp_reference import chain_drafts
from safetensors.torch import load_file

Store = Callable[[torch.Tensor], torch.Tensor]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def dequant_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """fp8 weight [M, N] times its scale_inv [ceil(M/b0), ceil(N/b1)], block by block."""
    rows, cols = q.shape
    s = scale_inv.double().repeat_interleave(block[0], 0)[:rows]
    return q.double() * s.repeat_interleave(block[1], 1)[:, :cols]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max: int,
    beta_fast: float = 32,
    beta_slow: float = 1,
) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inter = extra / factor
    return inter * (1 - mask) + extra * mask


def rope_interleaved(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float, s: Store = _same
) -> torch.Tensor:
    """GPT-J RoPE of x [n, heads, d]: pairs (2i, 2i+1) rotate by pos * inv_freq[i]."""
    ang = pos[:, None].double() * inv_freq[None]
    cos, sin = s(ang.cos()[:, None] * mscale), s(ang.sin()[:, None] * mscale)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def rope_neox(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float, s: Store = _same
) -> torch.Tensor:
    """NeoX RoPE (not DeepSeek's): dims (i, i + d/2) rotate by pos * inv_freq[i]."""
    ang = pos[:, None].double() * inv_freq[None]
    cos, sin = s(ang.cos()[:, None] * mscale), s(ang.sin()[:, None] * mscale)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as float64, FP8 weights dequantized."""
    cfg = json.loads((folder / "config.json").read_text())
    block = (cfg.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [f.name for f in sorted(folder.glob("*.safetensors"))]
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw |= load_file(folder / f)
    out = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if v.element_size() == 1:  # FP8, as fp8_cast_bf16.py tells them
            out[k] = dequant_fp8(v, raw[k + "_scale_inv"], block)
        else:
            out[k] = v.double()
    return out


@dataclass
class DeepseekReference:
    folder: Path
    cfg: dict = field(init=False)
    w: dict = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        c = self.cfg = json.loads((self.folder / "config.json").read_text())
        self.text = c
        self.w = load_tensors(self.folder)
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
            self.inv_freq = 1.0 / theta ** (
                torch.arange(0, self.rope, 2, dtype=torch.float64) / self.rope
            )
            self.cos_mscale = 1.0
        self.rotate = rope_interleaved

    def t(self, name: str) -> torch.Tensor:
        return self.w[name + ".weight"] if name + ".weight" in self.w else self.w[name]

    def prefix(self, step: int = 0) -> str:
        """The MTP layer of draft `step` (vLLM: spec_step_idx % num_nextn_predict_layers)."""
        return f"model.layers.{self.first + step % self.n_layers}."

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.t(name), self.eps)

    def _swiglu(self, y: torch.Tensor, p: str, s: Store) -> torch.Tensor:
        g, u = s(y @ self.t(p + "gate_proj").T), s(y @ self.t(p + "up_proj").T)
        return s(s(torch.nn.functional.silu(g) * u) @ self.t(p + "down_proj").T)

    def _moe(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        c = self.cfg
        out = []
        for i, row in enumerate(y):
            ids, wts = sigmoid_grouped_topk(
                row @ self.t(p + "mlp.gate").T,
                self.w[p + "mlp.gate.e_score_correction_bias"],
                c["num_experts_per_tok"],
                c.get("n_group") or 1,
                c.get("topk_group") or 1,
                c.get("norm_topk_prob", True),
                c.get("routed_scaling_factor", 1.0),
                None if route is None else functools.partial(route, i),
            )
            acc = torch.zeros_like(row)
            for e, wt in zip(ids.tolist(), wts, strict=True):
                acc = acc + wt * self._swiglu(row[None], p + f"mlp.experts.{e}.", s)[0]
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
        n = len(y)
        q, k, v = self._qkv(y, pos, p, s)
        att = torch.einsum("qhd,khd->hqk", q, k) * self.softmax_scale
        att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        a = s(torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1))
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
        s = store or _same
        n, p = len(tokens), self.prefix(step)
        pos = torch.arange(n)
        own = p + "embed_tokens"
        table = self.t(own if own + ".weight" in self.w else "model.embed_tokens")
        e = table[torch.tensor(tokens)].clone()
        e[pos == 0] = 0
        e = s(self._norm(e, p + "enorm"))
        h = s(self._norm(s(hiddens.double()), p + "hnorm"))
        x = s(torch.cat([e, h], -1) @ self.t(p + "eh_proj").T)
        y = s(self._norm(x, p + "input_layernorm"))
        x = s(x + self._attention(y, pos, p, s))
        y = s(self._norm(x, p + "post_attention_layernorm"))
        return s(x + self._mlp(y, p, s, route))

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or _same
        p = self.prefix(step)
        out = s(self._norm(out, p + "shared_head.norm"))
        own = p + "shared_head.head"
        return s(out @ self.t(own if own + ".weight" in self.w else "lm_head").T)

    def propose(
        self,
        tokens: list[int],
        hiddens: torch.Tensor,
        num_drafts: int,
        allowed: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """Drafts after the rows (tokens, hiddens), whose last row is the committed R0.

        Returns the drafts, their probabilities and the output hidden of every row of
        the chain (m0 .. m(K-1)). `allowed` is a [n, V] bool mask per draft. Draft j
        uses MTP layer j % num_nextn_predict_layers, as vLLM's spec_step_idx does.
        """
        return chain_drafts(self, tokens, hiddens, num_drafts, allowed)
