"""The MTP head's shape, read from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class MTPConfig:
    """What the forward needs to know about one MTP layer and its vocabulary."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    attention_bias: bool
    num_hidden_layers: int
    num_mtp_layers: int
    dtype: torch.dtype

    @classmethod
    def from_dict(cls, raw: dict, *, family: str) -> MTPConfig:
        def need(key: str):
            if key not in raw:
                raise CheckpointError(f"config.json: missing required key {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise CheckpointError(f"config.json: rope_scaling {scaling!r} is not supported")
        rotary_dim = int(head_dim * float(raw.get("partial_rotary_factor", 1.0)))
        dtype_name = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        if dtype_name not in _DTYPES:
            raise CheckpointError(f"config.json: torch_dtype {dtype_name!r} is not supported")
        # Qwen2 (MiMo's block) always has q/k/v biases; DeepSeek/GLM say so in the config.
        bias = True if family == "mimo" else bool(raw.get("attention_bias", False))
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rotary_dim=rotary_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            attention_bias=bias,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", 1)),
            dtype=_DTYPES[dtype_name],
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
