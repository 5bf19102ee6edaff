"""Writes MTP checkpoints with random weights in the published namings.

Used to build the embedded default model and the test checkpoints: the files
are what a real MiMo or DeepSeek/GLM checkpoint holds for its MTP layer
(config.json, safetensors, optionally sharded with an index), so the real
loader reads them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _layer_tensors(
    family: str, prefix: str, cfg: dict, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    if family == "mimo":
        first = {"token_layernorm": norm(), "hidden_layernorm": norm()}
        first["input_proj"] = matrix(h, 2 * h)
        last = {"final_layernorm": norm()}
    else:
        first = {"enorm": norm(), "hnorm": norm(), "eh_proj": matrix(h, 2 * h)}
        last = {"shared_head.norm": norm()}
    block = {
        "input_layernorm": norm(),
        "self_attn.q_proj": matrix(q, h),
        "self_attn.k_proj": matrix(kv, h),
        "self_attn.v_proj": matrix(kv, h),
        "self_attn.o_proj": matrix(h, q),
        "post_attention_layernorm": norm(),
        "mlp.gate_proj": matrix(inter, h),
        "mlp.up_proj": matrix(inter, h),
        "mlp.down_proj": matrix(h, inter),
    }
    tensors = {f"{prefix}{k}.weight": v for k, v in (first | block | last).items()}
    if family == "mimo" or cfg.get("attention_bias"):
        for proj, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{prefix}self_attn.{proj}.bias"] = 0.1 * torch.randn(size, generator=gen)
    return tensors


def write_random_checkpoint(
    folder: str | Path,
    family: str = "mimo",
    *,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 96,
    vocab_size: int = 200,
    num_hidden_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shards: int = 1,
    extra_config: dict | None = None,
) -> Path:
    """Writes config.json and safetensors for one MTP layer with random weights."""
    if family not in ("mimo", "deepseek"):
        raise ValueError(f"unknown family {family!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MiMoForCausalLM" if family == "mimo" else "DeepseekV3ForCausalLM"],
        "model_type": "mimo" if family == "mimo" else "deepseek_v3",
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_hidden_layers,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    } | (extra_config or {})
    gen = torch.Generator().manual_seed(seed)
    prefix = "model.mtp_layers.0." if family == "mimo" else f"model.layers.{num_hidden_layers}."
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=gen),
        # A head scaled so that logits spread over a few units: peaked, tie-free drafts.
        "lm_head.weight": 3.0
        * torch.randn(vocab_size, hidden_size, generator=gen)
        / math.sqrt(hidden_size),
    } | _layer_tensors(family, prefix, cfg, gen)
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}

    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder
