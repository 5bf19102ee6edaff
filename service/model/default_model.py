"""The embedded default model: a small MiMo-format checkpoint shipped with the package.

Its weights are random (seeded), so its drafts are arbitrary but reproducible; it
lets `mtpdraft serve` run anywhere with nothing to download. Regenerate with
`python -m mtpdraft.service.model.default_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .synthetic import write_random_checkpoint

DEFAULT_CHECKPOINT = Path(__file__).parent / "default_checkpoint"


def write_default_checkpoint(folder: Path = DEFAULT_CHECKPOINT) -> Path:
    # Hidden 256 with 4 heads of 64 (2 KV heads) and a 512-token vocabulary: about
    # a million parameters (2 MB in bf16), a few milliseconds per draft on a CPU.
    return write_random_checkpoint(
        folder,
        "mimo",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=512,
        num_hidden_layers=4,
        dtype=torch.bfloat16,
        seed=20261202,
        extra_config={"max_position_embeddings": 32768, "rope_theta": 640000.0},
    )


if __name__ == "__main__":
    print(write_default_checkpoint())
