"""What each state does in the service's benches: a prompt, then warm-up and measured
steps of K drafts, each step carrying the previous step's verdict (0 accepted: the same
rows every step, in process and served), with random target hiddens.

Kept free of torch at import: client worker processes (spawned) import it, and an fp32
client needs neither torch nor the service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# MiMo-7B's own config: room for a 2048-row prompt plus every measured step.
MAX_POSITIONS = 32768


@dataclass(frozen=True)
class Workload:
    """What each state does: a prompt, then warm-up and measured steps of K drafts."""

    prompt: int
    num_drafts: int
    warmup: int
    steps: int
    hidden_size: int
    vocab_size: int
    dtype: str  # "bfloat16" or "float32": hiddens on the wire and in-process

    @property
    def rows_per_state(self) -> int:
        return self.prompt + self.warmup + self.steps + self.num_drafts + 1


def random_hiddens(rows: int, work: Workload, seed: int) -> Any:
    """Random target hiddens [rows, H] on the host, in the workload's dtype."""
    if work.dtype == "bfloat16":
        import torch

        gen = torch.Generator().manual_seed(seed)
        return torch.randn(rows, work.hidden_size, generator=gen).to(torch.bfloat16)
    import numpy as np

    return np.random.default_rng(seed).standard_normal((rows, work.hidden_size), np.float32)
