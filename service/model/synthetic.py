"""Random-weight MTP checkpoints in the published namings of every family served.

Used to build the embedded default model, benchmark models at real shapes (in
memory: `random_tensors`), and test checkpoints (`write_random_checkpoint`): the
tensors are what a real checkpoint of the family holds for its MTP layer, so the
real loader reads them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ARCHITECTURES = {
    "mimo": ("MiMoForCausalLM", "mimo"),
    "deepseek": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "glm4_moe": ("Glm4MoeForCausalLM", "glm4_moe"),
    "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
# A small MoE for each MoE family's default test checkpoint (published key names).
_SMALL_MOE = {
    "glm4_moe": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        head_dim=32,
    ),
    "qwen3_next": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], partial_rotary_factor=0.25, head_dim=32,
    ),
}  # fmt: skip


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


def _mlp(r: _Random, prefix: str, h: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}gate_proj.weight": r.matrix(inter, h),
        f"{prefix}up_proj.weight": r.matrix(inter, h),
        f"{prefix}down_proj.weight": r.matrix(h, inter),
    }


def _mla(r: _Random, p: str, cfg: dict) -> dict[str, torch.Tensor]:
    h, heads, rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    t = {
        f"{p}kv_a_proj_with_mqa.weight": r.matrix(rank + cfg["qk_rope_head_dim"], h),
        f"{p}kv_a_layernorm.weight": r.norm(rank),
        f"{p}kv_b_proj.weight": r.matrix(
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), rank
        ),
        f"{p}o_proj.weight": r.matrix(h, heads * cfg["v_head_dim"]),
    }
    if q_rank := cfg.get("q_lora_rank"):
        t[f"{p}q_a_proj.weight"] = r.matrix(q_rank, h)
        t[f"{p}q_a_layernorm.weight"] = r.norm(q_rank)
        t[f"{p}q_b_proj.weight"] = r.matrix(heads * qk, q_rank)
    else:
        t[f"{p}q_proj.weight"] = r.matrix(heads * qk, h)
    return t


def random_tensors(
    cfg: dict,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The embedding, LM head and first MTP layer of `family`, shaped by config.json `cfg`."""
    r = _Random(seed, device, dtype)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)  # MLA configs may leave it out
    head_dim = cfg.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    qwen = family == "qwen3_next"
    if family == "mimo":
        p = block = "model.mtp_layers.0."
        inputs = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    elif qwen:
        p, block = "mtp.", "mtp.layers.0."
        inputs = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
    else:
        p = block = f"model.layers.{cfg['num_hidden_layers']}."
        inputs = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    t = {
        "model.embed_tokens.weight": r.normal(cfg["vocab_size"], h),
        # A head scaled so that logits spread over a few units: peaked, tie-free drafts.
        "lm_head.weight": r.matrix(cfg["vocab_size"], h, gain=3.0),
        f"{p}{inputs[0]}.weight": r.norm(h, qwen),
        f"{p}{inputs[1]}.weight": r.norm(h, qwen),
        f"{p}{inputs[2]}.weight": r.matrix(h, 2 * h),
        f"{p}{inputs[3]}.weight": r.norm(h, qwen),
        f"{block}input_layernorm.weight": r.norm(h, qwen),
        f"{block}post_attention_layernorm.weight": r.norm(h, qwen),
    }
    if cfg.get("kv_lora_rank"):  # DeepSeek's MLA
        t |= _mla(r, f"{block}self_attn.", cfg)
    else:
        t[f"{block}self_attn.q_proj.weight"] = r.matrix(2 * q if qwen else q, h)
        t[f"{block}self_attn.k_proj.weight"] = r.matrix(kv, h)
        t[f"{block}self_attn.v_proj.weight"] = r.matrix(kv, h)
        t[f"{block}self_attn.o_proj.weight"] = r.matrix(h, q)
    if family == "mimo" or cfg.get("attention_bias"):
        for proj, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[f"{block}self_attn.{proj}.bias"] = r.normal(size, scale=0.1)
    if qwen or cfg.get("use_qk_norm"):
        t[f"{block}self_attn.q_norm.weight"] = r.norm(head_dim, qwen)
        t[f"{block}self_attn.k_norm.weight"] = r.norm(head_dim, qwen)
    mlp = f"{block}mlp."
    experts = cfg.get("num_experts") if qwen else cfg.get("n_routed_experts")
    if not experts:
        return t | _mlp(r, mlp, h, cfg["intermediate_size"])
    inter = cfg["moe_intermediate_size"]
    t[f"{mlp}gate.weight"] = r.matrix(experts, h)
    for e in range(experts):
        t |= _mlp(r, f"{mlp}experts.{e}.", h, inter)
    if qwen:
        if shared := cfg.get("shared_expert_intermediate_size"):
            t |= _mlp(r, f"{mlp}shared_expert.", h, shared)
            t[f"{mlp}shared_expert_gate.weight"] = r.matrix(1, h)
    else:
        t[f"{mlp}gate.e_score_correction_bias"] = r.normal(experts, scale=0.1).abs()
        if shared := cfg.get("n_shared_experts"):
            t |= _mlp(r, f"{mlp}shared_experts.", h, inter * shared)
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

    A MoE family gets a small MoE (8 experts, top 2) unless `extra_config` says otherwise.
    """
    if family not in _ARCHITECTURES:
        raise ValueError(f"unknown family {family!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    architecture, model_type = _ARCHITECTURES[family]
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
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
    cfg = cfg | _SMALL_MOE.get(family, {}) | (extra_config or {})
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
