"""Tiny checkpoints of the GLM-4.5/4.6 and Qwen3-Next/3.5/3.6 MTP families, published names.

`write_family_checkpoint(folder, name, ...)` takes the published config.json of a
model (kept as data in tests/published_configs/<name>.json), shrinks its sizes,
keeps every other key as published, and writes random weights under the tensor
names the published checkpoints use, so that a loader is tested against the real
key spellings and weight layout, not against this project's own idea of them.

Written from the published modeling code and checkpoints (see tests/family_reference.py
for the sources), independently of mtpdraft.service:

- GLM-4.5 / 4.5-Air / 4.6 (`Glm4MoeForCausalLM`): the MTP layer is
  `model.layers.{num_hidden_layers}.*` (enorm, hnorm, eh_proj, shared_head.norm, the
  decoder block with a sigmoid-routed MoE: mlp.gate.weight, mlp.gate.e_score_correction_bias
  (float32), mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.*). GLM-4.5 and -Air
  also carry the layer's own `embed_tokens` and `shared_head.head`; GLM-4.6 does not
  and uses `model.embed_tokens` and `lm_head` (vLLM PR #27597).
- Qwen3-Next (`Qwen3NextForCausalLM`): `mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`,
  `mtp.layers.0.*` (gated attention: q_proj twice as wide, q_norm/k_norm; MoE with
  mlp.experts.{e}.*, mlp.shared_expert.*, mlp.shared_expert_gate), `mtp.norm`; the
  embedding and head are the main model's `model.embed_tokens`, `lm_head`.
- Qwen3.5 MoE / Qwen3.6 dense (`Qwen3_5(Moe)ForConditionalGeneration`): config nested
  in `text_config`, main weights under `model.language_model.`, `mtp.*` top level;
  the MoE stores fused experts `mtp.layers.0.mlp.experts.gate_up_proj` [E, 2I, H]
  (gate rows first) and `experts.down_proj` [E, H, I]; the dense model has
  `mtp.layers.0.mlp.{gate,up,down}_proj`.

Shrunk sizes: hidden 64, 4 heads, 2 KV heads, head_dim 16 (GLM) or 32 (Qwen),
8 experts, top-k 3 (GLM) or 2 (Qwen), moe/shared intermediate 32, dense intermediate
48, vocab 256, num_hidden_layers 2, max_position_embeddings 4096. Structural keys that
would otherwise change which MLP the MTP layer has are shrunk with them:
first_k_dense_replace becomes 1 (GLM-4.5/4.6 publish 3, more than the 2 layers here),
layer_types is regenerated for 2 layers, and Qwen3.5's mrope_section is shrunk so that it
still sums to rotary_dim / 2.

Provenance of tests/published_configs (no HF config.json could be read whole here):
- glm-4.5.json: the values of GLM-4.5's config as transcribed in several public
  repositories (slime's glm4.5-355B-A32B.sh, Megatron-Bridge's glm45.md, a FULL_CFG test
  dict of GLM-4.6); key order and transformers_version "4.54.0" from memory.
- glm-4.5-air.json: as printed by transformers 4.54.1 in an ms-swift log (all values);
  transformers_version written as 4.54.0 like GLM-4.5.
- glm-4.6.json: GLM-4.5 with max_position_embeddings 202752 (transcriptions of GLM-4.6/4.7).
- qwen3-next.json: Qwen3-Next-80B-A3B-Instruct; every key except rope_theta matches
  transcriptions of Qwen3-Next-family release configs; rope_theta 10000000 is from
  memory (Qwen3-Coder-Next publishes 5000000) and is NOT confirmed.
- qwen3.5-moe.json: a transcription of Qwen3.6-35B-A3B's config (model_type
  qwen3_5_moe), quantization_config removed.
- qwen3.6-dense.json: Qwen3.6-27B. text_config sizes (5120 / 17408 / 64 layers / 24 heads
  / 4 KV / head_dim 256 / 48 linear value heads / vocab 248320) from several
  transcriptions; the remaining keys are assumed equal to qwen3.5-moe's, NOT confirmed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIGS = Path(__file__).parent / "published_configs"
NAMES = ("glm-4.5", "glm-4.5-air", "glm-4.6", "qwen3-next", "qwen3.5-moe", "qwen3.6-dense")
# GLM checkpoints whose MTP layer carries its own copy of the embedding and the head.
OWN_EMBED_AND_HEAD = ("glm-4.5", "glm-4.5-air")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def published_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def _family(name: str) -> str:
    return "glm" if name.startswith("glm") else "qwen"


def _shrink(name: str, cfg: dict) -> None:
    t = _text(cfg)
    glm = _family(name) == "glm"
    t.update(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 if glm else 32,
        vocab_size=256,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        intermediate_size=48,
    )
    if glm:
        t.update(
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        )
    elif "num_experts" in t:
        t.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if "linear_num_key_heads" in t:
        t.update(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    if "layer_types" in t:
        every = t.get("full_attention_interval", 4)
        t["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(t["num_hidden_layers"])
        ]
    rope = t.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        half = int(t["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    if "vision_config" in cfg:
        cfg["vision_config"].update(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
        )


def _respell(cfg: dict, spelling: str, dtype: torch.dtype) -> None:
    """Write the dtype and RoPE keys the way transformers 4 or transformers 5 saves them."""
    if spelling not in ("transformers4", "transformers5"):
        raise ValueError(f"spelling must be transformers4 or transformers5, not {spelling!r}")
    for d in [cfg, cfg.get("text_config"), cfg.get("vision_config")]:
        if not isinstance(d, dict):
            continue
        had_dtype = "torch_dtype" in d or "dtype" in d or d is cfg
        d.pop("torch_dtype", None)
        d.pop("dtype", None)
        if had_dtype:
            d["dtype" if spelling == "transformers5" else "torch_dtype"] = _DTYPE_NAMES[dtype]
    t = _text(cfg)
    rope = t.get("rope_parameters") or {}
    scaling = t.get("rope_scaling") or {}
    theta = rope.get("rope_theta", t.get("rope_theta"))
    partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor"))
    extra = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    extra |= {k: v for k, v in scaling.items() if k != "type"}
    extra.setdefault("rope_type", scaling.get("type", "default"))
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
        t.pop(key, None)
    if spelling == "transformers5":
        rope = {"rope_theta": theta} | extra
        if partial is not None:
            rope["partial_rotary_factor"] = partial
        t["rope_parameters"] = dict(sorted(rope.items()))
        cfg["transformers_version"] = "5.0.0"
    else:
        t["rope_theta"] = theta
        if partial is not None:
            t["partial_rotary_factor"] = partial
        t["rope_scaling"] = None if extra == {"rope_type": "default"} else extra


class Weights:
    """A checkpoint's tensors made one by one from one seeded generator, by published name."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.out: dict[str, torch.Tensor] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, dtype=torch.float64)

    def put(self, name: str, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self.out[name] = value.to(dtype or self.dtype).contiguous()

    def linear(self, name: str, out: int, inp: int, gain: float = 1.0) -> None:
        self.put(name, gain * self.randn(out, inp) / math.sqrt(inp))

    def norm(self, name: str, size: int, zero_centred: bool = False) -> None:
        w = 0.1 * self.randn(size)
        self.put(name, w if zero_centred else 1 + w)

    def bias(self, name: str, size: int) -> None:
        self.put(name, 0.5 * self.randn(size))


def _glm_layer(w: Weights, p: str, t: dict, moe: bool, full: bool = True) -> None:
    h, hd = t["hidden_size"], t["head_dim"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    w.norm(p + "input_layernorm.weight", h, False)
    w.norm(p + "post_attention_layernorm.weight", h, False)
    for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        w.linear(p + f"self_attn.{proj}.weight", rows, h)
        if t.get("attention_bias"):
            w.bias(p + f"self_attn.{proj}.bias", rows)
    w.linear(p + "self_attn.o_proj.weight", h, heads * hd)
    if t.get("use_qk_norm"):
        w.norm(p + "self_attn.q_norm.weight", hd, False)
        w.norm(p + "self_attn.k_norm.weight", hd, False)
    if not full:
        return
    if moe:
        n, inter = t["n_routed_experts"], t["moe_intermediate_size"]
        w.linear(p + "mlp.gate.weight", n, h, gain=2.0)
        # Positive, so that vLLM's masked_fill(-inf) and transformers' masked_fill(0.0)
        # of the groups left out pick the same experts.
        bias = 0.05 + 0.45 * torch.rand(n, generator=w.g, dtype=torch.float64)
        w.put(p + "mlp.gate.e_score_correction_bias", bias, torch.float32)
        for e in range(n):
            _swiglu(w, p + f"mlp.experts.{e}.", h, inter)
        _swiglu(w, p + "mlp.shared_experts.", h, inter * t.get("n_shared_experts", 1))
    else:
        _swiglu(w, p + "mlp.", h, t["intermediate_size"])


def _swiglu(w: Weights, p: str, h: int, inter: int) -> None:
    w.linear(p + "gate_proj.weight", inter, h)
    w.linear(p + "up_proj.weight", inter, h)
    w.linear(p + "down_proj.weight", h, inter)


def _qwen_layer(w: Weights, p: str, t: dict, moe: bool, fused: bool) -> None:
    h, hd = t["hidden_size"], t["head_dim"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    gated = t.get("attn_output_gate", True)
    w.norm(p + "input_layernorm.weight", h, True)
    w.norm(p + "post_attention_layernorm.weight", h, True)
    w.linear(p + "self_attn.q_proj.weight", heads * hd * (2 if gated else 1), h)
    w.linear(p + "self_attn.k_proj.weight", kv * hd, h)
    w.linear(p + "self_attn.v_proj.weight", kv * hd, h)
    w.linear(p + "self_attn.o_proj.weight", h, heads * hd)
    w.norm(p + "self_attn.q_norm.weight", hd, True)
    w.norm(p + "self_attn.k_norm.weight", hd, True)
    if not moe:
        _swiglu(w, p + "mlp.", h, t["intermediate_size"])
        return
    n, inter = t["num_experts"], t["moe_intermediate_size"]
    w.linear(p + "mlp.gate.weight", n, h, gain=2.0)
    if fused:
        w.put(p + "mlp.experts.gate_up_proj", w.randn(n, 2 * inter, h) / math.sqrt(h))
        w.put(p + "mlp.experts.down_proj", w.randn(n, h, inter) / math.sqrt(inter))
    else:
        for e in range(n):
            _swiglu(w, p + f"mlp.experts.{e}.", h, inter)
    _swiglu(w, p + "mlp.shared_expert.", h, t["shared_expert_intermediate_size"])
    w.linear(p + "mlp.shared_expert_gate.weight", 1, h)


def _qwen_main_layer(w: Weights, p: str, t: dict, kind: str) -> None:
    """A few tensors of a main-model layer (enough for a loader to have to skip them)."""
    h = t["hidden_size"]
    w.norm(p + "input_layernorm.weight", h, True)
    w.norm(p + "post_attention_layernorm.weight", h, True)
    if kind == "linear_attention":
        kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        vd = t["linear_num_value_heads"] * t["linear_value_head_dim"]
        w.linear(p + "linear_attn.in_proj_qkvz.weight", 2 * kd + 2 * vd, h)
        w.linear(p + "linear_attn.out_proj.weight", h, vd)
    else:
        w.linear(p + "self_attn.q_proj.weight", 2 * t["num_attention_heads"] * t["head_dim"], h)
    if t.get("num_experts", 0) > 0:
        w.linear(p + "mlp.gate.weight", t["num_experts"], h)
    else:
        w.linear(p + "mlp.gate_proj.weight", t["intermediate_size"], h)


def _glm_weights(name: str, cfg: dict, w: Weights, full_model: bool) -> None:
    t = cfg
    h, v, n = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    embed = w.randn(v, h)
    head = 3 * w.randn(v, h) / math.sqrt(h)
    for k in range(t.get("num_nextn_predict_layers", 1)):
        p = f"model.layers.{n + k}."
        w.norm(p + "enorm.weight", h, False)
        w.norm(p + "hnorm.weight", h, False)
        w.linear(p + "eh_proj.weight", h, 2 * h)
        _glm_layer(w, p, t, moe=n + k >= t["first_k_dense_replace"])
        w.norm(p + "shared_head.norm.weight", h, False)
        if name in OWN_EMBED_AND_HEAD:
            w.put(p + "embed_tokens.weight", embed)
            w.put(p + "shared_head.head.weight", head)
    if full_model or name not in OWN_EMBED_AND_HEAD:
        w.put("model.embed_tokens.weight", embed)
        w.put("lm_head.weight", head)
    if full_model:
        w.norm("model.norm.weight", h, False)
        for i in range(n):
            p = f"model.layers.{i}."
            _glm_layer(w, p, t, moe=False, full=False)
            if i >= t["first_k_dense_replace"]:
                w.linear(p + "mlp.gate.weight", t["n_routed_experts"], h)
            else:
                w.linear(p + "mlp.gate_proj.weight", t["intermediate_size"], h)


def _qwen_weights(name: str, cfg: dict, w: Weights, full_model: bool) -> None:
    t = _text(cfg)
    h, v, n = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    nested = "text_config" in cfg
    main = "model.language_model." if nested else "model."
    moe = t.get("num_experts", 0) > 0
    w.put(main + "embed_tokens.weight", w.randn(v, h))
    if not t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
        w.put("lm_head.weight", 3 * w.randn(v, h) / math.sqrt(h))
    w.linear("mtp.fc.weight", h, 2 * h)
    w.norm("mtp.pre_fc_norm_embedding.weight", h, True)
    w.norm("mtp.pre_fc_norm_hidden.weight", h, True)
    layers = t.get("mtp_num_hidden_layers", t.get("num_nextn_predict_layers", 1))
    for k in range(layers):
        _qwen_layer(w, f"mtp.layers.{k}.", t, moe=moe, fused=nested)
    w.norm("mtp.norm.weight", h, True)
    if full_model:
        every = t.get("full_attention_interval", 4)
        kinds = t.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
        ]
        w.norm(main + "norm.weight", h, True)
        for i in range(n):
            _qwen_main_layer(w, main + f"layers.{i}.", t, kinds[i])
        if nested:
            w.linear("model.visual.merger.linear_fc2.weight", h, 32)


def save_shards(
    folder: Path, tensors: dict[str, torch.Tensor], shards: int, total_digits: int = 5
) -> None:
    """The tensors in `shards` safetensors files with an index (one file when 1); shard
    files named model-00001-of-{shards} with `total_digits` digits in the total."""
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:0{total_digits}d}.safetensors"
        part = {k: tensors[k] for k in names[i * per : (i + 1) * per]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        total += sum(x.numel() * x.element_size() for x in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_family_checkpoint(
    folder: str | Path,
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shards: int = 1,
    spelling: str = "transformers4",
    full_model: bool = False,
    **overrides: object,
) -> Path:
    """Write a tiny checkpoint of family `name` into `folder`; returns the folder.

    `overrides` replace keys of the (text) config after shrinking, e.g. n_group=2,
    topk_group=1 for group-limited routing, or num_experts_per_tok=4.
    """
    if name not in NAMES:
        raise ValueError(f"unknown family {name!r}; one of {NAMES}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(published_config(name))
    _shrink(name, cfg)
    _text(cfg).update(overrides)
    _respell(cfg, spelling, dtype)
    w = Weights(seed, dtype)
    (_glm_weights if _family(name) == "glm" else _qwen_weights)(name, cfg, w, full_model)
    save_shards(folder, w.out, shards)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder
