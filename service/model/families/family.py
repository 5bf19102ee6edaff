"""What a family of published MTP checkpoints is, as the loader and the forward need it.

A family says how its checkpoints are recognised, which config.json keys it honours or
refuses by name (read into an MTPConfig), where its MTP layer's tensors are, and how its
layer is wired where the families differ: the concatenation feeding the input projection,
the embedding at position 0, the hidden passed on. The decoder block between its input
and its final norm is named by layer.py and computed by mtp_head.py, over the blocks
every family shares (GQA or MLA attention, a dense MLP or a MoE, RMSNorm, RoPE).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar

from ..config import ConfigReader, MTPConfig
from ..errors import CheckpointError
from ..layer import block_names
from ..mla import read_mla


@dataclass(frozen=True)
class Layout:
    """Where one checkpoint keeps its MTP layer, by tensor name."""

    prefix: str  # every tensor of the MTP layer starts with it
    block: str  # the decoder block's tensors (attention, MLP) start with it
    inputs: dict[str, str]  # norm_embed, norm_hidden, input_proj, final_norm
    embed: tuple[str, ...]  # where the embedding may be, first found wins
    head: tuple[str, ...]  # where the LM head may be, first found wins (else a tied embedding)
    later_layers: str = ""  # a pattern of the names under prefix that are later MTP layers'


def inputs(prefix: str, norm_embed: str, norm_hidden: str, input_proj: str, final_norm: str):
    """Layout.inputs: the modules around the block, each a weight under `prefix`."""
    modules = dict(
        norm_embed=norm_embed, norm_hidden=norm_hidden, input_proj=input_proj, final_norm=final_norm
    )
    return {key: f"{prefix}{module}.weight" for key, module in modules.items()}


class Family:
    """One family of published MTP checkpoints; a module of this package each (FAMILIES)."""

    name: ClassVar[str]  # the model family GetInfo reports
    architectures: ClassVar[tuple[str, ...]]  # config.json's architectures, as published
    model_type: ClassVar[str]
    # The wiring where families differ:
    embed_first: ClassVar[bool]  # input_proj over cat[embedding, hidden] (else hidden first)
    mask_first_embedding: ClassVar[bool]  # the embedding is zeroed in the row at position 0
    pass_normed_hidden: ClassVar[bool]  # the final norm's output is passed on (else its input)
    shared_expert: ClassVar[str] = ""  # a MoE's shared expert: its module under mlp.
    # The matrices a forward multiplies as they are stored, so that an FP8 one stays FP8 (with
    # its scales) for the kernels that read it so: not kv_b_proj, which MLA splits and
    # absorbs at load.
    fp8_matrices: ClassVar[frozenset[str]] = frozenset({
        "input_proj", "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
        "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj", "shared_gate_proj",
        "shared_up_proj", "shared_down_proj",
    })  # fmt: skip
    # config.json keys of the family's small random checkpoints (synthetic.py), past the
    # sizes every family's share.
    synthetic_config: ClassVar[dict] = {}

    def marker(self, config: ConfigReader) -> str:
        """What tells a checkpoint of this family: the tensor `recognises` looks for."""
        raise NotImplementedError

    def recognises(self, config: ConfigReader, names: Collection[str]) -> bool:
        """Whether the checkpoint (its config and tensor names) is one of this family's: by
        default, whether it holds the marker."""
        return self.marker(config) in names

    def layout(self, config: ConfigReader) -> Layout:
        raise NotImplementedError

    def read_config(self, c: ConfigReader) -> MTPConfig:
        """The family's keys as an MTPConfig; a key whose value is not implemented is refused."""
        raise NotImplementedError

    def tensor_names(self, layout: Layout, c: MTPConfig) -> dict[str, str]:
        """Family-neutral key -> published name of every tensor the layer reads, but the
        embedding, the head (Layout.embed, Layout.head) and the routed experts."""
        return layout.inputs | block_names(layout.block, c, self.shared_expert)


def shared_config(c: ConfigReader, mla: bool = False) -> dict:
    """MTPConfig's arguments that every family reads alike, after the keys none honours
    (ConfigReader.refuse_common): sizes, RoPE, dtype. `mla`: the attention is DeepSeek's
    latent attention, whose q/k head and rotated part its own keys size (mla.py)."""
    c.refuse_common()
    hidden, heads = c.positive("hidden_size"), c.positive("num_attention_heads")
    latent = read_mla(c) if mla else None
    if latent:  # RoPE rotates the rope part of each q/k head only
        head_dim, rope_dim = latent.qk_head_dim, latent.qk_rope_head_dim
        rope_keys = "qk_rope_head_dim"
    else:
        head_dim, rope_keys = c.head_dim(hidden, heads)
        rope_dim = head_dim
    theta, rotary, yarn = c.rope(rope_dim, rope_keys, yarn_ok=mla)
    shared = dict(
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
    if latent:  # vLLM's DeepSeek MLA rotates interleaved pairs (is_neox_style=False)
        shared |= dict(mla=latent, yarn=yarn, rope_interleaved=True)
    return shared


def _kv_heads(c: ConfigReader, heads: int) -> int:
    """num_key_value_heads: each KV head serves an equal share of the query heads (GQA)."""
    kv_heads = c.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    return kv_heads
