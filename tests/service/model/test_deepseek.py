"""DeepSeek-V3 MTP layers (MLA over a latent cache, MoE, YaRN, FP8) against the float64 oracle.

The checkpoints are tiny but use DeepSeek-V3's published config keys and weight
names (tests/deepseek_checkpoints.py), FP8 variants with their block scales
included; the oracle (tests/deepseek_reference.py) computes attention in the plain
form, so the absorbed form over the paged latent cache is checked against it.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_checkpoints import write_deepseek_checkpoint
from deepseek_reference import DeepseekReference
from test_families import assert_rows_and_logits_match

from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.errors import CheckpointError
from mtpdraft.service.model.mtp_head import MTPHead

VARIANTS = {
    "plain": {},
    "fp8": {"fp8": True},
    "q-proj": {"q_lora_rank": None},  # q projected directly, as DeepSeek-V2-Lite
    "transformers5-sharded-full": {"spelling": "transformers5", "shards": 3, "full_model": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_the_oracle(tmp_path, variant: str) -> None:
    write_deepseek_checkpoint(tmp_path, seed=3, **VARIANTS[variant])
    weights = load_mtp_weights(tmp_path)
    assert weights.family == "deepseek" and weights.config.mla is not None
    head = MTPHead(weights, torch.device("cpu"), ops="torch")
    ref = DeepseekReference(tmp_path)
    assert_rows_and_logits_match(head, ref)


def test_the_latent_cache_holds_what_vllm_caches(tmp_path) -> None:
    """Per token kv_lora_rank + qk_rope_head_dim values: not K and V of every head."""
    write_deepseek_checkpoint(tmp_path)
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"), ops="torch")
    m = head.config.mla
    assert head.kv_row_values == m.kv_lora_rank + m.qk_rope_head_dim
    kv = head.new_kv_cache(4, 16)
    assert kv.latent.shape == (4, 16, m.kv_lora_rank + m.qk_rope_head_dim)


def test_an_fp8_weight_without_its_scales_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    write_deepseek_checkpoint(tmp_path, fp8=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("kv_b_proj.weight_scale_inv"))
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="an FP8 weight without its scales"):
        load_mtp_weights(tmp_path)


def test_fp8_weights_dequantized_at_load_stay_exact_in_a_float32_head(tmp_path) -> None:
    """DeepSeek's FP8 checkpoints keep their other tensors in bf16. Served in float32, an
    FP8 weight dequantized at load (kv_b_proj, split into W_UK and W_UV) is fp8 x scale in
    float32, not rounded to the checkpoint's bf16 on the way (2**-9, against 2**-24)."""
    write_deepseek_checkpoint(tmp_path, fp8=True, dtype=torch.bfloat16)
    head = MTPHead(load_mtp_weights(tmp_path), torch.device("cpu"), torch.float32, ops="torch")
    ref = DeepseekReference(tmp_path)
    m = head.config.mla
    kv_b = ref.t(ref.prefix() + "self_attn.kv_b_proj").view(ref.heads, -1, m.kv_lora_rank)
    exact = (kv_b[:, : m.qk_nope_head_dim], kv_b[:, m.qk_nope_head_dim :].transpose(1, 2))
    for got, want in zip((head.mla.w_uk, head.mla.w_uv_t), exact, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2**-23, atol=0)
