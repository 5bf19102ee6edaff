"""The drafter engine: states, their KV blocks and the propose / verify cycle.

Synchronous and single-threaded by design: the server runs every call on one
worker thread, so no call sees another half done. It knows nothing of gRPC.

Row bookkeeping (DESIGN.md, "The contract"): Propose(x, h[p-1], p) computes the
committed row R0 = (x, h[p-1]) at row index p - 1 and the speculative rows
R(j) = (d(j), m(j-1)) for drafts 2..K. AfterVerify(a) keeps R0..R(a); with a
refeed the rows of d1..d(a) are recomputed with the target's hiddens.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable

from ..model.mtp_head import MTPHead
from . import validation as check
from .block_pool import BlockPool
from .chain import Chain, VerdictPlan
from .drafting import draft_all
from .errors import (
    DrafterError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from .prefill import PrefillSession
from .rows import Segment, run_segments
from .state import DrafterState, KVHandle, PendingProposal
from .types import EngineInfo, Proposal, ProposeArgs, RowCount, TakenKV, Verdict

# id(tensor) -> whether it is free of NaN and inf, for every hidden of one batch.
Finiteness = dict[int, bool]


def _finiteness(requests: Iterable[ProposeArgs]) -> Finiteness:
    """Whether a batch's hiddens and refeed hiddens are free of NaN and inf: as their
    reader found, or else checked here together (see check.finite_flags)."""
    known: Finiteness = {}
    unknown = {}
    for args in requests:
        pairs = [(args.hidden, args.hidden_finite)]
        if args.previous is not None and args.previous.refeed_hiddens is not None:
            pairs.append((args.previous.refeed_hiddens, args.previous.refeed_finite))
        for tensor, finite in pairs:
            if finite is None:
                unknown[id(tensor)] = tensor
            else:
                known[id(tensor)] = finite
    known.update(zip(unknown, check.finite_flags(list(unknown.values())), strict=True))
    return known


class DraftEngine:
    """Owns the MTP head, the KV pool, the states and the KV handles."""

    def __init__(
        self,
        head: MTPHead,
        *,
        kv_blocks: int,
        block_size: int = 16,
        max_states: int = 1024,
        max_states_per_owner: int | None = None,
        max_rows_per_state: int | None = None,
        max_drafts: int = 16,
        max_batch: int = 64,
        state_ttl: float = 600.0,
        prefill_rows_per_forward: int = 1024,
        cuda_graphs: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.head = head
        self.kv = head.new_kv_cache(kv_blocks, block_size)
        if cuda_graphs and head.device.type == "cuda":
            head.capture_decode_graphs(self.kv, max_batch, max_drafts)
        self.pool = BlockPool(kv_blocks)
        self.block_size = block_size
        self.max_states = max_states
        self.max_states_per_owner = max_states_per_owner
        self.max_rows_per_state = max_rows_per_state
        self._owned: dict[str, int] = {}
        self.max_drafts = max_drafts
        self.max_batch = max_batch
        self.state_ttl = state_ttl
        self.prefill_rows_per_forward = prefill_rows_per_forward
        self.clock = clock
        self.states: dict[int, DrafterState] = {}
        self.handles: dict[int, KVHandle] = {}
        self.draining = False
        # Called with (drafts proposed, drafts accepted) for every verdict: metrics.
        self.on_verdict: Callable[[int, int], None] | None = None

    # ---- bookkeeping -------------------------------------------------------

    def info(self) -> EngineInfo:
        c = self.head.config
        return EngineInfo(
            model_family=self.head.family,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            compute_dtype=str(self.head.dtype).removeprefix("torch."),
            device=str(self.head.device),
            max_drafts=self.max_drafts,
            max_batch=self.max_batch,
            max_states=self.max_states,
            live_states=len(self.states),
            kv_block_size=self.block_size,
            kv_blocks_total=self.pool.num_total,
            kv_blocks_free=self.pool.num_free,
            kv_handles=len(self.handles),
            state_ttl_seconds=self.state_ttl,
            bitmask_words=(c.vocab_size + 31) // 32,
            draining=self.draining,
        )

    def _new_id(self, taken: dict) -> int:
        while True:
            new = secrets.randbits(63)
            if new and new not in taken:
                return new

    def _state(self, state_id: int) -> DrafterState:
        state = self.states.get(state_id)
        if state is None:
            raise NotFound(
                f"state {state_id} not found (never allocated, freed, or its lease expired)",
                reason="STATE_NOT_FOUND",
                field="state_id",
            )
        state.last_used = self.clock()
        return state

    def _check_not_prefilling(self, state: DrafterState, action: str) -> None:
        if state.prefilling:
            raise FailedPrecondition(
                f"cannot {action}: a Prefill stream is open on state {state.id}",
                reason="PREFILL_IN_PROGRESS",
            )

    def _idle_state(self, state_id: int, action: str) -> DrafterState:
        """A state with no open Prefill and no pending proposal."""
        state = self._state(state_id)
        self._check_not_prefilling(state, action)
        if state.pending is not None:
            raise FailedPrecondition(
                f"cannot {action}: state {state_id} has a proposal awaiting its verdict "
                "(call AfterVerify, or pass it as Propose.previous)",
                reason="PROPOSAL_PENDING",
            )
        return state

    def _blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    def _reserve(self, needs: list[tuple[DrafterState, int]]) -> None:
        """Grows each state's blocks to cover its row count, all or nothing."""
        limit = self.max_rows_per_state
        for state, rows in needs:
            if limit is not None and rows > limit:
                raise ResourceExhausted(
                    f"state {state.id} would hold {rows} rows; the limit per state is {limit}",
                    reason="ROWS_PER_STATE_EXCEEDED",
                )
        extra = [(s, max(0, self._blocks_for(rows) - len(s.blocks))) for s, rows in needs]
        total = sum(n for _, n in extra)
        if total > self.pool.num_free:
            raise ResourceExhausted(
                f"no free KV blocks: {total} needed, {self.pool.num_free} of "
                f"{self.pool.num_total} free",
                reason="KV_BLOCKS_EXHAUSTED",
            )
        for state, n in extra:
            state.add_blocks(self.pool.allocate(n))

    def _trim(self, state: DrafterState) -> None:
        self.pool.free(state.drop_blocks(self._blocks_for(state.num_rows)))

    def _check_rows_fit(self, last_row: int, field: str) -> None:
        limit = self.head.config.max_position_embeddings
        if last_row >= limit:
            raise InvalidArgument(
                f"{field}: row at position {last_row + 1} exceeds the model's "
                f"max_position_embeddings ({limit})",
                reason="POSITION_TOO_LARGE",
                field=field,
            )

    def _check_position(self, position: int, expected: int, field: str) -> None:
        if position != expected:
            raise InvalidArgument(
                f"{field}: position {position} does not continue the state, which expects "
                f"{expected}",
                reason="POSITION_MISMATCH",
                field=field,
            )

    # ---- lifecycle ---------------------------------------------------------

    def alloc_state(self, owner: str = "") -> int:
        if self.draining:
            raise Unavailable("the server is draining and takes no new states", reason="DRAINING")
        if len(self.states) >= self.max_states:
            raise ResourceExhausted(
                f"no free state slots: all {self.max_states} are taken",
                reason="STATES_EXHAUSTED",
            )
        owned, limit = self._owned.get(owner, 0), self.max_states_per_owner
        if limit is not None and owned >= limit:
            raise ResourceExhausted(
                f"{owner or 'this client'} holds {owned} states, the limit per client",
                reason="STATES_PER_CLIENT_EXCEEDED",
            )
        state_id = self._new_id(self.states)
        self.states[state_id] = DrafterState(id=state_id, last_used=self.clock(), owner=owner)
        self._owned[owner] = owned + 1
        return state_id

    def free_state(self, state_id: int) -> bool:
        state = self.states.pop(state_id, None)
        if state is None:
            return False
        left = self._owned[state.owner] - 1
        if left:
            self._owned[state.owner] = left
        else:
            del self._owned[state.owner]
        self.pool.free(state.replace_blocks([]))
        return True

    def reap_expired(self) -> tuple[int, int]:
        """Frees states idle past the TTL and handles past their lease: (states, handles)."""
        now = self.clock()
        # A Prefill stream renews the lease with every chunk; one silent for a whole
        # TTL is as dead as an idle state (its client may have vanished mid-stream).
        stale = [s.id for s in self.states.values() if now - s.last_used > self.state_ttl]
        for state_id in stale:
            self.free_state(state_id)
        expired = [h.id for h in self.handles.values() if now > h.expires_at]
        for handle_id in expired:
            self.pool.free(self.handles.pop(handle_id).blocks)
        return len(stale), len(expired)

    def close(self) -> int:
        """Frees every state and handle; returns how many states there were."""
        self.draining = True
        count = len(self.states)
        for state_id in list(self.states):
            self.free_state(state_id)
        for handle in self.handles.values():
            self.pool.free(handle.blocks)
        self.handles.clear()
        return count

    # ---- prefill -----------------------------------------------------------

    def begin_prefill(self, state_id: int, start_position: int) -> PrefillSession:
        state = self._idle_state(state_id, "prefill")
        self._check_position(start_position, state.next_position, "start_position")
        return PrefillSession(self, state)

    # ---- the propose / verify cycle -----------------------------------------

    def _plan_verdict(
        self, state: DrafterState, verdict: Verdict, field: str, finite: Finiteness | None = None
    ) -> VerdictPlan:
        pending = state.pending
        if pending is None:
            raise FailedPrecondition(
                f"state {state.id} has no proposal awaiting a verdict",
                reason="NO_PENDING_PROPOSAL",
            )
        k, a = len(pending.drafts), verdict.num_accepted
        if not 0 <= a <= k:
            raise InvalidArgument(
                f"{field}.num_accepted: {a} is outside [0, {k}] (the proposal had {k} drafts)",
                reason="NUM_ACCEPTED_OUT_OF_RANGE",
                field=f"{field}.num_accepted",
            )
        refeed = verdict.refeed_hiddens
        if refeed is not None and refeed.numel() == 0 and a == 0:
            refeed = None
        rows_after = pending.first_row + 1 + a
        if refeed is not None:
            hiddens = check.check_hiddens(
                refeed,
                a,
                self.head.config.hidden_size,
                f"{field}.refeed_hiddens",
                verdict.refeed_finite if finite is None else finite.get(id(refeed)),
            )
            segment = Segment(state, pending.first_row + 1, pending.drafts[:a], hiddens)
            return VerdictPlan(pending.first_row + 1, segment, rows_after)
        computed = pending.first_row + pending.rows_computed
        if rows_after <= computed:
            return VerdictPlan(rows_after, None, rows_after)
        # All k accepted and the row of d(k) not computed yet: (d(k), m(k-1)).
        segment = Segment(state, computed, [pending.drafts[-1]], pending.last_hidden[None])
        return VerdictPlan(computed, segment, rows_after)

    def _apply_truncation(self, state: DrafterState, plan: VerdictPlan) -> None:
        if self.on_verdict is not None and state.pending is not None:
            drafts = len(state.pending.drafts)
            self.on_verdict(drafts, plan.rows_after - state.pending.first_row - 1)
        state.pending = None
        state.num_rows = plan.keep_rows

    def after_verify(self, state_id: int, verdict: Verdict) -> RowCount:
        state = self._state(state_id)
        self._check_not_prefilling(state, "apply a verdict")
        plan = self._plan_verdict(state, verdict, "verdict")
        self._reserve([(state, plan.rows_after)])
        self._apply_truncation(state, plan)
        if plan.recompute is not None:
            run_segments(self.head, self.kv, [plan.recompute])
        state.num_rows = plan.rows_after
        self._trim(state)
        return RowCount(state.num_rows, state.next_position)

    def propose(self, args: ProposeArgs) -> Proposal:
        return self.propose_batch([args])[0]

    def propose_batch(self, requests: list[ProposeArgs]) -> list[Proposal]:
        """All or nothing: drafts for every request, or raises the first request's error."""
        result = self.propose_groups([requests])[0]
        if isinstance(result, DrafterError):
            raise result
        return result

    def propose_groups(
        self, groups: list[list[ProposeArgs]]
    ) -> list[list[Proposal] | DrafterError]:
        """Drafts for many independent groups (one group per client call) in one batch.

        Each group is validated and given its KV blocks all or nothing; a group that
        fails gets its error in its place and changes nothing. The groups that pass
        are drafted together, one batched forward per draft position.
        """
        results: list[list[Proposal] | DrafterError | None] = [None] * len(groups)
        admitted: list[tuple[int, list[Chain]]] = []
        chains: list[Chain] = []
        verdicts: list[VerdictPlan | None] = []
        busy: set[int] = set()
        finite = _finiteness(args for group in groups for args in group)
        for index, group in enumerate(groups):
            try:
                planned = self._plan_group(group, busy, finite)
                self._reserve([(c.state, c.base_row + c.args.num_drafts) for c, _ in planned])
            except DrafterError as err:
                results[index] = err
                continue
            busy.update(args.state_id for args in group)
            admitted.append((index, [c for c, _ in planned]))
            chains.extend(c for c, _ in planned)
            verdicts.extend(v for _, v in planned)
        if chains:
            self._run_chains(chains, verdicts)
        for index, group_chains in admitted:
            results[index] = [self._finish(c) for c in group_chains]
        return results  # type: ignore[return-value]

    def _plan_group(
        self, group: list[ProposeArgs], busy: set[int], finite: Finiteness
    ) -> list[tuple[Chain, VerdictPlan | None]]:
        check.check_batch_size(len(group), self.max_batch)
        planned, seen = [], set(busy)
        for i, args in enumerate(group):
            if args.state_id in seen:
                raise InvalidArgument(
                    f"requests[{i}]: state {args.state_id} appears twice in one batch",
                    reason="DUPLICATE_STATE",
                    field="requests",
                )
            seen.add(args.state_id)
            planned.append(self._plan_proposal(args, finite))
        return planned

    def _run_chains(self, chains: list[Chain], verdicts: list[VerdictPlan | None]) -> None:
        """Applies the verdicts, then chains the drafts: one forward per draft position."""
        for chain, verdict in zip(chains, verdicts, strict=True):
            if verdict is not None:
                self._apply_truncation(chain.state, verdict)
        draft_all(self.head, self.kv, chains, verdicts)

    def _plan_proposal(
        self, args: ProposeArgs, finite: Finiteness
    ) -> tuple[Chain, VerdictPlan | None]:
        c = self.head.config
        if args.previous is not None:
            state = self._state(args.state_id)
            self._check_not_prefilling(state, "propose")
            verdict = self._plan_verdict(state, args.previous, "previous", finite)
            base_row = verdict.rows_after
        else:
            state = self._idle_state(args.state_id, "propose")
            verdict, base_row = None, state.num_rows
        self._check_position(args.position, base_row + 1, "position")
        check.check_tokens([args.token], c.vocab_size, "token")
        hidden = check.check_row(args.hidden, c.hidden_size, "hidden", finite[id(args.hidden)])
        check.check_num_drafts(args.num_drafts, self.max_drafts)
        check.check_min_confidence(args.min_confidence)
        bitmask = check.check_bitmask(args.bitmask, args.num_drafts, c.vocab_size)
        self._check_rows_fit(base_row + args.num_drafts, "position")
        # Inputs stay on the host: the chain stages a whole batch in one copy each.
        args.hidden = hidden
        return Chain(args, state, base_row, bitmask), verdict

    def _finish(self, chain: Chain) -> Proposal:
        state = chain.state
        state.pending = PendingProposal(
            first_row=chain.base_row,
            drafts=chain.drafts,
            rows_computed=chain.rows_computed,
            last_hidden=chain.last_hidden,
        )
        state.num_rows = chain.base_row + chain.rows_computed
        self._trim(state)
        return Proposal(
            state_id=state.id,
            tokens=chain.drafts,
            probs=chain.probs,
            confidence=chain.chain,
            first_position=chain.args.position + 1,
        )

    # ---- KV hand-off -------------------------------------------------------

    def take_kv(self, state_id: int) -> TakenKV:
        state = self._idle_state(state_id, "take its KV")
        handle = KVHandle(
            id=self._new_id(self.handles),
            blocks=state.replace_blocks([]),
            num_rows=state.num_rows,
            expires_at=self.clock() + self.state_ttl,
        )
        self.handles[handle.id] = handle
        state.num_rows = 0
        return TakenKV(handle.id, handle.num_rows, self.state_ttl)

    def install_kv(self, state_id: int, handle_id: int) -> RowCount:
        state = self._state(state_id)
        handle = self.handles.get(handle_id)
        if handle is None:
            raise NotFound(
                f"KV handle {handle_id} not found (never taken, installed, or its lease expired)",
                reason="HANDLE_NOT_FOUND",
                field="handle_id",
            )
        if state.num_rows or state.pending is not None or state.prefilling:
            raise FailedPrecondition(
                f"state {state_id} holds {state.num_rows} rows; KV installs only into an "
                "empty state",
                reason="STATE_NOT_EMPTY",
            )
        del self.handles[handle_id]
        self.pool.free(state.replace_blocks(handle.blocks))
        state.num_rows = handle.num_rows
        return RowCount(state.num_rows, state.next_position)
