"""Tiny DeepSeek-V3 / R1 / V3.1 checkpoints under the published tensor names, optionally FP8.

`write_deepseek_checkpoint(folder, name, ...)` takes the published config.json (kept as
data in tests/published_configs/<name>.json), shrinks its sizes, keeps every other key
as published, and writes random weights under the names of the published checkpoint,
so that a loader is tested against the real key spellings, layouts and FP8 storage,
not against this project's own idea of them. Written independently of mtpdraft.service
(see tests/deepseek_reference.py for the sources and /tmp facts it was written from).

The MTP layer is `model.layers.{num_hidden_layers}.`: enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head, embed_tokens (the published V3 checkpoint carries the
layer's own copy of the embedding and the head, equal in value to model.embed_tokens and
lm_head: DeepSeek-V3 README_WEIGHTS.md, "shares parameters"), and the decoder block:
self_attn.{q_a_proj, q_a_layernorm, q_b_proj} (or q_proj when q_lora_rank is null, the
DeepSeek-V2-Lite layout), self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj},
input_layernorm, post_attention_layernorm, mlp.gate.weight, mlp.gate.e_score_correction_bias
(float32), mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj. No
projection has a bias (attention_bias false; vLLM builds them all with bias=False).

FP8 (fp8=True), as DeepSeek publishes V3/R1/V3.1: every weight matrix that vLLM's
DeepseekV2 layers build with quant_config (self_attn q_a_proj, q_b_proj / q_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj; mlp gate_proj/up_proj/down_proj of the dense MLP,
of every expert and of the shared experts) is stored as float8_e4m3fn with
`<name>.weight_scale_inv` (float32, one value per weight_block_size block, shape
[ceil(out / b0), ceil(in / b1)]), the dequantized weight being fp8 * scale_inv per block
(DeepSeek-V3 inference/fp8_cast_bf16.py + kernel.weight_dequant). What stays in the
checkpoint dtype (bf16 when published): embed_tokens, lm_head / shared_head.head, every
norm (input/post_attention_layernorm, q_a_layernorm, kv_a_layernorm, enorm, hnorm,
shared_head.norm, model.norm), mlp.gate.weight (a ReplicatedLinear without quant_config
in vLLM), eh_proj (an nn.Linear in vLLM's deepseek_mtp.py); e_score_correction_bias is
float32. Scales are amax(|block|) / 448 (kernel.weight_quant), rounded up to a power of
two when quantization_config.scale_fmt is "ue8m0" (V3.1). The block size is shrunk from
the published [128, 128] to [16, 16] so that each matrix has several blocks, some of them
partial (kv_a_proj_with_mqa has 40 rows, as the published 576 = 4.5 blocks); with
fp8=False the quantization_config is dropped and every tensor has `dtype`.

Shrunk: hidden 64, 4 heads (num_key_value_heads 4), q_lora_rank 32, kv_lora_rank 32,
qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 16, 8 routed experts in n_group 4 with
topk_group 2, top-k 2, moe_intermediate 32, dense intermediate 48, vocab 256,
num_hidden_layers 2 with first_k_dense_replace 1 (published 3, more than the 2 layers
here), rope_scaling yarn kept with factor 4 and original_max_position_embeddings 1024 and
max_position_embeddings 4096 = factor * original (published 163840 = 40 * 4096), so that
vLLM (which reads `factor`) and transformers' _compute_yarn_parameters (which, when the
rope dict has original_max_position_embeddings, uses max_position_embeddings / original)
agree. beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0 as published: with
dim 8 the yarn ramp runs over frequency indices 0..3, and the softmax scale carries
(0.1 ln 4 + 1)^2.

Provenance of tests/published_configs:
- deepseek-v3.json: every value as in a full transcription of DeepSeek-V3's config.json
  in a public test file (architectures ... vocab_size 129280, transformers_version
  4.33.1); keys the transcription did not list (if the real file has more, e.g.
  aux_loss_alpha, seq_aux, pretraining_tp) are left out. DeepSeek-R1 publishes the same
  MTP-relevant keys as far as could be seen, so no separate file (NOT confirmed).
- deepseek-v3.1.json: deepseek-v3.json plus quantization_config.scale_fmt "ue8m0"
  (lmdeploy PR #4212: "Deepseek add scale-fmt since deepseekv3.1"; a V3.1 inference
  config with "scale_fmt": "ue8m0"); transformers_version 4.44.2 from memory, NOT confirmed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from family_checkpoints import Weights, save_shards

CONFIGS = Path(__file__).parent / "published_configs"
NAMES = ("deepseek-v3", "deepseek-v3.1")
FP8_BLOCK = [16, 16]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The weight matrices stored as FP8 in the published checkpoints (by their last name part).
FP8_LINEARS = (
    "q_a_proj",
    "q_b_proj",
    "q_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def published_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _shrink(cfg: dict) -> None:
    cfg.update(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=48,
        vocab_size=256,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
    )
    cfg["rope_scaling"].update(factor=4, original_max_position_embeddings=1024)
    cfg["quantization_config"]["weight_block_size"] = list(FP8_BLOCK)


def _respell(cfg: dict, spelling: str, dtype: torch.dtype) -> None:
    """transformers4: the keys as published (torch_dtype, rope_theta, rope_scaling with
    "type"); transformers5: dtype and rope_parameters {rope_theta, rope_type, ...}."""
    if spelling not in ("transformers4", "transformers5"):
        raise ValueError(f"spelling must be transformers4 or transformers5, not {spelling!r}")
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if spelling == "transformers4":
        cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
        return
    cfg["dtype"] = _DTYPE_NAMES[dtype]
    scaling = cfg.pop("rope_scaling", None) or {}
    rope = {"rope_theta": cfg.pop("rope_theta")}
    rope |= {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    cfg["rope_parameters"] = dict(sorted(rope.items()))
    cfg["transformers_version"] = "5.0.0"


def quantize_fp8(
    w: torch.Tensor, block: list[int], ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) with w ~ fp8 * scale_inv per block."""
    rows, cols = w.shape
    b0, b1 = block
    scale = torch.empty(math.ceil(rows / b0), math.ceil(cols / b1), dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            amax = float(w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].abs().max())
            s = max(amax, 1e-12) / FP8_MAX
            scale[i, j] = 2.0 ** math.ceil(math.log2(s)) if ue8m0 else s
    scale = scale.float()
    full = scale.double().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class _Weights(Weights):
    """Weights whose FP8_LINEARS are stored block-FP8 when the config says FP8."""

    def __init__(self, seed: int, dtype: torch.dtype, fp8: dict | None) -> None:
        super().__init__(seed, dtype)
        self.fp8 = fp8  # quantization_config, or None

    def linear(self, name: str, out: int, inp: int, gain: float = 1.0) -> None:
        if self.fp8 is None or name.split(".")[-2] not in FP8_LINEARS:
            return super().linear(name, out, inp, gain)
        w = gain * self.randn(out, inp) / math.sqrt(inp)
        ue8m0 = self.fp8.get("scale_fmt") == "ue8m0"
        q, s = quantize_fp8(w, self.fp8["weight_block_size"], ue8m0)
        self.out[name] = q.contiguous()
        self.out[name + "_scale_inv"] = s.contiguous()


def _swiglu(w: _Weights, p: str, h: int, inter: int) -> None:
    w.linear(p + "gate_proj.weight", inter, h)
    w.linear(p + "up_proj.weight", inter, h)
    w.linear(p + "down_proj.weight", h, inter)


def _attention(w: _Weights, p: str, t: dict) -> None:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    q_rank, kv_rank = t.get("q_lora_rank"), t["kv_lora_rank"]
    a = p + "self_attn."
    if q_rank:
        w.linear(a + "q_a_proj.weight", q_rank, h)
        w.norm(a + "q_a_layernorm.weight", q_rank)
        w.linear(a + "q_b_proj.weight", heads * (nope + rope), q_rank)
    else:
        w.linear(a + "q_proj.weight", heads * (nope + rope), h)
    w.linear(a + "kv_a_proj_with_mqa.weight", kv_rank + rope, h)
    w.norm(a + "kv_a_layernorm.weight", kv_rank)
    w.linear(a + "kv_b_proj.weight", heads * (nope + vd), kv_rank)
    w.linear(a + "o_proj.weight", h, heads * vd)


def _moe(w: _Weights, p: str, t: dict) -> None:
    h, n, inter = t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"]
    w.linear(p + "mlp.gate.weight", n, h, gain=2.0)
    # Positive, so that vLLM's masked_fill(-inf) and the HF code's masked_fill(0.0) of
    # the groups left out pick the same experts; spread wide enough to change choices.
    bias = 0.05 + 0.45 * torch.rand(n, generator=w.g, dtype=torch.float64)
    w.put(p + "mlp.gate.e_score_correction_bias", bias, torch.float32)
    for e in range(n):
        _swiglu(w, p + f"mlp.experts.{e}.", h, inter)
    _swiglu(w, p + "mlp.shared_experts.", h, inter * t.get("n_shared_experts", 1))


