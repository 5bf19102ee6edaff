"""The engine's requests and results, free of any wire format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Verdict:
    """The verifier accepted the first num_accepted drafts of the pending proposal."""

    num_accepted: int
    refeed_hiddens: torch.Tensor | None = None  # [num_accepted, H]: h[p] .. h[p + a - 1]


@dataclass
class PrefillChunk:
    """One message of a Prefill stream: its rows, and (first chunk) where they go."""

    state_id: int  # 0 on a later chunk: the first chunk's
    start_position: int  # 0 on a later chunk: the first chunk's
    total_rows: int  # 0: not announced
    tokens: list[int]
    hiddens: torch.Tensor | None  # [len(tokens), H]; None for a chunk without rows


@dataclass
class Proposal:
    state_id: int
    tokens: list[int]
    probs: list[float]
    confidence: float
    first_position: int
    # Sampled drafts: each draft's q as (ids, probabilities) over its support.
    q_ids: list[list[int]] | None = None
    q_probs: list[list[float]] | None = None


@dataclass
class RowCount:
    num_rows: int
    next_position: int


@dataclass
class TakenKV:
    handle_id: int
    num_rows: int
    ttl_seconds: float


@dataclass
class EngineInfo:
    model_family: str
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    compute_dtype: str
    device: str
    max_drafts: int
    max_batch: int
    max_states: int
    live_states: int
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_handles: int
    state_ttl_seconds: float
    bitmask_words: int
    draining: bool
    instance_epoch: int  # carried by every id this instance issues (ids.py)
    model_fingerprint: str
    max_sample_top_k: int
    grammar_kinds: tuple[str, ...] = ()  # the kinds of grammar a state may have (none: no grammars)
