"""A mixture-of-experts MLP: the router on the device, the routed experts, the shared expert.

Routing follows vLLM (and the published modeling code) per family:
- sigmoid (GLM-4.5, DeepSeek-V3): fp32 router logits; an expert is chosen by its
  score plus e_score_correction_bias, within the topk_group groups whose two best
  such scores sum highest; its weight is the plain sigmoid score, renormalized
  over the top-k when norm_topk_prob, times routed_scaling_factor;
- softmax (Qwen3-Next): router logits in the compute dtype, softmax in fp32 over
  every expert, top-k, renormalized when norm_topk_prob.
The shared expert is added to the routed sum; Qwen scales it by sigmoid(x @ w) first.
When it is shaped like a routed expert (every published family), and FP8 exactly when
the experts are, it is stored as one more expert, E, and every row routes to it as well
(weight one, or Qwen's gate): one MoE call computes both, where a separate MLP would add
five small launches to a decode step. Qwen's gate row rides on the router's matrix (one
product for both). Everything stays on the device (no host sync), so a step with a MoE is
still one CUDA graph.

Which config keys describe a MoE is each family's (families/); the tensors are named as
every published family names them, under the block's ``mlp.``: ``gate`` (the router),
``gate.e_score_correction_bias``, ``experts.{e}.{gate,up,down}_proj`` (or stacked:
``experts.gate_up_proj``, ``experts.down_proj``), the shared expert's module (the family
names it) and ``shared_expert_gate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ConfigReader, MoEConfig, MTPConfig
from .errors import CheckpointError
from .tensors import FP8Matrix


def read_top_k(c: ConfigReader, choosable: int, among: str) -> int:
    """num_experts_per_tok: at most the experts a row may choose from (`among` names them)."""
    top_k = c.positive("num_experts_per_tok")
    if top_k > choosable:
        raise CheckpointError(f"config.json: num_experts_per_tok={top_k} exceeds {among}")
    return top_k


def moe_names(mlp: str, moe: MoEConfig, shared_expert: str) -> dict[str, str]:
    """Family-neutral key -> published name of each tensor under `mlp` (the block's mlp.)
    but the routed experts' (expert_names), the shared expert's under its module's name."""
    names = {"router": f"{mlp}gate.weight"}
    if moe.scoring == "sigmoid":
        names["router_bias"] = f"{mlp}gate.e_score_correction_bias"
    if moe.shared_intermediate_size:
        shared = f"{mlp}{shared_expert}."
        names |= {
            f"shared_{p}": f"{shared}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
        }
    if moe.shared_expert_gate:
        names["shared_expert_gate"] = f"{mlp}shared_expert_gate.weight"
    return names


def expert_names(mlp: str, e: int) -> dict[str, str]:
    """Routed expert e's projections, stored one tensor each."""
    projections = ("gate_proj", "up_proj", "down_proj")
    return {f"expert_{p}": f"{mlp}experts.{e}.{p}.weight" for p in projections}


def stacked_expert_names(mlp: str) -> dict[str, str]:
    """Every routed expert in one tensor per projection (Qwen3.5's layout)."""
    return {
        "experts_gate_up": f"{mlp}experts.gate_up_proj",
        "experts_down": f"{mlp}experts.down_proj",
    }


def moe_shapes(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    h, moe = c.hidden_size, c.moe
    e, mi, si = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    return {
        "router": (e, h),
        "router_bias": (e,),
        "expert_gate_proj": (mi, h),
        "expert_up_proj": (mi, h),
        "expert_down_proj": (h, mi),
        "experts_gate_up": (e, 2 * mi, h),
        "experts_down": (e, h, mi),
        "shared_gate_proj": (si, h),
        "shared_up_proj": (si, h),
        "shared_down_proj": (h, si),
        "shared_expert_gate": (1, h),
    }


def router_logits(x: torch.Tensor, router: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[N, router rows] logits: fp32 for sigmoid scoring (as vLLM), else in x's dtype."""
    if moe.scoring == "sigmoid":
        return F.linear(x.float(), router.float())
    return F.linear(x, router)


def select_experts(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k] int64, fp32 weights [N, k]) from the router's logits (the first
    num_experts columns; a shared expert's gate may follow)."""
    logits = logits[:, : moe.num_experts]
    if moe.scoring == "sigmoid":
        scores = logits.float().sigmoid()
        choice = scores + bias.float()
        if moe.n_group > 1:
            groups = choice.view(logits.shape[0], moe.n_group, -1)
            best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
            kept = best.topk(moe.topk_group, dim=-1).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = logits.float().softmax(-1)
        weights, ids = probs.topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * moe.routed_scaling_factor


class MoEMLP:
    """The MoE MLP of one layer, its weights on one device."""

    def __init__(self, moe: MoEConfig, t: dict[str, torch.Tensor], ops, fp8_block=None) -> None:
        self.moe, self.ops = moe, ops
        self.router, self.router_bias = t["router"], t.get("router_bias")
        self.experts_gate_up, self.experts_down = t["experts_gate_up"], t["experts_down"]
        # FP8 experts (DeepSeek's): their fp32 block scales, read by the kernel with them.
        self.scales = {}
        if "experts_gate_up_scale" in t:
            self.scales = dict(
                gate_up_scale=t["experts_gate_up_scale"],
                down_scale=t["experts_down_scale"],
                scale_block=fp8_block,
            )
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        self.router_rows = self.router  # the router's rows, then Qwen's shared gate's
        self.shared_column = None  # the shared expert as expert E: weight "one" or "gate"
        if moe.shared_intermediate_size:
            # [gate; up] stacked by the head (FP8 where the experts are), and down.
            gate_up, down = t["shared_gate_up"], t["shared_down_proj"]
            self.shared_gate = t.get("shared_expert_gate")
            if self.shared_gate is not None:
                gate_row = self.shared_gate.to(self.router.dtype)
                self.router_rows = torch.cat([self.router, gate_row])
            fp8 = isinstance(gate_up, FP8Matrix) and isinstance(down, FP8Matrix)
            if moe.shared_intermediate_size == moe.intermediate_size and fp8 == bool(self.scales):
                gate_up, down = self._as_expert_e(gate_up, down)
                self.shared_column = "one" if self.shared_gate is None else "gate"
            self.shared_gate_up, self.shared_down = gate_up, down

    def _as_expert_e(self, gate_up, down):
        """Stores the shared expert after the routed ones; returns its weights (views)."""
        fp8 = bool(self.scales)
        self.experts_gate_up = torch.cat(
            [self.experts_gate_up, (gate_up.values if fp8 else gate_up)[None]]
        )
        self.experts_down = torch.cat([self.experts_down, (down.values if fp8 else down)[None]])
        if not fp8:
            return self.experts_gate_up[-1], self.experts_down[-1]
        s, block = self.scales, self.scales["scale_block"]
        s["gate_up_scale"] = torch.cat([s["gate_up_scale"], gate_up.scale[None]])
        s["down_scale"] = torch.cat([s["down_scale"], down.scale[None]])
        return (
            FP8Matrix(self.experts_gate_up[-1], s["gate_up_scale"][-1], block),
            FP8Matrix(self.experts_down[-1], s["down_scale"][-1], block),
        )

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP's output for the normed rows y [N, H]."""
        ops, moe = self.ops, self.moe
        logits = ops.router_logits(y, self.router_rows, moe)
        ids, weights = ops.select_experts(logits, self.router_bias, moe, self.shared_column)
        out = ops.moe_experts(
            y, self.experts_gate_up, self.experts_down, ids, weights, **self.scales
        )
        if self.shared_gate_up is None or self.shared_column:
            return out
        shared = ops.linear(ops.swiglu(ops.linear(y, self.shared_gate_up)), self.shared_down)
        if self.shared_gate is not None:
            gate = logits[:, moe.num_experts :].to(shared.dtype)
            shared = torch.sigmoid(gate) * shared
        return out + shared
