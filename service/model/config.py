"""The MTP layer's shape and arithmetic, read from a checkpoint's config.json.

Every key that changes the computation is either honoured or refused by name:
a checkpoint is never read silently wrong. Both spellings transformers has
written are read: ``rope_theta`` / ``rope_scaling`` / ``torch_dtype`` (4.x) and
``rope_parameters`` / ``dtype`` (5.x); a multimodal config's ``text_config`` is
the language model's. Which keys a family reads is its business (families/);
this module holds the result and the checks every family shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .rope import Yarn

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: a router picks top_k of num_experts per row."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: str  # "softmax" (Qwen) or "sigmoid" (GLM / DeepSeek, with a correction bias)
    norm_topk_prob: bool  # renormalize the top-k weights to sum to one
    routed_scaling_factor: float
    n_group: int  # experts fall in n_group groups; only topk_group groups may be picked
    topk_group: int
    shared_intermediate_size: int  # 0: no shared expert
    shared_expert_gate: bool  # Qwen: the shared expert is scaled by sigmoid(x @ w)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: K and V rebuilt from a cached latent."""

    q_lora_rank: int  # 0: q is projected directly (q_proj), else through q_a / q_b
    kv_lora_rank: int  # R: the cached latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # P: the rotated part of q and k, cached beside the latent
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MTPConfig:
    """What the forward needs to know about one MTP layer and its vocabulary."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # of the dense MLP; 0 when the layer's MLP is a MoE
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    attention_bias: bool
    num_hidden_layers: int
    num_mtp_layers: int
    dtype: torch.dtype
    qk_norm: bool = False  # RMSNorm of each head of q and k before RoPE
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also yields a sigmoid gate per head
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + w): zero-centred weights
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # then head_dim is the q/k head dim, rotary_dim P
    yarn: Yarn | None = None
    rope_interleaved: bool = False  # rotate pairs (x[2i], x[2i+1]) (DeepSeek), else halves

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


class ConfigReader:
    """config.json's keys, each read by name so that an error names the key."""

    def __init__(self, raw: dict) -> None:
        if isinstance(raw.get("text_config"), dict):
            raw = raw | raw["text_config"]  # a multimodal model: its language model's keys
        self.raw = raw

    def __contains__(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def need(self, key: str):
        if key not in self:
            raise CheckpointError(f"config.json: missing required key {key!r}")
        return self.raw[key]

    def get(self, key: str, default=None):
        value = self.raw.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        return int(self.need(key) if default is None else self.get(key, default))

    def positive(self, key: str, default: int | None = None) -> int:
        """A size or a count: an integer of at least 1."""
        value = self.int(key, default)
        if value < 1:
            raise CheckpointError(f"config.json: {key}={value} is not a positive integer")
        return value

    def head_dim(self, hidden_size: int, heads: int) -> tuple[int, str]:
        """(the attention head's width, the key(s) it comes from): head_dim, or
        hidden_size / num_attention_heads where it is not given."""
        if "head_dim" in self:
            return self.positive("head_dim"), "head_dim"
        if hidden_size % heads:
            raise CheckpointError(
                f"config.json: hidden_size={hidden_size} is not divisible by "
                f"num_attention_heads={heads}, and no head_dim is given"
            )
        return hidden_size // heads, "hidden_size / num_attention_heads"

    def refuse_unless(self, key: str, allowed: tuple, why: str) -> None:
        """A key whose other values change the computation in ways not implemented."""
        if key in self and self.raw[key] not in allowed:
            raise CheckpointError(f"config.json: {key}={self.raw[key]!r} is not supported ({why})")

    def rope(
        self, head_dim: int, head_dim_keys: str, yarn_ok: bool = False
    ) -> tuple[float, int, Yarn | None]:
        """(theta, rotary dims, YaRN scaling or None), from either spelling; `head_dim`:
        the dims RoPE may rotate, read from `head_dim_keys` (named where it is wrong).

        Plain RoPE everywhere; YaRN where the family implements it (`yarn_ok`).
        Qwen3.5's multimodal RoPE (mrope_section) rotates text tokens, whose three
        position streams are equal, exactly as plain RoPE does: a verifier sends
        text positions, so it is read as plain RoPE.
        """
        params = self.get("rope_parameters") or {}
        scaling = self.get("rope_scaling") or {}
        yarn = None
        for name, table in (("rope_parameters", params), ("rope_scaling", scaling)):
            kind = table.get("rope_type", table.get("type", "default"))
            if kind == "yarn" and yarn_ok:
                yarn = Yarn(
                    factor=float(table["factor"]),
                    original_max_position_embeddings=int(table["original_max_position_embeddings"]),
                    beta_fast=float(table.get("beta_fast", 32)),
                    beta_slow=float(table.get("beta_slow", 1)),
                    mscale=float(table.get("mscale", 1)),
                    mscale_all_dim=float(table.get("mscale_all_dim", 0)),
                )
            elif kind not in ("default", None):
                raise CheckpointError(
                    f"config.json: {name} type {kind!r} is not supported (plain RoPE only)"
                )
        thetas = {v for v in (self.get("rope_theta"), params.get("rope_theta")) if v is not None}
        if len(thetas) != 1:
            raise CheckpointError(
                "config.json: missing required key 'rope_theta' (or rope_parameters.rope_theta)"
                if not thetas
                else f"config.json: rope_theta and rope_parameters.rope_theta disagree {thetas}"
            )
        return float(thetas.pop()), self._rotary_dims(head_dim, head_dim_keys), yarn

    def _rotary_dims(self, head_dim: int, head_dim_keys: str) -> int:
        """The dims RoPE rotates: an even number, 2 to head_dim (it rotates pairs)."""
        params = self.get("rope_parameters") or {}
        key = "rope_parameters.partial_rotary_factor"
        if "partial_rotary_factor" not in params:
            key = "partial_rotary_factor" if "partial_rotary_factor" in self else None
        if key is None:
            if head_dim % 2:
                raise CheckpointError(
                    f"config.json: {head_dim_keys}={head_dim} is odd (RoPE rotates pairs of dims)"
                )
            return head_dim
        factor = float(params.get("partial_rotary_factor", self.get("partial_rotary_factor")))
        rotary = int(head_dim * factor)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise CheckpointError(
                f"config.json: {key}={factor} of {head_dim_keys}={head_dim} rotates {rotary} "
                f"dims: RoPE needs an even number from 2 to {head_dim}"
            )
        return rotary

    def dtype(self) -> torch.dtype:
        name = str(self.get("torch_dtype") or self.get("dtype") or "bfloat16")
        if name not in _DTYPES:
            raise CheckpointError(f"config.json: dtype {name!r} is not supported")
        return _DTYPES[name]

    def fp8_block(self) -> tuple[int, int] | None:
        """The block of DeepSeek's FP8 weights (e4m3, one scale per block), else None.

        Any other quantization is refused: weights are never read without their scales.
        """
        q = self.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method") if isinstance(q, dict) else q
        block = q.get("weight_block_size") if isinstance(q, dict) else None
        fmt = q.get("fmt", "e4m3") if isinstance(q, dict) else None
        if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
            raise CheckpointError(
                f"config.json: quantization_config ({method!r}) is not supported: only "
                "fp8 e4m3 with a weight_block_size; weights are never read without their scales"
            )
        return int(block[0]), int(block[1])

    def refuse_common(self) -> None:
        """Keys that no family here honours other than at their plain value."""
        if "quantization_config" in self:
            self.fp8_block()
        self.refuse_unless("hidden_act", ("silu",), "the MLP is SwiGLU")
        if self.get("use_sliding_window"):
            raise CheckpointError("config.json: use_sliding_window is not supported")


def read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw
