"""The published MTP families: where each keeps its MTP layer and what each computes.

- MiMo-7B (``model.mtp_layers.0.*``): Qwen2 attention (q/k/v biases), dense MLP;
  ``input_proj`` over cat[hidden, embedding]; the final norm's output is both the
  logits' input and the hidden passed on.
- GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``) and DeepSeek-V3's layout
  (``model.layers.{num_hidden_layers}.*``): ``eh_proj`` over cat[embedding, hidden];
  ``shared_head.norm`` feeds the logits only, the pre-norm hidden is passed on; GQA
  attention with optional biases, q/k norms and partial rotary; a sigmoid-scored,
  group-limited MoE with a correction bias and shared experts (or a dense MLP).
  DeepSeek-V3 (``kv_lora_rank`` in its config) attends by MLA over a latent cache,
  with interleaved YaRN RoPE (mla.py, rope.py).
- Qwen3-Next / Qwen3.5 / Qwen3.6 (``mtp.*``): ``fc`` over cat[embedding, hidden];
  every RMSNorm zero-centred (scale 1 + w); q/k norms and a sigmoid output gate
  per head from a q_proj twice as wide; a softmax-routed MoE with a gated shared
  expert (or a dense MLP); ``mtp.norm``'s output is passed on and feeds the logits; the
  embedding at position 0 is kept (the others zero it, as vLLM does per family).

Each family reads its own config keys into an MTPConfig and names its tensors;
checkpoint.py reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigReader, MLAConfig, MoEConfig, MTPConfig
from .errors import CheckpointError


@dataclass(frozen=True)
class Layout:
    """Where one family's MTP layer lives and how its inputs and output are wired."""

    family: str
    prefix: str  # every tensor of the MTP layer starts with it
    block: str  # the decoder block's tensors (attention, MLP) start with it
    inputs: dict[str, str]  # norm_embed, norm_hidden, input_proj, final_norm
    embed_first: bool  # order of the concat feeding input_proj
    pass_normed_hidden: bool  # the final norm's output is passed on (else the pre-norm)
    mask_first_embedding: bool  # the embedding is zeroed at position 0
    embed: tuple[str, ...]  # where the embedding may be, first found wins
    head: tuple[str, ...]
    shared_expert: str  # the shared expert's module name under mlp.