def _is_moe(t: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer: MoE when layer >= first_k_dense_replace and
    layer % moe_layer_freq == 0 (n_routed_experts set)."""
    return (
        bool(t.get("n_routed_experts"))
        and layer >= t["first_k_dense_replace"]
        and layer % t.get("moe_layer_freq", 1) == 0
    )


def _layer(w: _Weights, p: str, t: dict, layer: int) -> None:
    h = t["hidden_size"]
    w.norm(p + "input_layernorm.weight", h)
    w.norm(p + "post_attention_layernorm.weight", h)
    _attention(w, p, t)
    if _is_moe(t, layer):
        _moe(w, p, t)
    else:
        _swiglu(w, p + "mlp.", h, t["intermediate_size"])


def _weights(cfg: dict, w: _Weights, full_model: bool) -> None:
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    embed = w.randn(v, h)
    head = 3 * w.randn(v, h) / math.sqrt(h)
    for k in range(cfg.get("num_nextn_predict_layers", 1)):
        p = f"model.layers.{n + k}."
        w.put(p + "embed_tokens.weight", embed)
        w.norm(p + "enorm.weight", h)
        w.norm(p + "hnorm.weight", h)
        w.linear(p + "eh_proj.weight", h, 2 * h)
        _layer(w, p, cfg, n + k)
        w.norm(p + "shared_head.norm.weight", h)
        w.put(p + "shared_head.head.weight", head)
    if full_model:
        w.put("model.embed_tokens.weight", embed)
        w.put("lm_head.weight", head)
        w.norm("model.norm.weight", h)
        for i in range(n):
            _layer(w, f"model.layers.{i}.", cfg, i)


def write_deepseek_checkpoint(
    folder: str | Path,
    name: str = "deepseek-v3",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shards: int = 1,
    fp8: bool = False,
    full_model: bool = False,
    spelling: str = "transformers4",
    **overrides: object,
) -> Path:
    """Write a tiny checkpoint of `name` into `folder`; returns the folder.

    `overrides` replace config keys after shrinking, e.g. q_lora_rank=None for the
    DeepSeek-V2-Lite q_proj layout, n_group=1, num_nextn_predict_layers=2, or
    rope_scaling={...} (a dict replaces the published one whole).
    """
    if name not in NAMES:
        raise ValueError(f"unknown checkpoint {name!r}; one of {NAMES}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(published_config(name))
    _shrink(cfg)
    cfg.update(copy.deepcopy(overrides))
    if not fp8:
        cfg.pop("quantization_config", None)
    w = _Weights(seed, dtype, cfg.get("quantization_config"))
    _weights(cfg, w, full_model)
    _respell(cfg, spelling, dtype)
    save_shards(folder, w.out, shards, total_digits=6)  # DeepSeek: 5 and 6 digits
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder
