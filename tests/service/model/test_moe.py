"""The MoE MLP against the published computation in float64: the routed experts by the
family's router, plus the shared expert added on its own (Qwen: scaled by its sigmoid
gate). Both ops (torch, and the Triton kernels under the interpreter) must agree with it,
whether the shared expert is stored as expert E (shaped like a routed one) or kept apart.
"""

from __future__ import annotations

import pytest
import torch
from reference_common import sigmoid_grouped_topk, softmax_topk

from mtpdraft.service.model.config import MoEConfig
from mtpdraft.service.model.moe import MoEMLP
from mtpdraft.service.model.ops import ops_for

H, E, INTER = 32, 8, 16


def _config(scoring: str, shared: int, gate: bool) -> MoEConfig:
    grouped = scoring == "sigmoid"
    return MoEConfig(
        num_experts=E, top_k=3, intermediate_size=INTER, scoring=scoring, norm_topk_prob=True,
        routed_scaling_factor=2.5 if grouped else 1.0, n_group=4 if grouped else 1,
        topk_group=2 if grouped else 1, shared_intermediate_size=shared, shared_expert_gate=gate,
    )  # fmt: skip


def _tensors(cfg: MoEConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    t = {"router": r(E, H), "experts_gate_up": r(E, 2 * INTER, H), "experts_down": r(E, H, INTER)}
    if cfg.scoring == "sigmoid":
        t["router_bias"] = r(E)
    if cfg.shared_intermediate_size:
        s = cfg.shared_intermediate_size
        t |= {"shared_gate_proj": r(s, H), "shared_up_proj": r(s, H), "shared_down_proj": r(H, s)}
        t["shared_gate_up"] = torch.cat([t["shared_gate_proj"], t["shared_up_proj"]])  # as MTPHead
    if cfg.shared_expert_gate:
        t["shared_expert_gate"] = r(1, H)
    return t


def _swiglu_mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def published(y: torch.Tensor, t: dict, cfg: MoEConfig) -> torch.Tensor:
    """Per row, in float64: routed experts by the family's router, then the shared expert."""
    d = {k: v.double() for k, v in t.items()}
    out = []
    for row in y.double():
        logits = d["router"] @ row
        if cfg.scoring == "sigmoid":
            ids, w = sigmoid_grouped_topk(
                logits, d["router_bias"], cfg.top_k, cfg.n_group, cfg.topk_group, True,
                cfg.routed_scaling_factor,
            )  # fmt: skip
        else:
            ids, w = softmax_topk(logits, cfg.top_k, True)
        acc = sum(
            wj * _swiglu_mlp(row, d["experts_gate_up"][e, :INTER], d["experts_gate_up"][e, INTER:],
                             d["experts_down"][e])
            for e, wj in zip(ids.tolist(), w, strict=True)
        )  # fmt: skip
        if cfg.shared_intermediate_size:
            shared = _swiglu_mlp(
                row, d["shared_gate_proj"], d["shared_up_proj"], d["shared_down_proj"]
            )
            if cfg.shared_expert_gate:
                shared = torch.sigmoid(d["shared_expert_gate"][0] @ row) * shared
            acc = acc + shared
        out.append(acc)
    return torch.stack(out)


CASES = {
    "glm (sigmoid, grouped, shared)": ("sigmoid", INTER, False),
    "qwen (softmax, gated shared)": ("softmax", INTER, True),
    "shared wider than an expert": ("softmax", 2 * INTER, True),
    "no shared expert": ("sigmoid", 0, False),
}


@pytest.mark.parametrize("ops", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_moe_mlp_computes_the_published_mlp(case: str, ops: str) -> None:
    cfg = _config(*CASES[case])
    t = _tensors(cfg, seed=len(case))
    y = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    mlp = MoEMLP(cfg, dict(t), ops_for(torch.device("cpu"), ops))
    torch.testing.assert_close(mlp(y).double(), published(y, t, cfg), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_shared_expert_shaped_like_a_routed_one_is_stored_as_expert_e(case: str) -> None:
    cfg = _config(*CASES[case])
    mlp = MoEMLP(cfg, _tensors(cfg, seed=3), ops_for(torch.device("cpu"), "torch"))
    folded = cfg.shared_intermediate_size == INTER
    assert mlp.experts_gate_up.shape[0] == E + folded
    assert (mlp.shared_column is not None) == folded
    if folded:  # the shared expert's weights are expert E's, not a copy
        assert mlp.shared_gate_up.data_ptr() == mlp.experts_gate_up[E].data_ptr()
