"""Model shapes the benchmarks use (no imports: client worker processes re-import it)."""

# The MiMo-7B MTP layer's shape (DESIGN.md, "MTP families"), with random weights.
MIMO_7B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=11008, vocab_size=151680,
)  # fmt: skip
# A tiny model for CPU smoke runs of the benchmark scripts.
SMALL = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=512, vocab_size=1024,
)  # fmt: skip

# The MTP layers of two MoE families at their published shapes (config.json keys as
# published; the weights are random). MoE decode steps touch only the routed experts.
GLM_45_AIR = {
    "model_type": "glm4_moe", "hidden_size": 4096, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "vocab_size": 151552, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
    "max_position_embeddings": 131072, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
    "attention_bias": False, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 10000000, "max_position_embeddings": 262144, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}  # fmt: skip
# Tiny MoE versions of both for CPU smoke runs.
SMALL_MOE = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "moe_intermediate_size": 32, "vocab_size": 256, "max_position_embeddings": 4096,
    "n_routed_experts": 8, "num_experts": 8, "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 32,
}  # fmt: skip
# DeepSeek-V3's MTP layer (MLA, 256 experts top 8 in 8 groups, YaRN), its experts FP8
# with 128 x 128 block scales as published (the other FP8 weights are read as bf16).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "num_hidden_layers": 61, "vocab_size": 129280, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 163840, "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16",
}  # fmt: skip
SMALL_MLA = {
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_group": 4, "topk_group": 2,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]},
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024},
}  # fmt: skip
