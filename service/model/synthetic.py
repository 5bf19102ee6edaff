"""Random-weight MTP checkpoints in the published namings of every family served.

For trying the service without a published checkpoint and for the tests' checkpoints
(`write_random_checkpoint`, README.md, "Checkpoints"), and for the benchmarks' models at
real shapes (in memory: `random_tensors`). The tensors are what a real checkpoint of the
family holds for its MTP layer, so the real loader reads them. The embedded default
model is not one of these: it is trained (default_model.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ConfigReader
from .families import family_named
from .layer import tensor_shapes
from .moe import expert_names

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class _Random:
    """Draws the weights: scaled so that activations stay O(1) and logits spread. Each
    tensor is computed in fp32 and rounded once to the dtype (a real-shape model never
    holds its fp32 draw whole)."""

    def __init__(self, seed: int, device: str | torch.device, dtype: torch.dtype) -> None:
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device, self.dtype = device, dtype

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device)

    def normal(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * self._randn(*shape)).to(self.dtype)

    def matrix(self, *shape: int, gain: float = 1.0) -> torch.Tensor:
        return (gain * (self._randn(*shape) / math.sqrt(shape[-1]))).to(self.dtype)

    def norm(self, size: int, zero_centred: bool = False) -> torch.Tensor:
        return ((0.0 if zero_centred else 1.0) + 0.1 * self._randn(size)).to(self.dtype)

    def draw(self, key: str, shape: tuple[int, ...], zero_centred: bool) -> torch.Tensor:
        """A tensor of the kind its key names: a matrix, a bias or a norm's weight."""
        if len(shape) > 1:
            return self.matrix(*shape)
        if key == "router_bias":  # positive, as the published correction biases are
            return self.normal(*shape, scale=0.1).abs()
        if key.endswith("_bias"):
            return self.normal(*shape, scale=0.1)
        return self.norm(shape[0], zero_centred)


def random_tensors(
    cfg: dict,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The embedding, LM head and first MTP layer of `family`, shaped by config.json `cfg`:
    every tensor the family's loader reads, under the names and shapes it reads them by."""
    kind, keys = family_named(family), ConfigReader(cfg)
    c, layout = kind.read_config(keys), kind.layout(keys)
    shapes = tensor_shapes(c)
    r = _Random(seed, device, dtype)
    # The target model's embedding and head, not the MTP layer's copies.
    embed = next(n for n in layout.embed if not n.startswith(layout.prefix))
    head = next(n for n in layout.head if not n.startswith(layout.prefix))
    t = {
        embed: r.normal(*shapes["embed"]),
        # A head scaled so that logits spread over a few units: peaked, tie-free drafts.
        head: r.matrix(*shapes["lm_head"], gain=3.0),
    }
    for key, name in kind.tensor_names(layout, c).items():
        t[name] = r.draw(key, shapes[key], c.norm_unit_offset)
        if key == "router":  # the routed experts follow it, one tensor each
            for e in range(c.moe.num_experts):
                for expert, n in expert_names(f"{layout.block}mlp.", e).items():
                    t[n] = r.matrix(*shapes[expert])
    return t


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
    """Writes config.json and safetensors for one MTP layer with random weights.

    A family's small checkpoint sets its synthetic_config's keys (a MoE family's: a small
    MoE, 8 experts, top 2) unless `extra_config` says otherwise.
    """
    kind = family_named(family)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [kind.architectures[0]],
        "model_type": kind.model_type,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_hidden_layers,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    cfg = cfg | kind.synthetic_config | (extra_config or {})
    tensors = random_tensors(cfg, family, seed=seed, dtype=dtype)
    tensors = {k: v.contiguous() for k, v in tensors.items()}

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
