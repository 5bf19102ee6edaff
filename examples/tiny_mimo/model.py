"""A tiny MiMo-style target language model with one MTP layer, in plain torch.

The module tree mirrors the published MiMo-7B checkpoint, so ``state_dict()``
names are exactly what ``mtpdraft.service.model.checkpoint`` reads:

- target (a Qwen2 decoder): ``model.embed_tokens``, ``model.layers.{i}`` with
  ``input_layernorm``, ``self_attn.{q,k,v}_proj`` (with bias), ``o_proj``,
  ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (SwiGLU), then
  ``model.norm`` and ``lm_head``; neox-style RoPE; grouped-query attention.
- MTP layer: ``model.mtp_layers.0.{token_layernorm, hidden_layernorm}``,
  ``input_proj`` over cat[hidden, embedding] (hidden first), the same Qwen2
  block under the same prefix, and ``final_layernorm``, whose output both feeds
  the shared ``lm_head`` and is the hidden passed on to a chained draft.

The target hidden the MTP layer consumes is the last decoder layer's output
*before* ``model.norm``: vLLM's ``MiMoModel.forward`` returns
``hidden_states + residual`` without the final norm (``MiMoForCausalLM.compute_logits``
applies ``model.norm``), and vLLM's proposer hands that model output to the MTP
layer as its target hidden. MTP row ``i`` takes (embedding of token ``i + 1``,
target hidden ``h_i``) at RoPE position ``i`` (the hidden's position), zeroes the
embedding at position 0 (as vLLM does) and is trained to predict token ``i + 2``.

``python -m examples.tiny_mimo.model merge SRC DST`` rewrites a sharded
checkpoint as one ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TinyMiMoConfig:
    """The model's shape; ``to_hf`` gives the MiMo config.json fields."""

    vocab_size: int = 256
    hidden_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    intermediate_size: int = 1152
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        return {
            "architectures": ["MiMoForCausalLM"],
            "model_type": "mimo",
            "hidden_act": "silu",
            "attention_bias": True,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "torch_dtype": DTYPE_NAMES[dtype],
        } | {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_hf(cls, raw: dict) -> TinyMiMoConfig:
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE compute in fp32, or fp64 when the model runs in fp64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


def rope_tables(config: TinyMiMoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position_embeddings, head_dim / 2], computed in fp32 as vLLM does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [B, heads, T, D] by cos, sin [T, D / 2]."""
    half = x.shape[-1] // 2
    xf = x.to(_compute_dtype(x.dtype))
    cos, sin = cos.to(xf.dtype), sin.to(xf.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class KVCache:
    """The target's K/V per layer for one batch of sequences; ``length`` rows are valid."""

    def __init__(
        self,
        config: TinyMiMoConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def truncate(self, length: int) -> None:
        """Keeps the first ``length`` rows (the rest are overwritten later)."""
        self.length = length


class Attention(nn.Module):
    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=True)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=True)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: int,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, start)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        past = k.shape[2] - t  # cached keys before these queries
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # query i attends keys 0 .. past + i
            keys = torch.arange(k.shape[2], device=x.device)
            mask = keys[None, :] <= (past + torch.arange(t, device=x.device))[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Qwen2 decoder block: pre-norm attention and SwiGLU MLP with residuals."""

    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: int,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(DecoderLayer):
    """MiMo's MTP layer: input norms and projection, the Qwen2 block, a final norm."""

    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.token_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, config.rms_norm_eps)


class TinyMiMoModel(nn.Module):
    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp_layers = nn.ModuleList([MTPLayer(config)])


class TinyMiMoForCausalLM(nn.Module):
    """The target LM and its MTP layer; see the module docstring for the conventions."""

    def __init__(self, config: TinyMiMoConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TinyMiMoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 style: normal(std), residual output projections scaled by depth."""
        out_std = std / math.sqrt(2 * (self.config.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    @torch.no_grad()
    def randomize_(self, seed: int) -> TinyMiMoForCausalLM:
        """Peaked random weights (fan-in scaled, norms near 1): tie-free logits for tests."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif name == "model.embed_tokens.weight":
                value = noise
            else:
                value = noise / math.sqrt(p.shape[1]) * (3.0 if name == "lm_head.weight" else 1.0)
            p.copy_(value.to(p.dtype))
        return self

    def _rope(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[start : start + length], self.rope_sin[start : start + length]

    def forward_target(
        self, tokens: torch.Tensor, cache: KVCache | None = None, start: int | None = None
    ) -> torch.Tensor:
        """Target hiddens (last layer, before model.norm) [B, T, H] of tokens [B, T].

        With a cache the tokens sit at positions ``cache.length ..`` and the cache
        advances past them.
        """
        if start is None:
            start = cache.length if cache is not None else 0
        cos, sin = self._rope(start, tokens.shape[1])
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer.block(x, cos, sin, start, cache, i)
        if cache is not None:
            cache.length = start + tokens.shape[1]
        return x

    def target_logits(self, hiddens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hiddens))

    def forward_mtp(
        self, next_tokens: torch.Tensor, hiddens: torch.Tensor, start: int = 0
    ) -> torch.Tensor:
        """MTP rows (token i + 1, hidden h_i) at positions start.. -> final_layernorm out."""
        mtp = self.model.mtp_layers[0]
        t = next_tokens.shape[1]
        embeds = self.model.embed_tokens(next_tokens)
        positions = torch.arange(start, start + t, device=embeds.device)
        embeds = embeds.masked_fill((positions == 0)[None, :, None], 0.0)
        x = torch.cat([mtp.hidden_layernorm(hiddens), mtp.token_layernorm(embeds)], dim=-1)
        x = mtp.input_proj(x)
        cos, sin = self._rope(start, t)
        return mtp.final_layernorm(mtp.block(x, cos, sin, start))

    def mtp_logits(self, mtp_hiddens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(mtp_hiddens)

    def losses(
        self, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """On a window tokens [B, T + 1] at positions 0..T: (LM loss, MTP loss,
        target greedy tokens [B, T], MTP greedy tokens [B, T - 1])."""
        h = self.forward_target(tokens[:, :-1])
        logits = self.target_logits(h)
        lm = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        m = self.forward_mtp(tokens[:, 1:-1], h[:, :-1])
        mtp_logits = self.mtp_logits(m)
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
        return lm, mtp, logits.argmax(-1), mtp_logits.argmax(-1)


def save_checkpoint(
    model: TinyMiMoForCausalLM,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> Path:
    """Writes config.json and model.safetensors (or shards with an index) in MiMo naming."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2) + "\n")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (one file or shards)."""
    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return tensors


def load_checkpoint(
    folder: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> TinyMiMoForCausalLM:
    """The model of a checkpoint folder, in ``dtype`` (default: the checkpoint's)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    model = TinyMiMoForCausalLM(TinyMiMoConfig.from_hf(raw))
    model.load_state_dict(read_tensors(folder), strict=True)
    return model.to(device=device, dtype=dtype or DTYPES[raw.get("torch_dtype", "bfloat16")])


def merge_shards(src: str | Path, dst: str | Path) -> Path:
    """Rewrites a (sharded) checkpoint as config.json + one model.safetensors, bit for bit."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())
    tensors = dict(sorted(read_tensors(src).items()))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description="checkpoint utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="rewrite a sharded checkpoint as one file")
    merge.add_argument("src")
    merge.add_argument("dst")
    args = parser.parse_args()
    print(merge_shards(args.src, args.dst))


if __name__ == "__main__":
    main()
