"""A float64 oracle of the MTP draft chain of GLM-4.5/4.6 and Qwen3-Next/3.5/3.6 checkpoints.

Written straight from the published modeling code, sharing nothing with
mtpdraft.service; it reads the safetensors itself (one file or a sharded set with
model.safetensors.index.json), keeps no KV cache (every call recomputes the whole
sequence with full causal attention) and has the interface of
tests/mtp_reference.Reference (`rows`, `logits`, `propose`, the `store` hook), and a
`route` hook that sees, and may replace, each MoE row's choice of experts.

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
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mtp_reference import chain_drafts
from safetensors.torch import load_file

Store = Callable[[torch.Tensor], torch.Tensor]
# pick(ids, margin, values) -> the expert ids a row uses, given the oracle's own choice, its
# margin (how far that choice is from a tie: the last value kept minus the first left out)
# and the values that choose (biased sigmoid scores, or router logits).
Pick = Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]
# route(row, ids, margin, values): a Pick for each row of a sequence, by its index.
Route = Callable[[int, torch.Tensor, float, torch.Tensor], torch.Tensor]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """x / rms(x) * w, or * (1 + w) for Qwen3-Next's zero-centred norm."""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * (1 + w) if zero_centred else y * w


def rope_neox(
    x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float, s: Store = _same
) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first `rot` dims of each head of x [n, heads, d]."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos[:, None].double() * inv[None]
    cos, sin = s(ang.cos()[:, None]), s(ang.sin()[:, None])
    a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rot:]], -1)


def _margin(ranked: torch.Tensor, kept: int) -> float:
    """How far a top-`kept` choice over `ranked` values is from a tie: the last value kept
    minus the first left out (inf when nothing is left out)."""
    top = ranked.sort(descending=True).values
    if kept >= top.numel() or not torch.isfinite(top[kept]):
        return math.inf
    return float(top[kept - 1] - top[kept])


def _picked(pick: Pick | None, ids: torch.Tensor, margin: float, values: torch.Tensor):
    return ids if pick is None else torch.as_tensor(pick(ids, margin, values))


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    pick: Pick | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing for one token: (expert ids, weights).

    Its margin (see Pick) is the smaller of the group choice's and the expert choice's,
    both in the biased scores that choose."""
    scores = logits.sigmoid()
    choice = scores + bias
    groups = choice.view(n_group, -1)
    group_score = groups.topk(min(2, groups.shape[1]), -1).values.sum(-1)
    keep = torch.zeros(n_group, dtype=torch.bool)
    keep[group_score.topk(topk_group).indices] = True
    masked = choice.masked_fill(~keep.repeat_interleave(groups.shape[1]), float("-inf"))
    ids = masked.topk(top_k).indices
    margin = min(_margin(group_score, topk_group), _margin(masked, top_k))
    ids = _picked(pick, ids, margin, choice)
    w = scores[ids]
    if renormalize:
        w = w / w.sum()
    return ids, w * scaling


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, pick: Pick | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen MoE routing for one token: (expert ids, weights); its margin is in logits."""
    p = logits.softmax(-1)
    ids = _picked(pick, p.topk(top_k).indices, _margin(logits, top_k), logits)
    w = p[ids]
    return ids, (w / w.sum() if renormalize else w)


