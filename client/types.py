"""Plain result and argument types of the drafter client.

Results are frozen dataclasses of Python ints, floats and strings (never
protobuf messages), so engines can keep, compare and print them freely.
Tensor-valued arguments are numpy arrays or torch tensors (see ``wire``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mtpdraft.v1 import drafter_pb2 as pb

from .proto_record import record_type
from .wire import Array

if TYPE_CHECKING:
    from .errors import DrafterError


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """After Prefill: rows the state holds, and the position the next row must have."""

    num_rows: int
    next_position: int


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """After AfterVerify: rows the state holds, and the position the next row must have."""

    num_rows: int
    next_position: int


@dataclass(frozen=True, slots=True)
class InstallResult:
    """After InstallKV: rows the state holds, and the position the next row must have."""

    num_rows: int
    next_position: int


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A state's detached KV (from TakeKV), freed unless installed within ``ttl_seconds``."""

    handle_id: int
    num_rows: int
    ttl_seconds: float


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a state's drafts are chosen (vLLM's parameters): temperature 0 is greedy;
    above 0 each draft is drawn from q, the draft head's distribution after temperature,
    min_p, top_k and top_p, and its q comes back with it (``Proposal.q_ids``). top_k 0 or
    -1 and top_p 1 cut nothing. The seed keys the draws with the state, the draft's
    position and its index, so the same key draws the same token alone or in any batch."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Proposal:
    """K (or fewer, when min_confidence stopped the chain) draft tokens for one state.

    Sampled drafts carry their q: ``q_ids[j]`` and ``q_probs[j]`` are draft j's support
    and probabilities (most probable first, 0 past the support), ``probs[j]`` is
    q(tokens[j]): what ``sampling.accept`` takes."""

    state_id: int
    tokens: list[int]
    probs: list[float]
    confidence: float
    first_position: int
    q_ids: list[list[int]] | None = None
    q_probs: list[list[float]] | None = None
    # Asked with return_bitmasks, for a state with a grammar: [len(tokens) + 1, W] int32,
    # row j the grammar's bitmask at position first_position + j (the last, the bonus
    # position's should every draft be accepted); None otherwise.
    bitmasks: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """The verifier's verdict on a state's pending proposal.

    ``refeed_hiddens``: optional target hiddens h[p] .. h[p + a - 1], shape
    [num_accepted, hidden_size]; with them the accepted drafts' rows are
    recomputed as committed rows.
    """

    num_accepted: int
    refeed_hiddens: Array | None = None


@dataclass(frozen=True, slots=True)
class ProposeArgs:
    """One state's arguments of a propose (those of ``propose``): a list of them makes a
    ProposeBatch's columns (``propose_many``, ``messages.batch_request_of``)."""

    state: int
    token: int
    hidden: Array
    position: int
    num_drafts: int
    bitmask: Array | None = None
    min_confidence: float = 0.0
    previous: Verdict | int | None = None
    sampling: SamplingParams | None = None  # the state's sampling from this step on
    draft_cap: int = 0  # num_drafts 0: the most drafts the drafter may choose (0: max_drafts)
    verify_token_cost: float = 0.0  # num_drafts 0: one more token's share of a verify step
    step_number: int = 0  # 0: not numbered (see DrafterClient.propose)


@dataclass(frozen=True)
class BatchResult:
    """A ProposeBatch answer as numpy columns: row i is ``state_ids[i]``'s.

    A row that failed has count 0 and its error in ``errors`` (its state is unchanged).
    """

    state_ids: np.ndarray  # [B] uint64, as the request named them
    drafts: np.ndarray  # [B, width] int32: row i's counts[i] drafts, then -1
    probs: np.ndarray  # [B, width] float32: each draft's top-1 probability, then 0
    counts: np.ndarray  # [B] int32
    confidences: np.ndarray  # [B] float32: each row's chain confidence
    first_positions: np.ndarray  # [B] int64: the position of each row's first draft
    errors: dict[int, DrafterError] = field(default_factory=dict)  # row -> its error
    # When some row's drafts were sampled: each draft's q, [B, width, support] (a greedy
    # row's: its draft alone, probability 1); None when none was.
    q_ids: np.ndarray | None = None  # int32
    q_probs: np.ndarray | None = None  # float32
    # Asked with return_bitmasks: row -> its grammar's bitmasks (Proposal.bitmasks), for
    # the rows whose state has a grammar.
    bitmasks: dict[int, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.counts)

    def proposal(self, row: int) -> Proposal:
        """Row ``row`` as a Proposal; raises the row's error if it failed."""
        if row in self.errors:
            raise self.errors[row]
        n = int(self.counts[row])
        return Proposal(
            state_id=int(self.state_ids[row]),
            tokens=self.drafts[row, :n].tolist(),
            probs=self.probs[row, :n].tolist(),
            confidence=float(self.confidences[row]),
            first_position=int(self.first_positions[row]),
            q_ids=None if self.q_ids is None else self.q_ids[row, :n].tolist(),
            q_probs=None if self.q_probs is None else self.q_probs[row, :n].tolist(),
            bitmasks=self.bitmasks.get(row),
        )

    def proposals(self) -> list[Proposal]:
        """Every row as a Proposal, in order; raises the first failed row's error."""
        return [self.proposal(row) for row in range(len(self))]


@dataclass(frozen=True, slots=True)
class Grammar:
    """What every draft of a state obeys (AllocState): exactly one of a JSON schema (JSON
    text or a dict), EBNF (xgrammar's GBNF dialect, a rule named root), a regular
    expression, or a structural tag (JSON text or a dict, xgrammar's format)."""

    json_schema: str | dict | None = None
    ebnf: str | None = None
    regex: str | None = None
    structural_tag: str | dict | None = None


class ServerInfo(record_type(pb.GetInfoResponse.DESCRIPTOR)):  # type: ignore[misc]
    """GetInfo: the model shape, limits and live counters, a field for each of
    GetInfoResponse's (drafter.proto says what each holds); dtypes by name, e.g. "bfloat16"."""

    __slots__ = ()
