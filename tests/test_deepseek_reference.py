"""Self-tests of the DeepSeek-V3 MTP oracle (tests/deepseek_reference.py) and of the tiny
checkpoints it runs on (tests/deepseek_checkpoints.py): hand-computed yarn, mscale, RoPE
style and FP8 cases, the absorbed MLA form against the plain one, and checks that the
written checkpoints make the published details matter to the drafts."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from deepseek_checkpoints import quantize_fp8, write_deepseek_checkpoint
from deepseek_reference import DeepseekReference
from drafting import all_drafts, prompts
from reference_common import (
    dequant_fp8,
    rope_interleaved,
    rope_neox,
    yarn_get_mscale,
    yarn_inv_freq,
)
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> DeepseekReference:
    return DeepseekReference(write_deepseek_checkpoint(tmp_path_factory.mktemp("v3")))


@pytest.fixture(scope="module")
def ref_fp8(tmp_path_factory) -> DeepseekReference:
    folder = write_deepseek_checkpoint(tmp_path_factory.mktemp("v3fp8"), fp8=True)
    return DeepseekReference(folder)


# --- the pieces, by hand -------------------------------------------------------------


def test_yarn_inv_freq_by_hand():
    # dim 8, base 1e4, original 1024: c(r) = 8 ln(1024 / (2 pi r)) / (2 ln 1e4);
    # c(32) = 0.707 -> low 0, c(1) = 2.21 -> high 3; ramp i/3, mask = 1 - i/3.
    dim, base, factor, orig = 8, 10000.0, 4.0, 1024
    c = lambda r: dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
    assert math.floor(c(32)) == 0 and math.ceil(c(1)) == 3
    inv = yarn_inv_freq(dim, base, factor, orig, 32, 1)
    extra1 = base ** (-2 / 8)  # 0.1
    assert float(inv[1]) == pytest.approx(extra1 / factor * (1 / 3) + extra1 * (2 / 3), abs=1e-15)
    assert float(inv[1]) == pytest.approx(0.075, abs=1e-15)
    assert float(inv[0]) == 1.0  # mask 1: pure extrapolation
    assert float(inv[3]) == pytest.approx(base ** (-6 / 8) / factor, abs=1e-15)  # interpolated


def test_mscale_and_the_softmax_scale(ref):
    assert yarn_get_mscale(40, 1.0) == pytest.approx(1 + 0.1 * math.log(40))
    assert yarn_get_mscale(1.0, 1.0) == 1.0 and yarn_get_mscale(0.5, 0.707) == 1.0
    assert yarn_get_mscale(40, 0.707) == pytest.approx(1 + 0.0707 * math.log(40))
    # Published mscale == mscale_all_dim: the cos/sin factor is 1, the softmax scale is not.
    assert ref.cos_mscale == 1.0
    m = 1 + 0.1 * math.log(4)
    assert ref.softmax_scale == pytest.approx((16 + 8) ** -0.5 * m * m, abs=1e-15)


def test_interleaved_and_neox_rotation_by_hand():
    # d = 4, inv_freq [1, 0.5], pos 1: interleaved rotates (x0, x1) by 1 and (x2, x3) by
    # 0.5; NeoX rotates (x0, x2) by 1 and (x1, x3) by 0.5.
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]], dtype=torch.float64)
    inv, pos = torch.tensor([1.0, 0.5], dtype=torch.float64), torch.tensor([1])
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.5), math.sin(0.5)
    gptj = rope_interleaved(x, pos, inv, 1.0)[0, 0].tolist()
    assert gptj == pytest.approx([c1, s1, -s2, c2], abs=1e-15)
    neox = rope_neox(x, pos, inv, 1.0)[0, 0].tolist()
    assert neox == pytest.approx([c1, -s2, s1, c2], abs=1e-15)
    # transformers' apply_rotary_pos_emb_interleave: de-interleave, then NeoX. Its output
    # is the GPT-J result permuted to (evens, odds), so q.k is the same.
    hf = rope_neox(x[..., [0, 2, 1, 3]], pos, inv, 1.0)[0, 0].tolist()
    assert hf == pytest.approx([gptj[0], gptj[2], gptj[1], gptj[3]], abs=1e-15)
    assert rope_interleaved(x, pos, inv, 1.5)[0, 0].tolist() == pytest.approx(
        [1.5 * v for v in gptj], abs=1e-15
    )


def test_fp8_dequantization_by_hand():
    # A 3 x 5 weight in [2, 2] blocks: scale_inv is 2 x 3, the last row/column partial.
    q = torch.tensor(
        [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [-1, -2, -3, -4, -5]], dtype=torch.float64
    ).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.5, 2.0, 4.0], [0.25, 1.0, 8.0]], dtype=torch.float32)
    expected = [
        [0.5, 1.0, 6.0, 8.0, 20.0],
        [3.0, 3.5, 16.0, 18.0, 40.0],
        [-0.25, -0.5, -3, -4, -40],
    ]
    assert dequant_fp8(q, s, [2, 2]).tolist() == expected
    # The writer's quantization: amax / 448 per block, so the largest entry maps to 448.
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q, s = quantize_fp8(w, [16, 16])
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 4)
    assert float(s[0, 0]) == pytest.approx(float(w[:16, :16].abs().max()) / 448, rel=1e-6)
    back = dequant_fp8(q, s, [16, 16])
    assert (back - w).abs().max() < 0.07 * w.abs().max()
    _, s8 = quantize_fp8(w, [16, 16], ue8m0=True)  # V3.1: powers of two
    assert all(math.log2(v) == round(math.log2(v)) for v in s8.flatten().tolist())


def absorbed_attention(r: DeepseekReference, y: torch.Tensor, pos: torch.Tensor, p: str):
    """MLA in the absorbed form: q_nope @ W_UK against the normed latent, the attention
    output kept in the latent space and expanded by W_UV before o_proj."""
    n, heads, nope, vd, rank = len(y), r.heads, r.nope, r.vd, r.kv_rank
    a = p + "self_attn."
    q = r._norm(y @ r.t(a + "q_a_proj").T, a + "q_a_layernorm") @ r.t(a + "q_b_proj").T
    q = q.reshape(n, heads, nope + r.rope)
    latent = y @ r.t(a + "kv_a_proj_with_mqa").T
    c = r._norm(latent[:, :rank], a + "kv_a_layernorm")
    w_kv = r.t(a + "kv_b_proj").reshape(heads, nope + vd, rank)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q_lat = torch.einsum("qhd,hdr->qhr", q[..., :nope], w_uk)
    q_pe = rope_interleaved(q[..., nope:], pos, r.inv_freq, r.cos_mscale)
    k_pe = rope_interleaved(latent[:, None, rank:], pos, r.inv_freq, r.cos_mscale)[:, 0]
    score = torch.einsum("qhr,kr->hqk", q_lat, c) + torch.einsum("qhd,kd->hqk", q_pe, k_pe)
    score = (score * r.softmax_scale).masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
    out_lat = torch.einsum("hqk,kr->qhr", score.softmax(-1), c)
    out = torch.einsum("qhr,hvr->qhv", out_lat, w_uv).reshape(n, heads * vd)
    return out @ r.t(a + "o_proj").T


def test_absorbed_form_equals_the_plain_form(ref):
    p = ref.prefix()
    y = torch.randn(7, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pos = torch.arange(7)
    plain = ref._attention(y, pos, p, lambda t: t)
    torch.testing.assert_close(absorbed_attention(ref, y, pos, p), plain, rtol=1e-10, atol=1e-12)
    assert plain.abs().max() > 0.1


# --- the checkpoints -----------------------------------------------------------------


@pytest.mark.parametrize("which", ["ref", "ref_fp8"])
def test_propose_is_deterministic_and_tie_free(request, which):
    r = request.getfixturevalue(which)
    for tokens, hiddens in prompts():
        first = r.propose(tokens, hiddens, 3)
        again = r.propose(tokens, hiddens, 3)
        assert first[0] == again[0] and first[1] == again[1]
        top = r.logits(r.rows(tokens, hiddens)[-1]).topk(2).values
        assert float(top[0] - top[1]) > 1e-3
        assert 0.5 < float(r.logits(first[2][0]).std()) < 10


def test_embedding_zeroed_at_position_0_and_the_hidden_passed_on_is_not_normed(ref):
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    a, b = ref.rows([1, 2, 3], h), ref.rows([9, 2, 3], h)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    t, hid = prompts(1)[0]
    out = ref.propose(t, hid, 1)[2][0]
    assert not 0.8 < float(out.pow(2).mean().sqrt()) < 1.2


def test_spelling_shards_and_full_model_give_the_same_drafts(ref, tmp_path):
    folder = write_deepseek_checkpoint(
        tmp_path, spelling="transformers5", shards=3, full_model=True
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert "rope_scaling" not in cfg and "rope_theta" not in cfg and "torch_dtype" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["dtype"] == "float32"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "model-00001-of-000003.safetensors" in index["weight_map"].values()
    full = DeepseekReference(folder)
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight",
    } <= set(full.w)
    assert "model.layers.1.mlp.gate.weight" in full.w  # first_k_dense_replace 1
    assert all_drafts(full) == all_drafts(ref)


def test_published_names_dtypes_and_fp8_layout(tmp_path):
    folder = write_deepseek_checkpoint(tmp_path, "deepseek-v3.1", fp8=True, dtype=torch.bfloat16)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [16, 16],
    }
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"]["type"] == "yarn"
    assert cfg["max_position_embeddings"] == (
        cfg["rope_scaling"]["factor"] * cfg["rope_scaling"]["original_max_position_embeddings"]
    )
    w = load_file(folder / "model.safetensors")
    p = "model.layers.2."
    for name in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.experts.7.down_proj"):
        assert w[p + name + ".weight"].dtype == torch.float8_e4m3fn
        assert w[p + name + ".weight_scale_inv"].dtype == torch.float32
    assert w[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 4)  # 40 x 64
    for name in ("eh_proj", "mlp.gate", "embed_tokens", "shared_head.head", "enorm"):
        assert w[p + name + ".weight"].dtype == torch.bfloat16
        assert p + name + ".weight_scale_inv" not in w
    assert w[p + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
    plain = load_file(write_deepseek_checkpoint(tmp_path / "plain") / "model.safetensors")
    assert not any(k.endswith("_scale_inv") for k in plain)
    assert "quantization_config" not in json.loads((tmp_path / "plain/config.json").read_text())


def test_fp8_weights_are_the_fp32_ones_within_fp8_error(ref, ref_fp8):
    name = "model.layers.2.self_attn.q_b_proj.weight"
    w, q = ref.w[name], ref_fp8.w[name]
    assert not torch.equal(w, q) and (w - q).abs().max() < 0.07 * w.abs().max()


def test_q_lora_rank_null_uses_q_proj(ref, tmp_path):
    lite = DeepseekReference(write_deepseek_checkpoint(tmp_path, q_lora_rank=None))
    assert "model.layers.2.self_attn.q_proj.weight" in lite.w
    assert "model.layers.2.self_attn.q_a_proj.weight" not in lite.w
    assert lite.w["model.layers.2.self_attn.q_proj.weight"].shape == (4 * 24, 64)
    assert all_drafts(lite) != all_drafts(ref)


def _changed(r: DeepseekReference, edit) -> DeepseekReference:
    other = copy.copy(r)
    other.w, other.cfg = dict(r.w), dict(r.cfg)
    edit(other)
    return other


def _zero(name):
    return lambda r: r.w.__setitem__(name, torch.zeros_like(r.w[name]))


def _hf_interleave(x, pos, inv_freq, mscale, s):
    """transformers' apply_rotary_pos_emb_interleave: de-interleave, then NeoX."""
    d = x.shape[-1]
    perm = list(range(0, d, 2)) + list(range(1, d, 2))
    return rope_neox(x[..., perm], pos, inv_freq, mscale, s)


