"""moe_route against the routing written in plain torch from the published modeling code."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import moe_route


def route_ref(logits, bias, k, scoring, norm, scale, n_group=1, topk_group=1):
    """(ids [N, k] int64, weights [N, k] float64): Qwen3-Next's softmax router, or
    DeepSeek-V3's sigmoid router with its group-limited choice (noaux_tc)."""
    logits = logits.double()
    n, e = logits.shape
    if scoring == "softmax":
        score = logits.softmax(-1)
        choice = score
    else:
        score = logits.sigmoid()
        choice = score + bias.double()
        groups = choice.view(n, n_group, -1)
        group_value = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        kept = group_value.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_value).scatter_(1, kept, 1.0).bool()
        choice = groups.masked_fill(~mask[..., None], float("-inf")).view(n, e)
    ids = choice.topk(k, dim=-1).indices
    weights = score.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0))
    return ids, weights * scale


def _sorted(ids, weights):
    order = ids.long().argsort(-1)
    return ids.long().gather(1, order), weights.double().gather(1, order)


CASES = [
    # (n, experts, k, scoring, norm, scale, n_group, topk_group)
    (3, 16, 4, "softmax", True, 1.0, 1, 1),
    (2, 12, 3, "softmax", False, 1.0, 1, 1),
    (4, 16, 4, "sigmoid", True, 2.5, 4, 2),
    (3, 20, 2, "sigmoid", False, 1.0, 1, 1),
    (2, 8, 2, "sigmoid", True, 1.5, 8, 4),  # one expert a group: a group's value is its one
]


@pytest.mark.parametrize("n,e,k,scoring,norm,scale,n_group,topk_group", CASES)
def test_matches_the_published_routing(n, e, k, scoring, norm, scale, n_group, topk_group):
    gen = torch.Generator().manual_seed(n * e + k)
    logits = torch.randn(n, e, generator=gen) * 2
    bias = torch.randn(e, generator=gen) * 0.5 if scoring == "sigmoid" else None
    ids, weights = moe_route(
        logits, bias, num_experts=e, top_k=k, scoring=scoring, norm_topk_prob=norm,
        routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group,
    )  # fmt: skip
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    want_ids, want_w = _sorted(
        *route_ref(logits, bias, k, scoring, norm, scale, n_group, topk_group)
    )
    got_ids, got_w = _sorted(ids, weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shared", ["one", "gate"])
def test_the_shared_column_names_expert_e_with_weight_one_or_its_gate(shared):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 9, generator=gen)  # 8 experts and the shared expert's gate
    ids, weights = moe_route(
        logits, None, num_experts=8, top_k=2, scoring="softmax", norm_topk_prob=True,
        shared=shared,
    )  # fmt: skip
    want_ids, want_w = route_ref(logits[:, :8], None, 2, "softmax", True, 1.0)
    got_ids, got_w = _sorted(ids[:, :2], weights[:, :2])
    want_ids, want_w = _sorted(want_ids, want_w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(ids[:, 2], torch.full((3,), 8, dtype=torch.int32))
    gate = logits[:, 8].double().sigmoid() if shared == "gate" else torch.ones(3).double()
    torch.testing.assert_close(weights[:, 2].double(), gate, atol=1e-6, rtol=1e-5)


def test_reads_strided_bf16_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 40, generator=gen).bfloat16()
    logits = wide[:, :32]
    ids, weights = moe_route(
        logits, None, num_experts=32, top_k=4, scoring="softmax", norm_topk_prob=True
    )
    want_ids, want_w = _sorted(*route_ref(logits.float(), None, 4, "softmax", True, 1.0))
    got_ids, got_w = _sorted(ids, weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"top_k": 9}, "top_k must be in"),
        ({"scoring": "relu"}, "scoring must be"),
        ({"shared": "gate"}, "logits need 9 columns"),
        ({"n_group": 3}, "n_group"),
        ({"n_group": 4, "topk_group": 1, "top_k": 3}, "exceeds the experts"),
    ],
)
def test_rejects_bad_arguments(kwargs, match) -> None:
    args = {"num_experts": 8, "top_k": 2, "scoring": "softmax", "norm_topk_prob": True}
    with pytest.raises(ValueError, match=match):
        moe_route(torch.randn(2, 8), None, **(args | kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize(
    "e,k,scoring,n_group,topk_group,scale",
    [
        (512, 10, "softmax", 1, 1, 1.0),
        (128, 8, "sigmoid", 1, 1, 1.0),
        (256, 8, "sigmoid", 8, 4, 2.5),
    ],
)
def test_gpu_published_shapes(n, e, k, scoring, n_group, topk_group, scale) -> None:
    """Qwen3-Next (512 experts, top 10), GLM-4.5-Air (128, top 8), DeepSeek-V3 (256 in 8
    groups, top 8 of 4 groups)."""
    gen = torch.Generator().manual_seed(n + e)
    logits = (torch.randn(n, e, generator=gen) * 2).cuda()
    bias = (torch.randn(e, generator=gen) * 0.5).cuda() if scoring == "sigmoid" else None
    ids, weights = moe_route(
        logits, bias, num_experts=e, top_k=k, scoring=scoring, norm_topk_prob=True,
        routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group,
    )  # fmt: skip
    want = route_ref(logits.cpu(), bias.cpu() if bias is not None else None, k, scoring, True,
                     scale, n_group, topk_group)  # fmt: skip
    want_ids, want_w = _sorted(*want)
    got_ids, got_w = _sorted(ids.cpu(), weights.cpu())
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
