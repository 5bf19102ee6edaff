"""DeepSeek-V3 / R1 / V3.1 (``DeepseekV3ForCausalLM``): the MTP layer is
``model.layers.{num_hidden_layers}.*``.

As vLLM's DeepSeekMultiTokenPredictorLayer computes it: the embedding (zeroed at
position 0) and the target's hidden, normed by ``enorm`` and ``hnorm``, go through
``eh_proj`` **embedding first**; then the decoder block; the block's output is passed on,
and ``shared_head.norm`` of it feeds the LM head (``shared_head.head``, else ``lm_head``,
else the embedding when ``tie_word_embeddings``). The embedding is the layer's own copy
(``embed_tokens``) where the checkpoint keeps one, else ``model.embed_tokens``.

- Attention: multi-head latent attention (mla.py: an interleaved YaRN RoPE, a latent
  cache) when config.json has ``kv_lora_rank``; else GQA with optional q/k/v biases
  (``attention_bias``) and q/k norms (``use_qk_norm``), neither of which MLA has.
- MLP: a MoE when ``n_routed_experts`` is set and the layer index reaches
  ``first_k_dense_replace``, routed as vLLM's ``grouped_topk`` (moe.py: sigmoid scores,
  ``e_score_correction_bias``, ``n_group`` groups of which ``topk_group`` are kept,
  ``norm_topk_prob``, ``routed_scaling_factor``) plus ``n_shared_experts`` shared
  experts (``mlp.shared_experts``); else a dense MLP.
- FP8: the published checkpoints are block-scaled FP8 (``quantization_config`` fp8 e4m3
  with a ``weight_block_size``): every matrix stays FP8 beside its ``weight_scale_inv``
  (Family.fp8_matrices) but ``kv_b_proj``, which MLA absorbs at load.
"""

from __future__ import annotations

from ..config import ConfigReader, MoEConfig, MTPConfig
from ..errors import CheckpointError
from ..moe import read_top_k
from .family import Family, Layout, inputs, shared_config


class DeepseekV3(Family):
    name = "deepseek"
    architectures = ("DeepseekV3ForCausalLM",)
    model_type = "deepseek_v3"
    embed_first = True
    mask_first_embedding = True
    pass_normed_hidden = False
    shared_expert = "shared_experts"

    def marker(self, config: ConfigReader) -> str:
        return f"model.layers.{config.get('num_hidden_layers')}.eh_proj.weight"

    def layout(self, config: ConfigReader) -> Layout:
        p = f"model.layers.{config.get('num_hidden_layers')}."
        return Layout(
            prefix=p,
            block=p,
            inputs=inputs(p, "enorm", "hnorm", "eh_proj", "shared_head.norm"),
            # GLM-4.6 keeps no copies in the MTP layer: the model's own are used.
            embed=(f"{p}embed_tokens.weight", "model.embed_tokens.weight"),
            head=(f"{p}shared_head.head.weight", "lm_head.weight"),
        )

    def read_config(self, c: ConfigReader) -> MTPConfig:
        mla = "kv_lora_rank" in c
        shared = shared_config(c, mla=mla)
        if mla:  # vLLM's DeepseekV2MLAAttention has neither
            c.refuse_unless("attention_bias", (False,), "MLA has no q/k/v biases")
            c.refuse_unless("use_qk_norm", (False,), "MLA norms its latent, not q and k")
        return self.layer_config(c, shared)

    def layer_config(self, c: ConfigReader, shared: dict) -> MTPConfig:
        """The layer's config: the keys every family shares (`shared`, shared_config'),
        the attention's options and the MLP."""
        moe = read_moe(c)
        return MTPConfig(
            **shared,
            intermediate_size=0 if moe else c.positive("intermediate_size"),
            attention_bias=bool(c.get("attention_bias", False)),
            qk_norm=bool(c.get("use_qk_norm", False)),
            moe=moe,
        )


def read_moe(c: ConfigReader) -> MoEConfig | None:
    """DeepSeek-V3's (and GLM-4.5's) routing: sigmoid scores plus a correction bias, top k
    within the best groups, shared experts; None when the MTP layer's MLP is dense."""
    # The MTP layer sits at index num_hidden_layers: a MoE layer when it is past
    # first_k_dense_replace, as in every published config.
    if "n_routed_experts" not in c or c.int("num_hidden_layers") < c.int(
        "first_k_dense_replace", 0
    ):
        return None
    c.refuse_unless("moe_layer_freq", (1,), "the MTP layer would be dense")
    c.refuse_unless("scoring_func", ("sigmoid",), "GLM / DeepSeek-V3 routing only")
    c.refuse_unless("topk_method", ("noaux_tc",), "GLM / DeepSeek-V3 routing only")
    inter = c.positive("moe_intermediate_size")
    groups = c.positive("n_group", 1)
    experts = c.positive("n_routed_experts")
    if experts % groups:
        raise CheckpointError(
            f"config.json: n_group={groups} does not divide n_routed_experts={experts}"
        )
    topk_group = c.positive("topk_group", 1)
    if topk_group > groups:
        raise CheckpointError(f"config.json: topk_group={topk_group} exceeds n_group={groups}")
    # A row chooses among the experts of its topk_group best groups.
    choosable = topk_group * experts // groups
    among = f"n_routed_experts={experts}"
    if groups > 1:
        among = f"the {choosable} experts of topk_group={topk_group} of n_group={groups} groups"
    return MoEConfig(
        num_experts=experts,
        top_k=read_top_k(c, choosable, among),
        intermediate_size=inter,
        scoring="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        n_group=groups,
        topk_group=topk_group,
        shared_intermediate_size=inter * c.int("n_shared_experts", 0),
        shared_expert_gate=False,
    )
