"""Reads an MTP layer out of a checkpoint folder, in each published family's naming.

A folder holds config.json and safetensors files (one file, or shards listed by
model.safetensors.index.json). Only the tensors the MTP layer needs are read, so a
full target checkpoint can be pointed at directly; tensors under the MTP layer's
prefix that the computation would not use are refused, as are config keys it
would not honour (families/ says what each family computes and where it keeps it).
With several MTP layers the first is used and chained K times, as vLLM's MTP proposer
does.

Every CheckpointError raised here begins with the path of the file (or folder)
at fault: `mtpdraft serve` prints it as one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigReader, MTPConfig, read_config_json
from .errors import CheckpointError
from .families import Family, Layout, family_of
from .layer import tensor_shapes
from .moe import expert_names, stacked_expert_names
from .tensors import TensorDict, TensorFiles, dequantize_blocks


@dataclass
class MTPWeights:
    """One MTP layer's tensors under family-neutral names (layer.py), in the checkpoint's
    layout, with what the forward needs to know of its family.

    A MoE layer's experts are stacked: ``experts_gate_up`` [E, 2I, H] (each expert's
    gate rows, then its up rows) and ``experts_down`` [E, H, I].
    """

    family: str  # its name, as GetInfo reports it
    config: MTPConfig
    embed_first: bool  # order of the concat feeding input_proj
    pass_normed_hidden: bool  # the final norm's output is passed on (else the pre-norm)
    tensors: dict[str, torch.Tensor]
    mask_first_embedding: bool = True  # the embedding is zeroed at position 0
    # FP8 weights kept as stored (the experts, the family's fp8_matrices): ``NAME_scale``
    # holds NAME's fp32 scales, one per block of this shape.
    fp8_block: tuple[int, int] | None = None


class _Reader:
    """Reads tensors by published name, checking each against the shape config.json implies.

    An FP8 (e4m3) weight is dequantized with its ``weight_scale_inv`` (one fp32 scale per
    block of config.json's weight_block_size, as DeepSeek-V3 publishes them); an FP8 weight
    without its scale, or without a quantization_config saying how, is refused.
    """

    def __init__(self, source, shapes: dict, fp8_block, dtype: torch.dtype) -> None:
        self.source, self.shapes, self.used = source, shapes, set()
        self.fp8_block, self.dtype = fp8_block, dtype

    def __call__(self, key: str, name: str) -> torch.Tensor:
        tensor, scale = self.scaled(key, name)
        return tensor if scale is None else self._dequantize(tensor, scale)

    def scaled(self, key: str, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor as stored and, for an FP8 weight, its block scales (checked)."""
        source = self.source
        if name not in source.where:
            raise CheckpointError(f"{source.folder}: missing tensor {name}")
        tensor, file = source.read(name), source.where[name]
        if tuple(tensor.shape) != self.shapes[key]:
            raise CheckpointError(
                f"{file}: {name}: expected shape {self.shapes[key]} from config.json, "
                f"found {tuple(tensor.shape)}"
            )
        self.used.add(name)
        if tensor.dtype == torch.float8_e4m3fn:
            return tensor, self._scales(name, tensor, file)
        if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            raise CheckpointError(
                f"{file}: {name}: expected a floating-point tensor, found {tensor.dtype}"
            )
        return tensor, None

    def _scales(self, name: str, weight: torch.Tensor, file) -> torch.Tensor:
        scale_name = f"{name}_scale_inv"
        if self.fp8_block is None:
            raise CheckpointError(
                f"{file}: {name}: an FP8 weight, and config.json has no quantization_config "
                "saying how to read it"
            )
        if scale_name not in self.source.where:
            raise CheckpointError(
                f"{file}: {name}: an FP8 weight without its scales ({scale_name})"
            )
        (rows, cols), (br, bc) = weight.shape, self.fp8_block
        scale = self.source.read(scale_name)
        grid = (-(-rows // br), -(-cols // bc))
        if tuple(scale.shape) != grid:
            raise CheckpointError(
                f"{self.source.where[scale_name]}: {scale_name}: expected shape {grid} for "
                f"blocks of {br} x {bc}, found {tuple(scale.shape)}"
            )
        self.used.add(scale_name)
        return scale.float()

    def _dequantize(
        self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """fp32 by default: the head rounds it to its compute dtype, which may be fp32 (a
        bf16 copy would carry bf16's rounding into an fp32 head's kv_b_proj)."""
        return dequantize_blocks(weight, scale, self.fp8_block).to(dtype)


def _experts(read: _Reader, layout: Layout, c: MTPConfig) -> dict[str, torch.Tensor]:
    """The routed experts stacked: [E, 2I, H] gate then up rows, and [E, H, I].

    Stored one tensor per expert and projection, or already stacked (Qwen3.5:
    ``experts.gate_up_proj`` [E, 2I, H] gate first, ``experts.down_proj`` [E, H, I]).
    """
    mlp = f"{layout.block}mlp."
    stacked = stacked_expert_names(mlp)
    if stacked["experts_gate_up"] in read.source.where:
        return {key: read(key, name) for key, name in stacked.items()}
    gate, up, down = [], [], []
    for e in range(c.moe.num_experts):
        names = expert_names(mlp, e)
        gate.append(read.scaled("expert_gate_proj", names["expert_gate_proj"]))
        up.append(read.scaled("expert_up_proj", names["expert_up_proj"]))
        down.append(read.scaled("expert_down_proj", names["expert_down_proj"]))
    # FP8 experts stay FP8 with their scales (the MoE kernel reads them so) when gate and
    # up rows stack on block boundaries; otherwise, or if mixed, they are dequantized.
    fp8 = all(s is not None for _, s in gate + up + down)
    if fp8 and c.moe.intermediate_size % read.fp8_block[0] == 0:
        return {
            "experts_gate_up": torch.stack(
                [torch.cat([g, u]) for (g, _), (u, _) in zip(gate, up, strict=True)]
            ),
            "experts_gate_up_scale": torch.stack(
                [torch.cat([g, u]) for (_, g), (_, u) in zip(gate, up, strict=True)]
            ),
            "experts_down": torch.stack([w for w, _ in down]),
            "experts_down_scale": torch.stack([s for _, s in down]),
        }

    def plain(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        # In the checkpoint's dtype: every expert's fp32 copy would double their memory.
        return w if s is None else read._dequantize(w, s, read.dtype)

    return {
        "experts_gate_up": torch.stack(
            [torch.cat([plain(*g), plain(*u)]) for g, u in zip(gate, up, strict=True)]
        ),
        "experts_down": torch.stack([plain(*d) for d in down]),
    }


def _refuse_unknown_tensors(source, family: Family, layout: Layout, used: set[str]) -> None:
    """A tensor of the MTP layer that nothing reads means a computation not implemented."""
    later = re.compile(layout.later_layers) if layout.later_layers else None
    unused = sorted(
        n
        for n in source.where
        if n.startswith(layout.prefix) and n not in used and not (later and later.match(n))
    )
    if not unused:
        return
    mla = [n for n in unused if ".q_a_proj." in n or ".kv_a_proj_with_mqa." in n]
    if mla:
        raise CheckpointError(
            f"{source.where[mla[0]]}: {layout.block}self_attn holds MLA weights, but "
            "config.json has no kv_lora_rank (an MLA config) to read them by"
        )
    shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
    raise CheckpointError(
        f"{source.where[unused[0]]}: tensors the {family.name} MTP layer would not use "
        f"(a computation not implemented, or a config.json that does not match): {shown}"
    )


def _config(path: Path, family: Family, keys: ConfigReader) -> MTPConfig:
    """The family's config; a missing key or a value of the wrong type names it and the file."""
    try:
        return family.read_config(keys)
    except CheckpointError as exc:  # its messages begin "config.json: "
        raise CheckpointError(f"{path}: {str(exc).removeprefix('config.json: ')}") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: a value of the wrong type ({exc})") from exc


def mtp_weights_from(raw: dict, source: TensorFiles | TensorDict) -> MTPWeights:
    """Reads and checks the first MTP layer, its embedding and its head from `source`."""
    config_path = source.folder / "config.json"
    keys = ConfigReader(raw)
    try:
        family = family_of(keys, source.where)
    except CheckpointError as exc:
        raise CheckpointError(f"{source.folder}: {exc}") from exc
    layout = family.layout(keys)
    config = _config(config_path, family, keys)
    experts = f"{layout.block}mlp.experts."
    if config.moe is None and any(n.startswith(experts) for n in source.where):
        raise CheckpointError(
            f"{config_path}: describes a dense MLP, but {experts[:-9]} has experts"
        )
    read = _Reader(source, tensor_shapes(config), keys.fp8_block(), config.dtype)

    names = family.tensor_names(layout, config)
    embed = next((n for n in layout.embed if n in source.where), layout.embed[-1])
    head = next((n for n in layout.head if n in source.where), None)
    if head is None and keys.get("tie_word_embeddings"):
        head = embed
    names |= {"embed": embed, "lm_head": head or layout.head[-1]}
    tensors = {}
    for key, name in names.items():
        weight, scale = read.scaled(key, name)
        if scale is not None and key in family.fp8_matrices:  # FP8 for the kernels that can
            tensors[f"{key}_scale"] = scale
        elif scale is not None:
            weight = read._dequantize(weight, scale)
        tensors[key] = weight
    if config.moe is not None:
        tensors |= _experts(read, layout, config)
    _refuse_unknown_tensors(source, family, layout, read.used)
    return MTPWeights(
        family=family.name,
        config=config,
        embed_first=family.embed_first,
        pass_normed_hidden=family.pass_normed_hidden,
        tensors=tensors,
        mask_first_embedding=family.mask_first_embedding,
        fp8_block=read.fp8_block if any(k.endswith("_scale") for k in tensors) else None,
    )


def load_mtp_weights(folder: str | Path) -> MTPWeights:
    """Reads and checks the first MTP layer, its embedding and its head from a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    raw = read_config_json(folder)
    return mtp_weights_from(raw, TensorFiles(folder))