def layout_of(raw: dict, names) -> Layout:
    """The family whose MTP layer `names` (a set of tensor names) holds."""
    config = ConfigReader(raw)
    layers = config.get("num_hidden_layers")
    if any(n.startswith("model.mtp_layers.") for n in names):
        p = "model.mtp_layers.0."
        return Layout(
            family="mimo",
            prefix=p,
            block=p,
            inputs=_weights(
                p, "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"
            ),
            embed_first=False,
            pass_normed_hidden=True,
            mask_first_embedding=True,
            embed=(p + "embed_tokens.weight", "model.embed_tokens.weight"),
            head=("lm_head.weight",),
            shared_expert="",
        )
    if layers is not None and f"model.layers.{layers}.eh_proj.weight" in names:
        p = f"model.layers.{layers}."
        glm = str(config.get("model_type", "")).startswith("glm")
        return Layout(
            family="glm4_moe" if glm else "deepseek",
            prefix=p,
            block=p,
            inputs=_weights(p, "enorm", "hnorm", "eh_proj", "shared_head.norm"),
            embed_first=True,
            pass_normed_hidden=False,
            mask_first_embedding=True,
            # GLM-4.6 keeps no copies in the MTP layer: the model's own are used.
            embed=(p + "embed_tokens.weight", "model.embed_tokens.weight"),
            head=(p + "shared_head.head.weight", "lm_head.weight"),
            shared_expert="shared_experts",
        )
    if "mtp.fc.weight" in names:
        return Layout(
            family="qwen3_next",
            prefix="mtp.",
            block="mtp.layers.0.",
            inputs=_weights("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
            embed_first=True,
            pass_normed_hidden=True,
            mask_first_embedding=False,
            embed=("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
            head=("lm_head.weight",),
            shared_expert="shared_expert",
        )
    raise CheckpointError(
        f"no MTP layer found (looked for model.mtp_layers.0.*, "
        f"model.layers.{layers}.eh_proj.weight and mtp.fc.weight)"
    )


def _weights(prefix: str, *modules: str) -> dict[str, str]:
    keys = ("norm_embed", "norm_hidden", "input_proj", "final_norm")
    return {k: f"{prefix}{m}.weight" for k, m in zip(keys, modules, strict=True)}


def read_config(raw: dict, family: str) -> MTPConfig:
    """The family's keys as an MTPConfig; a key whose value is not implemented is refused."""
    c = ConfigReader(raw)
    c.refuse_common()
    hidden, heads = c.positive("hidden_size"), c.positive("num_attention_heads")
    mla = _mla(c) if family == "deepseek" else None
    if mla:  # RoPE rotates the rope part of each q/k head only
        head_dim, rope_dim, rope_keys = mla.qk_head_dim, mla.qk_rope_head_dim, "qk_rope_head_dim"
    else:
        head_dim, rope_keys = c.head_dim(hidden, heads)
        rope_dim = head_dim
    theta, rotary, yarn = c.rope(rope_dim, rope_keys, yarn_ok=bool(mla))
    common = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads if mla else _kv_heads(c, heads),
        head_dim=head_dim,
        vocab_size=c.positive("vocab_size"),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=rotary,
        max_position_embeddings=c.positive("max_position_embeddings", 32768),
        num_hidden_layers=c.int("num_hidden_layers"),
        num_mtp_layers=c.int("num_nextn_predict_layers", c.int("mtp_num_hidden_layers", 1)),
        dtype=c.dtype(),
    )
    if family == "mimo":  # Qwen2's block: q/k/v biases always, dense MLP
        return MTPConfig(
            **common, intermediate_size=c.positive("intermediate_size"), attention_bias=True
        )
    if family == "qwen3_next":
        if c.get("mtp_use_dedicated_embeddings"):
            raise CheckpointError("config.json: mtp_use_dedicated_embeddings=true is not supported")
        moe = _qwen_moe(c)
        return MTPConfig(
            **common,
            intermediate_size=0 if moe else c.positive("intermediate_size"),
            # transformers names it attention_bias, vLLM qkv_bias: either adds q/k/v biases.
            attention_bias=bool(c.get("attention_bias") or c.get("qkv_bias")),
            qk_norm=True,
            attn_output_gate=bool(c.get("attn_output_gate", True)),
            norm_unit_offset=True,
            moe=moe,
        )
    moe = _deepseek_moe(c)
    return MTPConfig(
        **common,
        intermediate_size=0 if moe else c.positive("intermediate_size"),
        attention_bias=bool(c.get("attention_bias", False)),
        qk_norm=bool(c.get("use_qk_norm", False)),
        moe=moe,
        mla=mla,
        yarn=yarn,
        rope_interleaved=mla is not None,  # vLLM's DeepSeek MLA: is_neox_style=False
    )


def _kv_heads(c: ConfigReader, heads: int) -> int:
    """num_key_value_heads: each KV head serves an equal share of the query heads (GQA)."""
    kv_heads = c.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    return kv_heads


def _top_k(c: ConfigReader, choosable: int, among: str) -> int:
    """num_experts_per_tok: at most the experts a row may choose from."""
    top_k = c.positive("num_experts_per_tok")
    if top_k > choosable:
        raise CheckpointError(f"config.json: num_experts_per_tok={top_k} exceeds {among}")
    return top_k


def _mla(c: ConfigReader) -> MLAConfig | None:
    """DeepSeek-V3's attention, when the config describes it (kv_lora_rank)."""
    if "kv_lora_rank" not in c:
        return None
    return MLAConfig(
        q_lora_rank=c.int("q_lora_rank", 0),
        kv_lora_rank=c.positive("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim"),
        qk_rope_head_dim=c.positive("qk_rope_head_dim"),
        v_head_dim=c.positive("v_head_dim"),
    )


def _deepseek_moe(c: ConfigReader) -> MoEConfig | None:
    """GLM-4.5 / DeepSeek-V3 routing: sigmoid scores + correction bias, group-limited top-k."""
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
    top_k = _top_k(c, choosable, among)
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=inter,
        scoring="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        n_group=groups,
        topk_group=topk_group,
        shared_intermediate_size=inter * c.int("n_shared_experts", 0),
        shared_expert_gate=False,
    )


def _qwen_moe(c: ConfigReader) -> MoEConfig | None:
    """Qwen3-Next routing: softmax over all experts, top-k, a sigmoid-gated shared expert."""
    experts = c.int("num_experts", 0)
    # As vLLM builds the MTP block (layer index 0): a MoE unless 0 is an MLP-only layer.
    sparse_step = c.positive("decoder_sparse_step", 1)
    if not experts or 0 in c.get("mlp_only_layers", []) or 1 % sparse_step:
        return None
    shared = c.int("shared_expert_intermediate_size", 0)
    return MoEConfig(
        num_experts=experts,
        top_k=_top_k(c, experts, f"num_experts={experts}"),
        intermediate_size=c.positive("moe_intermediate_size"),
        scoring="softmax",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )
