"""Qwen3-Next, Qwen3.5 / 3.6 MoE and dense (``Qwen3NextForCausalLM``,
``Qwen3_5MoeForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``; text only):
the MTP layer is ``mtp.*``, its block ``mtp.layers.0.*``.

As vLLM's Qwen3NextMultiTokenPredictor computes it: the embedding (kept at position 0,
unlike the other families) and the target's hidden, normed by ``pre_fc_norm_embedding``
and ``pre_fc_norm_hidden``, go through ``fc`` **embedding first**; then the decoder block;
then ``mtp.norm``, whose output is both passed on and the LM head's input. Every RMSNorm
scales by ``1 + w`` (zero-centred weights). The embedding is ``model.embed_tokens``
(Qwen3.5: ``model.language_model.embed_tokens``, the config nested in ``text_config``),
the head ``lm_head``.

- Attention: GQA whose ``q_proj`` yields per head [q, gate] (``attn_output_gate``, on
  unless the config says otherwise), the attention output scaled by sigmoid(gate) before
  ``o_proj``; per-head q/k norms before RoPE, always; q/k/v biases when
  ``attention_bias`` (transformers) or ``qkv_bias`` (vLLM) says so; a partial NeoX RoPE.
  Qwen3.5's multimodal RoPE is plain RoPE for text positions (ConfigReader.rope).
- MLP: a MoE when ``num_experts`` is set and layer 0 is one (not in ``mlp_only_layers``,
  ``decoder_sparse_step`` 1): softmax over every expert, top ``num_experts_per_tok``,
  renormalized when ``norm_topk_prob``, plus a shared expert (``mlp.shared_expert``)
  scaled by sigmoid(``shared_expert_gate``); else a dense MLP (Qwen3.6-27B).
- ``mtp_use_dedicated_embeddings`` is refused.
"""

from __future__ import annotations

from typing import ClassVar

from ..config import ConfigReader, MoEConfig, MTPConfig
from ..errors import CheckpointError
from ..moe import read_top_k
from .family import Family, Layout, inputs, shared_config


class Qwen3Next(Family):
    name = "qwen3_next"
    architectures = (
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
    )
    model_type = "qwen3_next"
    embed_first = True
    mask_first_embedding = False
    pass_normed_hidden = True
    shared_expert = "shared_expert"
    synthetic_config: ClassVar[dict] = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], partial_rotary_factor=0.25, head_dim=32,
    )  # fmt: skip

    def marker(self, config: ConfigReader) -> str:
        return "mtp.fc.weight"

    def layout(self, config: ConfigReader) -> Layout:
        return Layout(
            prefix="mtp.",
            block="mtp.layers.0.",
            inputs=inputs("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
            embed=("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
            head=("lm_head.weight",),
            later_layers=r"mtp\.layers\.[1-9]\d*\.",
        )

    def read_config(self, c: ConfigReader) -> MTPConfig:
        shared = shared_config(c)
        if c.get("mtp_use_dedicated_embeddings"):
            raise CheckpointError("config.json: mtp_use_dedicated_embeddings=true is not supported")
        moe = read_moe(c)
        return MTPConfig(
            **shared,
            intermediate_size=0 if moe else c.positive("intermediate_size"),
            # transformers names it attention_bias, vLLM qkv_bias: either adds q/k/v biases.
            attention_bias=bool(c.get("attention_bias") or c.get("qkv_bias")),
            qk_norm=True,
            attn_output_gate=bool(c.get("attn_output_gate", True)),
            norm_unit_offset=True,
            moe=moe,
        )


def read_moe(c: ConfigReader) -> MoEConfig | None:
    """Qwen3-Next's routing: softmax over all experts, top k, a sigmoid-gated shared expert;
    None when the MTP layer's MLP is dense."""
    experts = c.int("num_experts", 0)
    # As vLLM builds the MTP block (layer index 0): a MoE unless 0 is an MLP-only layer.
    sparse_step = c.positive("decoder_sparse_step", 1)
    if not experts or 0 in c.get("mlp_only_layers", []) or 1 % sparse_step:
        return None
    shared = c.int("shared_expert_intermediate_size", 0)
    return MoEConfig(
        num_experts=experts,
        top_k=read_top_k(c, experts, f"num_experts={experts}"),
        intermediate_size=c.positive("moe_intermediate_size"),
        scoring="softmax",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )
