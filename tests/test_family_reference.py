"""Self-tests of the GLM / Qwen3-Next MTP oracle (tests/family_reference.py) and of the
tiny checkpoints it is run on (tests/family_checkpoints.py): hand-computed cases for the
pieces that differ from MiMo/DeepSeek, and checks that the written checkpoints make every
published detail matter to the drafts."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from drafting import all_drafts, prompts
from family_checkpoints import NAMES, write_family_checkpoint
from family_reference import FamilyReference
from reference_common import inv_freq, rms_norm, rope_neox, sigmoid_grouped_topk, softmax_topk


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, FamilyReference]:
    return {
        name: FamilyReference(write_family_checkpoint(tmp_path_factory.mktemp(name), name))
        for name in NAMES
    }


# --- the pieces, by hand -------------------------------------------------------------


def test_sigmoid_routing_uses_the_bias_to_choose_groups_and_not_to_weigh():
    # Two groups {0, 1} and {2, 3}, scored by the sum of their top 2. Without the bias
    # group 0 wins (0.881 + 0.622 against 0.622 + 0.599); with +0.3 on expert 2 group 1
    # wins (0.922 + 0.599 = 1.521 against 1.503) and expert 0, the best score of all, is
    # left out. The weights are the unbiased sigmoids, renormalised, times the scaling.
    logits = torch.tensor([2.0, 0.5, 0.5, 0.4], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.3, 0.0], dtype=torch.float64)
    ids, w = sigmoid_grouped_topk(logits, bias, 2, 2, 1, True, 2.5)
    s2, s3 = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-0.4))
    assert ids.tolist() == [2, 3]
    assert w.tolist() == pytest.approx([2.5 * s2 / (s2 + s3), 2.5 * s3 / (s2 + s3)], abs=1e-12)

    ids, w = sigmoid_grouped_topk(logits, torch.zeros(4, dtype=torch.float64), 2, 2, 1, True, 1.0)
    s0, s1 = 1 / (1 + math.exp(-2.0)), s2
    assert ids.tolist() == [0, 1]
    assert w.tolist() == pytest.approx([s0 / (s0 + s1), s1 / (s0 + s1)], abs=1e-12)

    # One group (GLM-4.5's published n_group = 1): plain top-k of score + bias; without
    # norm_topk_prob the weights are the raw sigmoids times the scaling factor.
    ids, w = sigmoid_grouped_topk(logits, bias, 2, 1, 1, False, 2.0)
    assert ids.tolist() == [2, 0]
    assert w.tolist() == pytest.approx([2 * s2, 2 * s0], abs=1e-12)


def test_softmax_routing_by_hand():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)
    z = sum(math.exp(x) for x in (1.0, 2.0, 3.0, 0.0))
    ids, w = softmax_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [2, 1]
    assert w.tolist() == pytest.approx([math.exp(3) / z, math.exp(2) / z], abs=1e-12)
    ids, w = softmax_topk(logits, 2, renormalize=True)
    e3, e2 = math.exp(3), math.exp(2)
    assert w.tolist() == pytest.approx([e3 / (e2 + e3), e2 / (e2 + e3)], abs=1e-12)


def test_routing_hooks_see_the_margin_and_may_change_the_choice():
    # The biased example above: groups score 1.521 (group 1) and 1.503 (group 0), the
    # choice inside group 1 is 0.922 and 0.599 with nothing left out: the margin is the
    # group's, 0.0178. A pick of [0, 1] is weighed by their unbiased scores.
    logits = torch.tensor([2.0, 0.5, 0.5, 0.4], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.3, 0.0], dtype=torch.float64)
    s = torch.sigmoid(logits)
    seen = []

    def pick(ids, margin, values):
        seen.append((ids.tolist(), margin, values.tolist()))
        return torch.tensor([0, 1])

    ids, w = sigmoid_grouped_topk(logits, bias, 2, 2, 1, True, 2.5, pick)
    group = float(s[2] + 0.3 + s[3] - s[0] - s[1])
    assert seen == [([2, 3], pytest.approx(group, abs=1e-12), (s + bias).tolist())]
    assert ids.tolist() == [0, 1]
    assert w.tolist() == pytest.approx((2.5 * s[:2] / s[:2].sum()).tolist(), abs=1e-12)
    # Softmax: the margin is in logits, the third largest away from the second.
    seen.clear()
    softmax_topk(torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64), 2, True, pick)
    assert seen[0][:2] == ([2, 1], pytest.approx(1.0))


def test_zero_centred_norm_scales_by_one_plus_w():
    x = torch.tensor([3.0, 4.0], dtype=torch.float64)
    rms = math.sqrt(12.5)
    w = torch.tensor([0.5, -0.5], dtype=torch.float64)
    assert rms_norm(x, w, 0.0, True).tolist() == pytest.approx([1.5 * 3 / rms, 0.5 * 4 / rms])
    assert rms_norm(x, w, 0.0, False).tolist() == pytest.approx([0.5 * 3 / rms, -0.5 * 4 / rms])
    # A zero weight is the identity scale only for the zero-centred kind.
    zero = torch.zeros(2, dtype=torch.float64)
    assert rms_norm(x, zero, 0.0, True).tolist() == pytest.approx([3 / rms, 4 / rms])


def test_partial_neox_rope_by_hand():
    # rot = 4 of 6 dims: pairs (0, 2) and (1, 3) rotate, dims 4 and 5 pass through.
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0, 5.0, 6.0]]], dtype=torch.float64)
    theta = 100.0
    y = rope_neox(x, torch.tensor([3]), inv_freq(4, theta))[0, 0]
    a0, a1 = 3.0, 3.0 / theta**0.5
    expected = [math.cos(a0), -math.sin(a1), math.sin(a0), math.cos(a1), 5.0, 6.0]
    assert y.tolist() == pytest.approx(expected, abs=1e-12)
    assert rope_neox(x, torch.tensor([0]), inv_freq(4, theta)).tolist() == x.tolist()


@pytest.mark.parametrize("name", ["qwen3-next", "qwen3.6-dense"])
def test_gated_attention_of_one_token_is_v_times_the_gate(refs, name):
    ref = refs[name]
    p, hd, heads, kv = ref.prefix(), ref.hd, ref.heads, ref.kv_heads
    y = torch.randn(1, ref.hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    qg = (y @ ref.t(p + "self_attn.q_proj").T).reshape(heads, 2 * hd)
    gate = qg[:, hd:].reshape(1, -1)  # per head: [q | gate]
    v = (y @ ref.t(p + "self_attn.v_proj").T).reshape(kv, hd)
    a = v.repeat_interleave(heads // kv, 0).reshape(1, -1)  # one token: softmax = 1
    expected = (a * torch.sigmoid(gate)) @ ref.t(p + "self_attn.o_proj").T
    got = ref._attention(y, torch.tensor([5]), p, lambda t: t)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # The other reading of the layout (all q heads, then all gates) gives another answer.
    wrong = (a * torch.sigmoid(qg.reshape(-1)[heads * hd :][None])) @ ref.t(
        p + "self_attn.o_proj"
    ).T
    assert (wrong - got).abs().max() > 1e-3


def test_glm_zeroes_the_embedding_at_position_0_and_qwen_does_not(refs):
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for name, masked in (("glm-4.5", True), ("glm-4.6", True), ("qwen3-next", False)):
        a, b = refs[name].rows([1, 2, 3], h), refs[name].rows([9, 2, 3], h)
        assert torch.equal(a[0], b[0]) == masked, name
        # Unmasked, the token also reaches the later rows through attention.
        assert torch.equal(a[1], b[1]) == masked, name


def test_qwen_passes_on_the_normed_hidden_and_glm_the_block_output(refs):
    for name in ("qwen3-next", "glm-4.5"):
        ref = refs[name]
        t, h = prompts(1)[0]
        _, _, outs = ref.propose(t, h, 2)
        rms = float(outs[0].pow(2).mean().sqrt())
        if ref.qwen:  # mtp.norm's output: unit RMS times (1 + w), w ~ 0.1
            assert 0.8 < rms < 1.2
        else:  # residual stream: not normalised
            assert not 0.8 < rms < 1.2


# --- the checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_propose_is_deterministic_and_tie_free(refs, name):
    ref = refs[name]
    for tokens, hiddens in prompts():
        first = ref.propose(tokens, hiddens, 3)
        again = ref.propose(tokens, hiddens, 3)
        assert first[0] == again[0] and first[1] == again[1]
        top = ref.logits(ref.rows(tokens, hiddens)[-1]).topk(2).values
        assert float(top[0] - top[1]) > 1e-3
        # The logits spread over a few units, so drafts are neither ties nor certainties.
        assert 0.5 < float(ref.logits(first[2][0]).std()) < 10


@pytest.mark.parametrize("name", NAMES)
def test_spelling_shards_and_full_model_give_the_same_drafts(refs, tmp_path, name):
    folder = write_family_checkpoint(
        tmp_path, name, spelling="transformers5", shards=3, full_model=True
    )
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert "rope_parameters" in text and "rope_theta" not in text and "torch_dtype" not in cfg
    assert cfg["dtype"] == "float32"
    assert (folder / "model.safetensors.index.json").exists()
    full = FamilyReference(folder)
    assert len(full.w) > len(refs[name].w)
    assert all_drafts(full) == all_drafts(refs[name])


def test_published_names_and_dtypes(tmp_path):
    def keys(name: str, **kw) -> tuple[set[str], dict]:
        ref = FamilyReference(write_family_checkpoint(tmp_path / name, name, **kw))
        return set(ref.w), json.loads((tmp_path / name / "config.json").read_text())

    k45, c45 = keys("glm-4.5")
    assert {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"} <= k45
    assert "model.layers.2.self_attn.q_norm.weight" in k45 and c45["torch_dtype"] == "float32"
    assert c45["partial_rotary_factor"] == 0.5 and c45["first_k_dense_replace"] == 1
    k46, _ = keys("glm-4.6")
    assert "model.layers.2.embed_tokens.weight" not in k46
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= k46
    kair, _ = keys("glm-4.5-air")
    assert "model.layers.2.self_attn.q_norm.weight" not in kair
    k35, c35 = keys("qwen3.5-moe", spelling="transformers5")
    assert {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"} <= k35
    assert "model.language_model.embed_tokens.weight" in k35
    rope = c35["text_config"]["rope_parameters"]
    assert rope["mrope_section"] == [2, 1, 1] and rope["partial_rotary_factor"] == 0.25
    knext, _ = keys("qwen3-next")
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in knext
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in knext

    from safetensors.torch import load_file

    folder = write_family_checkpoint(tmp_path / "bf16", "glm-4.5", dtype=torch.bfloat16)
    w = load_file(folder / "model.safetensors")
    assert w["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert w["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _without(ref: FamilyReference, edit) -> FamilyReference:
    other = copy.copy(ref)
    other.w = dict(ref.w)
    edit(other)
    return other


def _zero(*names):
    def edit(ref):
        for n in names:
            ref.w[n] = torch.zeros_like(ref.w[n])

    return edit


def _swap_halves(name: str, dim: int):
    """What a loader reading the two halves of `name` in the other order computes."""

    def edit(ref):
        a, b = ref.w[name].chunk(2, dim)
        ref.w[name] = torch.cat([b, a], dim)

    return edit


def _config(**changes):
    return lambda ref: setattr(ref, "text", {**ref.text, **changes})


def _plain_norms(ref):
    """What a loader reading Qwen's norms as x * w (not x * (1 + w)) computes."""
    for n in [n for n in ref.w if "norm" in n]:
        ref.w[n] = ref.w[n] - 1


@pytest.mark.parametrize(
    "name, edit, what",
    [
        ("glm-4.5", _zero(*(f"model.layers.2.self_attn.{p}_proj.bias" for p in "qkv")), "qkv bias"),
        ("glm-4.5", _zero("model.layers.2.mlp.gate.e_score_correction_bias"), "router bias"),
        ("glm-4.5", lambda r: r.w.pop("model.layers.2.self_attn.q_norm.weight"), "q/k norm"),
        ("glm-4.5", lambda r: setattr(r, "rot", r.hd), "partial rotary"),
        ("qwen3-next", _zero("mtp.layers.0.mlp.shared_expert_gate.weight"), "shared gate"),
        ("qwen3-next", lambda r: setattr(r, "qwen", False) or setattr(r, "qwen", True), "none"),
        ("glm-4.5", _config(routed_scaling_factor=1.0), "routed scaling"),
        ("glm-4.5", _swap_halves("model.layers.2.eh_proj.weight", 1), "cat[e, h] order"),
        ("qwen3-next", _swap_halves("mtp.fc.weight", 1), "cat[e, h] order"),
        ("qwen3-next", _config(norm_topk_prob=False), "norm_topk_prob"),
        ("qwen3.5-moe", _swap_halves("mtp.layers.0.mlp.experts.gate_up_proj", 1), "gate | up"),
        ("qwen3-next", _plain_norms, "1+w"),
        ("qwen3.6-dense", _plain_norms, "1+w"),
    ],
)
def test_every_published_detail_changes_the_drafts(refs, name, edit, what):
    changed = _without(refs[name], edit)
    same = all_drafts(changed) == all_drafts(refs[name])
    assert same == (what == "none"), what


def test_group_limited_routing_changes_the_drafts(refs, tmp_path):
    grouped = FamilyReference(write_family_checkpoint(tmp_path, "glm-4.5", n_group=2, topk_group=1))
    assert grouped.text["n_group"] == 2
    assert all_drafts(grouped) != all_drafts(refs["glm-4.5"])