@dataclass
class FamilyReference:
    folder: Path
    cfg: dict = field(init=False)
    w: dict = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.cfg = json.loads((self.folder / "config.json").read_text())
        self.text = self.cfg.get("text_config", self.cfg)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [f.name for f in sorted(self.folder.glob("*.safetensors"))]
        self.w = {}
        for f in files:
            self.w |= {k: v.double() for k, v in load_file(self.folder / f).items()}
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

    def t(self, name: str) -> torch.Tensor:
        return self.w[name + ".weight"] if name + ".weight" in self.w else self.w[name]

    def prefix(self, step: int = 0) -> str:
        """The MTP layer used for draft `step` (vLLM: spec_step_idx % num_mtp_layers)."""
        k = step % self.n_layers
        return f"mtp.layers.{k}." if self.qwen else f"model.layers.{self.first + k}."

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.t(name), self.eps, self.qwen)

    def _swiglu(self, y: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor, s: Store):
        a = s(torch.nn.functional.silu(s(y @ g.T)) * s(y @ u.T))
        return s(a @ d.T)

    def _expert(self, p: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fused = p + "mlp.experts.gate_up_proj"
        if fused in self.w:  # transformers 5 / Qwen3.5 layout: [E, 2I, H], gate rows first
            g, u = self.w[fused][e].chunk(2, 0)
            return g, u, self.w[p + "mlp.experts.down_proj"][e]
        q = p + f"mlp.experts.{e}."
        return self.t(q + "gate_proj"), self.t(q + "up_proj"), self.t(q + "down_proj")

    def _moe(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        t = self.text
        out = []
        for i, row in enumerate(y):
            pick = None if route is None else functools.partial(route, i)
            if self.qwen:
                ids, wts = softmax_topk(
                    s(row @ self.t(p + "mlp.gate").T),
                    t["num_experts_per_tok"],
                    t.get("norm_topk_prob", True),
                    pick,
                )
            else:
                ids, wts = sigmoid_grouped_topk(
                    row @ self.t(p + "mlp.gate").T,
                    self.w[p + "mlp.gate.e_score_correction_bias"],
                    t["num_experts_per_tok"],
                    t.get("n_group") or 1,
                    t.get("topk_group") or 1,
                    t.get("norm_topk_prob", True),
                    t.get("routed_scaling_factor", 1.0),
                    pick,
                )
            acc = torch.zeros_like(row)
            for e, wt in zip(ids.tolist(), wts, strict=True):
                acc = acc + wt * self._swiglu(row, *self._expert(p, e), s)
            shared = "shared_expert." if self.qwen else "shared_experts."
            sh = self._swiglu(
                row,
                *(self.t(p + f"mlp.{shared}{m}") for m in ("gate_proj", "up_proj", "down_proj")),
                s,
            )
            if self.qwen:
                sh = torch.sigmoid(s(row @ self.t(p + "mlp.shared_expert_gate").T)) * sh
            out.append(s(s(acc) + sh))
        return torch.stack(out)

    def _mlp(self, y: torch.Tensor, p: str, s: Store, route: Route | None) -> torch.Tensor:
        if p + "mlp.gate.weight" in self.w:
            return self._moe(y, p, s, route)
        return self._swiglu(
            y, *(self.t(p + f"mlp.{m}") for m in ("gate_proj", "up_proj", "down_proj")), s
        )

    def _attention(self, y: torch.Tensor, pos: torch.Tensor, p: str, s: Store) -> torch.Tensor:
        n, heads, kv_heads, hd = len(y), self.heads, self.kv_heads, self.hd

        def proj(name: str) -> torch.Tensor:
            out = y @ self.t(p + f"self_attn.{name}").T
            bias = p + f"self_attn.{name}.bias"
            return s(out + self.w[bias] if bias in self.w else out)

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
        q, k = (s(rope_neox(x, pos, self.rot, self.theta, s)) for x in (q, k))
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        a = s(torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1))
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
        s = store or _same
        n, p = len(tokens), self.prefix(step)
        pos = torch.arange(n)
        if self.qwen:
            e = self.t(self.embed)[torch.tensor(tokens)]
            e = s(self._norm(e, "mtp.pre_fc_norm_embedding"))
            h = s(self._norm(s(hiddens.double()), "mtp.pre_fc_norm_hidden"))
            x = s(torch.cat([e, h], -1) @ self.t("mtp.fc").T)
        else:
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
        x = s(x + self._mlp(y, p, s, route))
        return s(self._norm(x, "mtp.norm")) if self.qwen else x

    def logits(self, out: torch.Tensor, store: Store | None = None, step: int = 0) -> torch.Tensor:
        s = store or _same
        if self.qwen:
            return s(out @ self.t(self.head).T)
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

        Returns the drafts, their probabilities and the output hidden of every
        row of the chain (m0 .. m(K-1)). `allowed` is a [n, V] bool mask per draft.
        Draft j uses MTP layer j % (number of MTP layers), as vLLM's spec_step_idx does.
        """
        return chain_drafts(self, tokens, hiddens, num_drafts, allowed)
