"""GLM-4.5 / 4.5-Air / 4.6 (``Glm4MoeForCausalLM``): DeepSeek-V3's MTP layer without MLA.

vLLM's Glm4MoeMTP is its DeepSeek MTP: the same layout (``model.layers.{num_hidden_layers}.*``,
``enorm``, ``hnorm``, ``eh_proj`` embedding first, ``shared_head``), the same sigmoid,
group-limited MoE with shared experts, the same wiring. Its attention is GQA with q/k/v
biases (``attention_bias``), per-head q/k norms before RoPE (``use_qk_norm``) and a
partial NeoX RoPE (``partial_rotary_factor``); a ``kv_lora_rank`` is not read (its MLA
tensors, if any, would be refused as unused). GLM-4.5 and -Air keep the layer's own
``embed_tokens`` and ``shared_head.head``; GLM-4.6 uses the model's.

Recognised as DeepSeek-V3's layout with a GLM ``model_type``: it comes before DeepSeek-V3
in FAMILIES.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

from ..config import ConfigReader, MTPConfig
from .deepseek_v3 import DeepseekV3
from .family import shared_config


class Glm4Moe(DeepseekV3):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_type = "glm4_moe"
    synthetic_config: ClassVar[dict] = dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        head_dim=32,
    )  # fmt: skip

    def recognises(self, config: ConfigReader, names: Collection[str]) -> bool:
        glm = str(config.get("model_type", "")).startswith("glm")
        return glm and super().recognises(config, names)

    def read_config(self, c: ConfigReader) -> MTPConfig:
        return self.layer_config(c, shared_config(c))
