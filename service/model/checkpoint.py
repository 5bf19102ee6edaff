"""Reads an MTP head out of a checkpoint folder, in either published naming.

A folder holds config.json and safetensors files (one file, or shards listed by
model.safetensors.index.json). Only the tensors the MTP head needs are read, so a
full target checkpoint can be pointed at directly. Two namings are understood:

- MiMo-7B: ``model.mtp_layers.0.*``; input norms ``token_layernorm`` /
  ``hidden_layernorm``; ``input_proj`` over cat[hidden, embedding];
  ``final_layernorm`` output is both the logits' input and the hidden passed on.
- DeepSeek-V3 / GLM-4.5: ``model.layers.{num_hidden_layers}.*``; ``enorm`` /
  ``hnorm``; ``eh_proj`` over cat[embedding, hidden]; ``shared_head.norm`` is
  applied for the logits only; head ``shared_head.head`` or ``lm_head``.

With several MTP layers the first is used and chained K times, as vLLM's MTP
proposer does. Every CheckpointError raised here begins with the path of the file
(or folder) at fault: `mtpdraft serve` prints it as one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import MTPConfig, read_config_json
from .errors import CheckpointError


@dataclass
class MTPWeights:
    """One MTP layer's tensors under family-neutral names, in the checkpoint's layout."""

    family: str
    config: MTPConfig
    embed_first: bool  # order of the concat feeding input_proj
    pass_normed_hidden: bool  # MiMo passes the final-norm output on; DeepSeek the pre-norm
    tensors: dict[str, torch.Tensor]


def _mimo_names(prefix: str) -> dict[str, str]:
    return {
        "norm_embed": f"{prefix}token_layernorm.weight",
        "norm_hidden": f"{prefix}hidden_layernorm.weight",
        "input_proj": f"{prefix}input_proj.weight",
        "final_norm": f"{prefix}final_layernorm.weight",
    }


def _deepseek_names(prefix: str) -> dict[str, str]:
    return {
        "norm_embed": f"{prefix}enorm.weight",
        "norm_hidden": f"{prefix}hnorm.weight",
        "input_proj": f"{prefix}eh_proj.weight",
        "final_norm": f"{prefix}shared_head.norm.weight",
    }


def _block_names(prefix: str, bias: bool) -> dict[str, str]:
    names = {
        "input_layernorm": f"{prefix}input_layernorm.weight",
        "q_proj": f"{prefix}self_attn.q_proj.weight",
        "k_proj": f"{prefix}self_attn.k_proj.weight",
        "v_proj": f"{prefix}self_attn.v_proj.weight",
        "o_proj": f"{prefix}self_attn.o_proj.weight",
        "post_attention_layernorm": f"{prefix}post_attention_layernorm.weight",
        "gate_proj": f"{prefix}mlp.gate_proj.weight",
        "up_proj": f"{prefix}mlp.up_proj.weight",
        "down_proj": f"{prefix}mlp.down_proj.weight",
    }
    if bias:
        for proj in ("q_proj", "k_proj", "v_proj"):
            names[f"{proj}_bias"] = f"{prefix}self_attn.{proj}.bias"
    return names


def _expected_shapes(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    return {
        "embed": (v, h),
        "lm_head": (v, h),
        "norm_embed": (h,),
        "norm_hidden": (h,),
        "input_proj": (h, 2 * h),
        "final_norm": (h,),
        "input_layernorm": (h,),
        "q_proj": (c.q_size, h),
        "k_proj": (c.kv_size, h),
        "v_proj": (c.kv_size, h),
        "q_proj_bias": (c.q_size,),
        "k_proj_bias": (c.kv_size,),
        "v_proj_bias": (c.kv_size,),
        "o_proj": (h, c.q_size),
        "post_attention_layernorm": (h,),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


@contextmanager
def _open(file: Path) -> Iterator:
    """safe_open, its errors (a truncated or corrupt file, an unreadable one) named by file."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


