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