def _no_yarn(r):
    r.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)


@pytest.mark.parametrize(
    "edit, what",
    [
        (lambda r: setattr(r, "rotate", rope_neox), "NeoX instead of interleaved RoPE"),
        (_no_yarn, "yarn inv_freq"),
        (lambda r: setattr(r, "softmax_scale", 24**-0.5), "softmax mscale"),
        (_zero("model.layers.2.mlp.gate.e_score_correction_bias"), "router bias"),
        (lambda r: r.cfg.__setitem__("routed_scaling_factor", 1.0), "routed scaling"),
        (lambda r: r.cfg.update(n_group=1, topk_group=1), "group-limited routing"),
        (lambda r: setattr(r, "rotate", _hf_interleave), "none"),
    ],
)
def test_every_published_detail_changes_the_drafts(ref, edit, what):
    same = all_drafts(_changed(ref, edit)) == all_drafts(ref)
    assert same == (what == "none"), what


def test_cos_sin_mscale_matters_when_mscale_differs_from_mscale_all_dim(ref, tmp_path):
    rope = dict(ref.cfg["rope_scaling"], mscale=2.0)
    other = DeepseekReference(write_deepseek_checkpoint(tmp_path, rope_scaling=rope))
    assert other.cos_mscale == pytest.approx((1 + 0.2 * math.log(4)) / (1 + 0.1 * math.log(4)))
    assert all_drafts(other) != all_drafts(ref)