class _TensorIndex:
    """Maps tensor names to the safetensors file that holds them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {name: folder / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a weight map ({exc!r})") from exc
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files")
            self.where = {}
            for file in files:
                with _open(file) as f:
                    self.where.update(dict.fromkeys(f.keys(), file))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def first_present(self, *names: str) -> str | None:
        return next((n for n in names if n in self), None)

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.where)

    def read(self, name: str) -> torch.Tensor:
        file = self.where[name]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the index puts {name} in this shard)")
        with _open(file) as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise CheckpointError(f"{file}: no {name}, which the index puts there")
            return f.get_tensor(name)


def _detect_family(raw: dict, index: _TensorIndex) -> tuple[str, str]:
    """Returns (family, prefix of the first MTP layer's tensors)."""
    if index.has_prefix("model.mtp_layers."):
        return "mimo", "model.mtp_layers.0."
    layers = raw.get("num_hidden_layers")
    if layers is not None and f"model.layers.{layers}.eh_proj.weight" in index:
        return "deepseek", f"model.layers.{layers}."
    if "mtp.fc.weight" in index:
        raise CheckpointError(
            f"{index.folder}: Qwen3-Next MTP checkpoints (mtp.*) are not supported yet"
        )
    raise CheckpointError(
        f"{index.folder}: no MTP layer found (looked for model.mtp_layers.0.* and "
        f"model.layers.{layers}.eh_proj.weight)"
    )


def _refuse_unsupported(prefix: str, raw: dict, index: _TensorIndex) -> None:
    mla = (f"{prefix}self_attn.q_a_proj.weight", f"{prefix}self_attn.kv_a_proj_with_mqa.weight")
    if name := index.first_present(*mla):
        raise CheckpointError(
            f"{index.where[name]}: {prefix}self_attn: MLA attention is not supported (GQA only)"
        )
    if index.has_prefix(f"{prefix}mlp.experts.") or f"{prefix}mlp.gate.weight" in index:
        raise CheckpointError(
            f"{index.folder}: {prefix}mlp: MoE MLPs are not supported (dense MLP only)"
        )
    if raw.get("use_qk_norm"):
        raise CheckpointError(f"{index.folder / 'config.json'}: use_qk_norm is not supported")


def _read_config(folder: Path) -> dict:
    """config.json as a dict, every error naming the file."""
    raw = read_config_json(folder)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{folder / 'config.json'}: not a JSON object")
    return raw


def _config(folder: Path, raw: dict, family: str) -> MTPConfig:
    """The MTP shape of config.json; a missing key or a value of the wrong type names it."""
    path = folder / "config.json"
    try:
        return MTPConfig.from_dict(raw, family=family)
    except CheckpointError as exc:  # its messages begin "config.json: "
        raise CheckpointError(f"{path}: {str(exc).removeprefix('config.json: ')}") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: a value of the wrong type ({exc})") from exc


def load_mtp_weights(folder: str | Path) -> MTPWeights:
    """Reads and checks the first MTP layer, its embedding and its head."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    raw = _read_config(folder)
    index = _TensorIndex(folder)
    family, prefix = _detect_family(raw, index)
    config = _config(folder, raw, family)
    _refuse_unsupported(prefix, raw, index)

    names = _mimo_names(prefix) if family == "mimo" else _deepseek_names(prefix)
    names |= _block_names(prefix, config.attention_bias)
    embed = index.first_present(f"{prefix}embed_tokens.weight", "model.embed_tokens.weight")
    head = index.first_present(f"{prefix}shared_head.head.weight", "lm_head.weight")
    if head is None and raw.get("tie_word_embeddings"):
        head = embed
    names["embed"] = embed or "model.embed_tokens.weight"
    names["lm_head"] = head or "lm_head.weight"

    shapes = _expected_shapes(config)
    tensors = {}
    for key, name in names.items():
        if name not in index:
            raise CheckpointError(f"{folder}: missing tensor {name}")
        tensor, file = index.read(name), index.where[name]
        if tuple(tensor.shape) != shapes[key]:
            raise CheckpointError(
                f"{file}: {name}: expected shape {shapes[key]} from config.json, "
                f"found {tuple(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"{file}: {name}: expected a floating-point tensor, found {tensor.dtype}"
            )
        tensors[key] = tensor
    return MTPWeights(
        family=family,
        config=config,
        embed_first=family != "mimo",
        pass_normed_hidden=family == "mimo",
        tensors=tensors,
    )
