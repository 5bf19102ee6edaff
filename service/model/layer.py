"""An MTP layer's tensors by family-neutral key: the published names of its decoder block's,
and the shape config.json implies for every key the loader reads.

Every family's block is a pre-norm decoder layer, named as transformers names one under
the block's prefix: ``input_layernorm``, the attention (``self_attn.``: GQA with optional
q/k/v biases, per-head q/k norms and an output gate, or DeepSeek's MLA, mla.py),
``post_attention_layernorm`` and the MLP (``mlp.``: a dense SwiGLU, or a MoE, moe.py).
What stands around the block (the input norms and projection, the final norm, the
embedding and the head) each family names itself (families/).
"""

from __future__ import annotations

from .config import MTPConfig
from .mla import mla_names, mla_shapes
from .moe import moe_names, moe_shapes

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def block_names(block: str, c: MTPConfig, shared_expert: str = "") -> dict[str, str]:
    """Key -> published name of every tensor of the block under `block` (its prefix), but
    the routed experts' (moe.expert_names); `shared_expert` names a MoE's shared expert."""
    attention, mlp = f"{block}self_attn.", f"{block}mlp."
    names = {
        "input_layernorm": f"{block}input_layernorm.weight",
        "post_attention_layernorm": f"{block}post_attention_layernorm.weight",
    }
    if c.mla is not None:
        names |= mla_names(attention, c.mla)
    else:
        names |= {p: f"{attention}{p}.weight" for p in (*_PROJECTIONS, "o_proj")}
    if c.attention_bias:
        names |= {f"{p}_bias": f"{attention}{p}.bias" for p in _PROJECTIONS}
    if c.qk_norm:
        names |= {n: f"{attention}{n}.weight" for n in ("q_norm", "k_norm")}
    if c.moe is not None:
        return names | moe_names(mlp, c.moe, shared_expert)
    return names | {p: f"{mlp}{p}.weight" for p in _DENSE_MLP}


def tensor_shapes(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every key a loader may read, from the config."""
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    # With an output gate, q_proj yields a gate row for every query row.
    q_rows = 2 * c.q_size if c.attn_output_gate else c.q_size
    shapes = {
        "embed": (v, h),
        "lm_head": (v, h),
        "norm_embed": (h,),
        "norm_hidden": (h,),
        "input_proj": (h, 2 * h),
        "final_norm": (h,),
        "input_layernorm": (h,),
        "q_proj": (q_rows, h),
        "k_proj": (c.kv_size, h),
        "v_proj": (c.kv_size, h),
        "q_proj_bias": (q_rows,),
        "k_proj_bias": (c.kv_size,),
        "v_proj_bias": (c.kv_size,),
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
        "o_proj": (h, c.q_size),
        "post_attention_layernorm": (h,),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    if c.mla is not None:
        shapes |= mla_shapes(c)
    if c.moe is not None:
        shapes |= moe_shapes(c)
    return shapes
