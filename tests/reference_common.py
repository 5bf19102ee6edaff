"""What the float64 oracles share: a checkpoint read in float64, RMSNorm, RoPE (plain and
YaRN frequencies, NeoX and interleaved rotations), the input projection, a SwiGLU MLP,
causal attention, MoE routing and the sum of the chosen experts, the chain of drafts, and
the hooks their `rows` and `logits` take (`store`, `route`).

The oracles (tests/mtp_reference.py, tests/family_reference.py, tests/deepseek_reference.py)
say which published code each piece follows; like them, this module imports nothing of
mtpdraft.service.

`store` is applied to every value a real implementation keeps in its compute dtype (each
op's output, the cached K/V, the RoPE table, the hidden passed on), so that an emulation
of bf16 or fp32 can round or perturb them there; without it the computation is exact
float64. `route` sees, and may change, each MoE row's choice of experts.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

Store = Callable[[torch.Tensor], torch.Tensor]
# pick(ids, margin, values) -> the expert ids a row uses, given the oracle's own choice, its
# margin (how far that choice is from a tie: the last value kept minus the first left out)
# and the values that choose (biased sigmoid scores, or router logits).
Pick = Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]
# route(row, ids, margin, values): a Pick for each row of a sequence, by its index.
Route = Callable[[int, torch.Tensor, float, torch.Tensor], torch.Tensor]


def same(x: torch.Tensor) -> torch.Tensor:
    return x


# --- the checkpoint ---------------------------------------------------------------------


def dequant_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """fp8 weight [M, N] times its scale_inv [ceil(M/b0), ceil(N/b1)], block by block."""
    rows, cols = q.shape
    s = scale_inv.double().repeat_interleave(block[0], 0)[:rows]
    return q.double() * s.repeat_interleave(block[1], 1)[:, :cols]


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (one file, or the shards of its index) as float64, FP8
    weights dequantized: a weight of one byte has `<name>_scale_inv` (DeepSeek-V3's
    inference/fp8_cast_bf16.py), by blocks of quantization_config.weight_block_size."""
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
        if v.element_size() == 1:
            out[k] = dequant_fp8(v, raw[k + "_scale_inv"], block)
        else:
            out[k] = v.double()
    return out


@dataclass
class Float64Checkpoint:
    """A checkpoint folder read whole: config.json (`text`: a multimodal config's language
    model) and every tensor in float64. The oracles build on it."""

    folder: Path
    cfg: dict = field(init=False)
    w: dict = field(init=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.cfg = json.loads((self.folder / "config.json").read_text())
        self.text = self.cfg.get("text_config", self.cfg)
        self.w = load_tensors(self.folder)

    def t(self, name: str) -> torch.Tensor:
        return self.w[name + ".weight"] if name + ".weight" in self.w else self.w[name]

    def own(self, name: str, shared: str) -> torch.Tensor:
        """The MTP layer's own copy (`name`) where the checkpoint keeps one, else the model's."""
        return self.t(name if name + ".weight" in self.w else shared)

    def linear(self, x: torch.Tensor, name: str, s: Store = same) -> torch.Tensor:
        """x times the weight `name`, plus its bias where the checkpoint has one."""
        out = x @ self.t(name).T
        bias = name + ".bias"
        return s(out + self.w[bias] if bias in self.w else out)

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
        Draft j is computed by `rows` and `logits` of step j (the MTP layer vLLM's
        spec_step_idx picks).
        """
        return chain_drafts(self, tokens, hiddens, num_drafts, allowed)


def chain_drafts(
    ref, tokens: list[int], hiddens: torch.Tensor, num_drafts: int, allowed: torch.Tensor | None
) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """The greedy chain of `ref` (rows and logits by draft step) after the rows (tokens,
    hiddens); see Float64Checkpoint.propose."""
    tokens, hiddens = list(tokens), hiddens.double()
    drafts, probs, outs = [], [], []
    for j in range(num_drafts):
        out = ref.rows(tokens, hiddens, step=j)[-1]
        logits = ref.logits(out, step=j)
        if allowed is not None:
            logits = logits.masked_fill(~allowed[min(j, len(allowed) - 1)], float("-inf"))
        d = int(logits.argmax())
        drafts.append(d)
        probs.append(float(logits.softmax(-1)[d]))
        outs.append(out)
        tokens.append(d)
        hiddens = torch.cat([hiddens, out[None]])
    return drafts, probs, outs


# --- norms, RoPE ----------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool = False
) -> torch.Tensor:
    """x / rms(x) * w, or * (1 + w) for Qwen3-Next's zero-centred norm."""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * (1 + w) if zero_centred else y * w


def inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE's [dim / 2] inverse frequencies: theta ** (-2i / dim)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


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
    """YaRN's: inter * (1 - mask) + extra * mask, extra = base**(-2i/d), inter = extra /
    factor, mask = 1 - clamp((i - low) / (high - low), 0, 1) over the correction range."""

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


def _cos_sin(pos: torch.Tensor, inv: torch.Tensor, mscale: float, s: Store):
    ang = pos[:, None].double() * inv[None]
    return s(ang.cos()[:, None] * mscale), s(ang.sin()[:, None] * mscale)


def rope_neox(
    x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, mscale: float = 1.0, s: Store = same
) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of x [n, heads, d]: dims (i, i + r/2) rotate by pos * inv[i],
    r = 2 * len(inv) (a partial rotary leaves the dims past r as they are)."""
    cos, sin = _cos_sin(pos, inv, mscale, s)
    r = 2 * len(inv)
    a, b = x[..., : r // 2], x[..., r // 2 : r]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., r:]], -1)


def rope_interleaved(
    x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, mscale: float = 1.0, s: Store = same
) -> torch.Tensor:
    """GPT-J (DeepSeek's) RoPE of x [n, heads, d]: pairs (2i, 2i+1) rotate by pos * inv[i]."""
    cos, sin = _cos_sin(pos, inv, mscale, s)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


# --- the layer's pieces -----------------------------------------------------------------


def input_projection(
    embeds: torch.Tensor, hiddens: torch.Tensor, weights: list[torch.Tensor], eps: float,
    embed_first: bool, s: Store = same, zero_centred: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The MTP layer's input: the embeddings and the target's hiddens, each normed, through
    the input projection (over cat[embedding, hidden] if `embed_first`, else hidden first).
    `weights`: the embedding's norm, the hidden's norm, the projection."""
    w_embed, w_hidden, w_proj = weights
    e = s(rms_norm(embeds, w_embed, eps, zero_centred))
    h = s(rms_norm(s(hiddens.double()), w_hidden, eps, zero_centred))
    return s(torch.cat([e, h] if embed_first else [h, e], -1) @ w_proj.T)


def swiglu(
    y: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, s: Store = same
) -> torch.Tensor:
    """down(silu(gate(y)) * up(y))."""
    g, u = s(y @ gate.T), s(y @ up.T)
    return s(s(torch.nn.functional.silu(g) * u) @ down.T)


def causal_attention(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax of the scaled scores [heads, n, n] over the rows up to each one's own, weighting
    v [n, heads, dv]: [n, heads * dv]."""
    n = scores.shape[-1]
    probs = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [n, heads, d] over k and v [n, kv_heads, d] (GQA: each KV head
    serves heads / kv_heads query heads), scaled by d^-0.5: [n, heads * d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return causal_attention(torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5, v)


# --- MoE routing --------------------------------------------------------------------------


def _margin(ranked: torch.Tensor, kept: int) -> float:
    """How far a top-`kept` choice over `ranked` values is from a tie: the last value kept
    minus the first left out (inf when nothing is left out)."""
    top = ranked.sort(descending=True).values
    if kept >= top.numel() or not torch.isfinite(top[kept]):
        return math.inf
    return float(top[kept - 1] - top[kept])


def _picked(pick: Pick | None, ids: torch.Tensor, margin: float, values: torch.Tensor):
    return ids if pick is None else torch.as_tensor(pick(ids, margin, values))


def row_pick(route: Route | None, row: int) -> Pick | None:
    """The Pick of a sequence's row `row` (None: the oracle's own choice)."""
    return None if route is None else functools.partial(route, row)


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


def sigmoid_routing(
    cfg: dict, logits: torch.Tensor, bias: torch.Tensor, pick: Pick | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sigmoid_grouped_topk as a GLM-4.5 or DeepSeek-V3 config.json sets it (its keys read
    when called, their defaults where absent)."""
    return sigmoid_grouped_topk(
        logits,
        bias,
        cfg["num_experts_per_tok"],
        cfg.get("n_group") or 1,
        cfg.get("topk_group") or 1,
        cfg.get("norm_topk_prob", True),
        cfg.get("routed_scaling_factor", 1.0),
        pick,
    )


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, pick: Pick | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen MoE routing for one token: (expert ids, weights); its margin is in logits."""
    p = logits.softmax(-1)
    ids = _picked(pick, p.topk(top_k).indices, _margin(logits, top_k), logits)
    w = p[ids]
    return ids, (w / w.sum() if renormalize else w)


def mixed_experts(
    row: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' outputs (`expert(e)` of the row), summed by their weights."""
    acc = torch.zeros_like(row)
    for e, wt in zip(ids.tolist(), weights, strict=True):
        acc = acc + wt * expert(e)
    return acc
