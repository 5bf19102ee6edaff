"""A mixture-of-experts MLP: the router on the device, the routed experts, the shared expert.

Routing follows vLLM (and the published modeling code) per family:
- sigmoid (GLM-4.5, DeepSeek-V3): fp32 router logits; an expert is chosen by its
  score plus e_score_correction_bias, within the topk_group groups whose two best
  such scores sum highest; its weight is the plain sigmoid score, renormalized
  over the top-k when norm_topk_prob, times routed_scaling_factor;
- softmax (Qwen3-Next): router logits in the compute dtype, softmax in fp32 over
  every expert, top-k, renormalized when norm_topk_prob.
The shared expert is added to the routed sum; Qwen scales it by sigmoid(x @ w) first.
Everything stays on the device (no host sync), so a step with a MoE is still one
CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEConfig


def route(
    x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k] int64, fp32 weights [N, k]) of each row of x [N, H]."""
    if moe.scoring == "sigmoid":
        scores = F.linear(x.float(), router.float()).sigmoid()
        choice = scores + bias.float()
        if moe.n_group > 1:
            groups = choice.view(x.shape[0], moe.n_group, -1)
            best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
            kept = best.topk(moe.topk_group, dim=-1).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = F.linear(x, router).float().softmax(-1)
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
        if moe.shared_intermediate_size:
            self.shared_gate_up = torch.cat([t["shared_gate_proj"], t["shared_up_proj"]])
            self.shared_down = t["shared_down_proj"]
            self.shared_gate = t.get("shared_expert_gate")

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP's output for the normed rows y [N, H]."""
        ops = self.ops
        ids, weights = route(y, self.router, self.router_bias, self.moe)
        out = ops.moe_experts(
            y, self.experts_gate_up, self.experts_down, ids, weights, **self.scales
        )
        if self.shared_gate_up is None:
            return out
        shared = ops.linear(ops.swiglu(ops.linear(y, self.shared_gate_up)), self.shared_down)
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(y, self.shared_gate)) * shared
        return out + shared
