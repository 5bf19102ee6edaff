"""The drafter engine: states, their KV blocks and the propose / verify cycle.

Synchronous and single-threaded by design: the serving loop (service/serving/) runs
every call on one worker thread, so no call sees another half done. It knows nothing
of gRPC, asyncio or threads. A Propose of any shape is a `step`: columns in
(`Step`), columns out (`StepResult`).

Row bookkeeping (DESIGN.md, "The contract"): Propose(x, h[p-1], p) computes the
committed row R0 = (x, h[p-1]) at row index p - 1 and the speculative rows
R(j) = (d(j), m(j-1)) for drafts 2..K. AfterVerify(a) keeps R0..R(a); with a
refeed the rows of d1..d(a) are recomputed with the target's hiddens.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..grammar.states import StateGrammars
from ..model.mtp_head import MTPHead
from . import validation as check
from .admission import Limits, admit
from .block_pool import BlockPool
from .drafting import ChainPlan, Drafted, draft_alone
from .errors import (
    DrafterError,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    not_finite,
    num_accepted_out_of_range,
    position_mismatch,
    position_out_of_range,
    position_too_large,
)
from .grammar_drafting import draft_with_grammars
from .ids import Ids
from .kv_transfer import KVChunk, KVExport, KVHeader, KVImport, model_fingerprint
from .prefill import PrefillSession
from .rows import Segment, run_segments
from .sampling import GREEDY, Sampling, changes
from .state import DrafterState, KVHandle, StateTable
from .step import Step, StepResult, StepShape, verdict_refeed
from .types import EngineInfo, RowCount, TakenKV, Verdict

if TYPE_CHECKING:
    from ..config import ServeConfig
    from ..grammar.spec import CompiledGrammar

# A debug line per event of a state's or a KV handle's life (alloc, free, lease expiry,
# KV take / install / export / import): never per step.
log = logging.getLogger("mtpdraft.engine")

# The most rows of a Prefill computed in one forward.
PREFILL_ROWS_PER_FORWARD = 1024


class DraftEngine:
    """Owns the MTP head, the KV pool, the states and the KV handles.

    Its limits are `config`'s (`mtpdraft serve`'s options), the KV pool's size
    (`config.kv_blocks`) given: `cli.build_engine` sizes it from the device's memory
    where the flag does not.
    """

    def __init__(
        self,
        head: MTPHead,
        config: ServeConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        epoch: int | None = None,
    ) -> None:
        if config.kv_blocks is None:
            raise ValueError("config.kv_blocks: the KV pool's size in blocks is required")
        self.head = head
        self.config = config
        # This instance's ids: a state id names the instance that issued it (ids.py).
        self.ids = Ids(epoch)
        c = head.config
        self.kv = head.new_kv_cache(config.kv_blocks, config.block_size)
        # The most tokens a sampled draft's q holds.
        self.support = min(config.max_sample_top_k, c.vocab_size)
        if config.cuda_graphs and head.device.type == "cuda":
            head.capture_decode_graphs(self.kv, config.max_batch, config.max_drafts, self.support)
        self.pool = BlockPool(config.kv_blocks)
        self.table = StateTable(
            config.max_states,
            -(-c.max_position_embeddings // config.block_size),
            config.max_drafts,
            config.block_size,
            self.pool,
            (c.hidden_size, head.dtype, head.device),
        )
        self.limits = Limits(
            c.vocab_size, c.max_position_embeddings, config.max_drafts, config.max_rows_per_state
        )
        # What the converter checks a request against before it is a Step.
        self.step_shape = StepShape(c.hidden_size, c.vocab_size, config.max_batch)
        # The states' grammars; compiled off this thread (grammars.compile), then attached.
        self.grammars = StateGrammars(
            config.model,
            c.vocab_size,
            tokenizer=config.tokenizer,
            compile_timeout=config.grammar_compile_timeout,
            cache_size=config.grammar_cache_size,
        )
        self._owned: dict[str, int] = {}
        self.clock = clock
        self.states: dict[int, DrafterState] = {}
        self.handles: dict[int, KVHandle] = {}
        self.draining = False
        # Called with the drafts proposed and accepted of every verdict ([n] each): metrics.
        self.on_verdicts: Callable[[np.ndarray, np.ndarray], None] | None = None

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
            max_drafts=self.config.max_drafts,
            max_batch=self.config.max_batch,
            max_states=self.config.max_states,
            live_states=len(self.states),
            kv_block_size=self.config.block_size,
            kv_blocks_total=self.pool.num_total,
            kv_blocks_free=self.pool.num_free,
            kv_handles=len(self.handles),
            state_ttl_seconds=self.config.state_ttl,
            bitmask_words=(c.vocab_size + 31) // 32,
            draining=self.draining,
            instance_epoch=self.ids.epoch,
            model_fingerprint=self.model_fingerprint,
            max_sample_top_k=self.support,
            grammar_kinds=self.grammars.kinds,
        )

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """Names the model's weights: replicas of one checkpoint report the same."""
        return model_fingerprint(self.head)

    def kv_header(self, num_rows: int) -> KVHeader:
        """This engine's KV described as an export's header, for `num_rows` rows."""
        k = self.kv.k  # a row of K is [kv_heads, head_dim] (MLA: the latent's, [1, R])
        return KVHeader(
            self.model_fingerprint, self.head.family, k.dtype, k.shape[2], k.shape[3], num_rows
        )

    def state(self, state_id: int) -> DrafterState:
        """The live state, its lease renewed; NOT_FOUND if there is none."""
        state = self.states.get(state_id)
        if state is None:
            raise self._state_not_found(state_id)
        state.touch(self.clock())
        return state

    def _state_not_found(self, state_id: int) -> DrafterError:
        return self.ids.state_not_found(state_id, self.config.state_ttl)

    def _check_not_prefilling(self, state: DrafterState, action: str) -> None:
        if state.prefilling:
            raise FailedPrecondition(
                f"cannot {action}: a Prefill or ImportKV stream is open on state {state.id}",
                reason="PREFILL_IN_PROGRESS",
            )

    def _idle_state(self, state_id: int, action: str) -> DrafterState:
        """A state with no open Prefill and no pending proposal."""
        state = self.state(state_id)
        self._check_not_prefilling(state, action)
        if self.table.pending_row[state.slot] >= 0:
            raise FailedPrecondition(
                f"cannot {action}: state {state_id} has a proposal awaiting its verdict "
                "(call AfterVerify, or pass it as Propose.previous)",
                reason="PROPOSAL_PENDING",
            )
        return state

    def reserve(self, state: DrafterState, rows: int, field: str) -> None:
        """Grows the state's blocks to hold `rows` rows (the last at index rows - 1)."""
        if rows > self.limits.max_position:
            raise position_too_large(rows - 1, self.limits.max_position, field)
        limit = self.config.max_rows_per_state
        if limit is not None and rows > limit:
            raise ResourceExhausted(
                f"state {state.id} would hold {rows} rows; the limit per state is {limit}",
                reason="ROWS_PER_STATE_EXCEEDED",
            )
        slots = np.array([state.slot])
        needed = int(self.table.extra_blocks(slots, np.array([rows]))[0])
        if needed > self.pool.num_free:
            raise ResourceExhausted(
                f"no free KV blocks: {needed} needed, {self.pool.num_free} of "
                f"{self.pool.num_total} free",
                reason="KV_BLOCKS_EXHAUSTED",
            )
        self.table.grow(slots, np.array([rows]))

    def _check_position(self, position: int, expected: int, field: str) -> None:
        if position != expected:
            raise position_mismatch(position, expected, field)

    # ---- lifecycle ---------------------------------------------------------

    def alloc_state(
        self,
        owner: str = "",
        sampling: Sampling = GREEDY,
        grammar: CompiledGrammar | None = None,
    ) -> int:
        """A new state, its drafts chosen as `sampling` says (its values checked,
        INVALID_ARGUMENT naming the field `sampling`); with `grammar` (from
        grammars.compile), every draft obeys it."""
        sampling = sampling.checked("sampling")
        if self.draining:
            raise Unavailable("the server is draining and takes no new states", reason="DRAINING")
        if len(self.states) >= self.config.max_states:
            raise ResourceExhausted(
                f"no free state slots: all {self.config.max_states} are taken",
                reason="STATES_EXHAUSTED",
            )
        owned, limit = self._owned.get(owner, 0), self.config.max_states_per_client
        if limit is not None and owned >= limit:
            raise ResourceExhausted(
                f"{owner or 'this client'} holds {owned} states, the limit per client",
                reason="STATES_PER_CLIENT_EXCEEDED",
            )
        state_id = self.ids.new(self.states)
        slot = self.table.take_slot(self.clock())
        self.table.set_sampling(np.array([slot]), changes([sampling]))
        self.states[state_id] = DrafterState(state_id, owner, slot, self.table)
        if grammar is not None:
            self.grammars.attach(slot, grammar)
        self._owned[owner] = owned + 1
        log.debug("state %d allocated for %s (%d live)", state_id, owner or "-", len(self.states))
        return state_id

    def free_state(self, state_id: int) -> bool:
        rows = self._free(state_id)
        if rows is None:
            return False
        log.debug("state %d freed with %d rows (%d live)", state_id, rows, len(self.states))
        return True

    def _free(self, state_id: int) -> int | None:
        """Frees the state and its blocks; the rows it held (None: no such state)."""
        state = self.states.pop(state_id, None)
        if state is None:
            return None
        rows = state.num_rows
        left = self._owned[state.owner] - 1
        if left:
            self._owned[state.owner] = left
        else:
            del self._owned[state.owner]
        self.table.release_slot(state.slot)
        self.grammars.detach(state.slot)
        return rows

    def reap_expired(self) -> tuple[int, int]:
        """Frees states idle past the TTL and handles past their lease: (states, handles)."""
        now = self.clock()
        # A Prefill stream renews the lease with every chunk; one silent for a whole
        # TTL is as dead as an idle state (its client may have vanished mid-stream).
        used = self.table.last_used
        ttl = self.config.state_ttl
        stale = [s.id for s in self.states.values() if now - used[s.slot] > ttl]
        for state_id in stale:
            rows = self._free(state_id)
            self.ids.expired(state_id)
            log.debug("state %d: lease expired, freed with %d rows", state_id, rows)
        expired = [h.id for h in self.handles.values() if now > h.expires_at]
        for handle_id in expired:
            handle = self.handles.pop(handle_id)
            self.pool.free(handle.blocks)
            log.debug("KV handle %d: lease expired, freed with %d rows", handle_id, handle.num_rows)
        return len(stale), len(expired)

    def close(self) -> int:
        """Frees every state and handle; returns how many states there were."""
        self.draining = True
        count = len(self.states)
        for state_id in list(self.states):
            self._free(state_id)
        for handle in self.handles.values():
            self.pool.free(handle.blocks)
        self.handles.clear()
        return count

    # ---- prefill -----------------------------------------------------------

    def begin_prefill(
        self,
        state_id: int,
        start_position: int,
        tokens: Sequence[int] = (),
        hiddens: torch.Tensor | None = None,
    ) -> PrefillSession:
        """Opens a Prefill with its first chunk's rows (`tokens`, `hiddens`), if it has
        any: the chunk's values are checked before the state."""
        if start_position < 1:
            raise position_out_of_range(start_position, "start_position")
        last_row = start_position - 2 + len(tokens)
        if last_row >= self.limits.max_position:
            raise position_too_large(last_row, self.limits.max_position, "start_position")
        rows = None if hiddens is None else self.prefill_rows(tokens, hiddens)
        state = self._idle_state(state_id, "prefill")
        self._check_position(start_position, state.next_position, "start_position")
        session = PrefillSession(self, state)
        if rows is not None:
            try:
                session.append_rows(tokens, rows)
            except BaseException:
                session.abort()
                raise
        return session

    def prefill_rows(self, tokens: Sequence[int], hiddens: torch.Tensor) -> torch.Tensor:
        """A Prefill chunk's hiddens as [len(tokens), H], its tokens and hiddens checked."""
        c = self.head.config
        check.check_tokens(tokens, c.vocab_size, "tokens")
        return check.check_hiddens(hiddens, len(tokens), c.hidden_size, "hiddens")

    def compute_rows(self, state: DrafterState, tokens: np.ndarray, hiddens: torch.Tensor) -> None:
        """Appends committed rows to the state (its blocks must hold them), in forwards
        of at most PREFILL_ROWS_PER_FORWARD rows."""
        step = PREFILL_ROWS_PER_FORWARD
        for lo in range(0, len(tokens), step):
            rows = hiddens[lo : lo + step]  # moved to the device with the batch's inputs
            segment = Segment(state.slot, state.num_rows, tokens[lo : lo + step], rows)
            run_segments(self.head, self.kv, self.table, [segment])
            state.num_rows += rows.shape[0]

    # ---- the propose / verify cycle -----------------------------------------

    def _apply_verdicts(
        self, slots: np.ndarray, accepted: np.ndarray, refeeds: dict[int, torch.Tensor]
    ) -> dict[int, Segment]:
        """Applies verdicts on the states' pending proposals (checked already): truncates
        each state to the rows it keeps and returns, by index into `slots`, the rows a
        state must compute next (DESIGN.md, "AfterVerify: which rows remain").
        `refeeds`: the target's hiddens of the accepted drafts, where a verdict has them."""
        t = self.table
        keep, recompute = self._verdict_rows(slots, accepted, refeeds)
        t.pending_row[slots] = -1
        t.num_rows[slots] = keep
        if t.pending_masks:
            for slot in slots.tolist():
                t.pending_masks.pop(slot, None)
        return recompute

    def _verdict_rows(
        self, slots: np.ndarray, accepted: np.ndarray, refeeds: dict[int, torch.Tensor]
    ) -> tuple[np.ndarray, dict[int, Segment]]:
        """What applying the verdicts keeps of each state (its rows) and recomputes (see
        _apply_verdicts), the states unchanged."""
        t = self.table
        first, k = t.pending_row[slots], t.pending_count[slots]
        computed_end = first + t.pending_computed[slots]
        rows_after = first + 1 + accepted
        keep = np.minimum(rows_after, computed_end)
        recompute: dict[int, Segment] = {}
        for i, refeed in refeeds.items():
            # Cut back to R0; the accepted drafts' rows are recomputed with the target's
            # hiddens.
            slot, keep[i] = int(slots[i]), first[i] + 1
            tokens = t.pending_drafts[slot, : accepted[i]].copy()
            recompute[i] = Segment(slot, int(keep[i]), tokens, refeed)
        for i in np.flatnonzero(rows_after > computed_end).tolist():
            if i not in refeeds:
                # All k accepted and the row of d(k) not computed yet: (d(k), m(k-1)).
                slot = int(slots[i])
                tokens = t.pending_drafts[slot, k[i] - 1 : k[i]].copy()
                recompute[i] = Segment(slot, int(keep[i]), tokens, t.last_hidden[slot : slot + 1])
        return keep, recompute

    def after_verify(self, state_id: int, verdict: Verdict) -> RowCount:
        a = verdict.num_accepted
        refeed = verdict_refeed(verdict, self.head.config.hidden_size, "verdict")
        if refeed is not None and not check.is_finite(refeed):
            raise not_finite("verdict.refeed_hiddens")
        state = self.state(state_id)  # the arguments are right whatever the state: now it
        self._check_not_prefilling(state, "apply a verdict")
        t, slot = self.table, state.slot
        if t.pending_row[slot] < 0:
            raise FailedPrecondition(
                f"state {state.id} has no proposal awaiting a verdict",
                reason="NO_PENDING_PROPOSAL",
            )
        k = int(t.pending_count[slot])
        if a > k:
            raise num_accepted_out_of_range(a, k, "verdict")
        rows_after = int(t.pending_row[slot]) + 1 + a
        self.reserve(state, rows_after, "verdict")
        refeeds = {} if refeed is None else {0: refeed}
        self._count_verdicts((t.pending_count[[slot]], np.array([a])))
        t.count_verdicts(np.array([slot]), np.array([a]))
        if self.grammars.matchers.get(slot) is not None:
            self.grammars.commit(slot, t.pending_drafts[slot, :a].tolist(), "verdict")
        recompute = self._apply_verdicts(np.array([slot]), np.array([a]), refeeds)
        if recompute:
            run_segments(self.head, self.kv, self.table, [recompute[0]])
        state.num_rows = rows_after
        state.trim()
        return RowCount(state.num_rows, state.next_position)

    def step(self, step: Step) -> StepResult:
        """Drafts for every row of the step, one batched forward per draft position.

        Each row stands or fails alone: a failed row gets its error in the answer and
        changes nothing. The rows that pass are drafted together: their verdicts
        applied, their chains run, their proposals left pending. A row that retries the
        step of its state's pending proposal (its step number) is answered with that
        proposal, and changes nothing.
        """
        b = len(step)
        slots = np.fromiter(
            (s.slot if (s := self.states.get(i)) else -1 for i in step.state_ids.tolist()),
            np.int64,
            b,
        )
        known = slots[slots >= 0]
        self.table.last_used[known] = self.clock()
        if step.changes_grammars:
            self.grammars.compile_changes(step.grammars)  # the serving loop's done so already
        admitted = admit(
            step, slots, self.table, self.limits, self._state_not_found, check_hiddens=False
        )
        # The largest K asked, a refused one (negative, or past max_drafts) within bounds:
        # a row asking K = 2**31 - 1 must not size the answer.
        asked = admitted.asked
        width = min(max(int(asked.max()), 0), self.config.max_drafts) if b else 0
        retried = admitted.retried_slots
        if len(retried):  # a retry asking fewer drafts than it was answered
            width = max(width, int(self.table.pending_count[retried].max()))
        result = StepResult(
            drafts=np.full((b, width), -1, np.int64),
            probs=np.zeros((b, width), np.float32),
            counts=np.zeros(b, np.int64),
            confidences=np.zeros(b, np.float64),
            first_positions=np.zeros(b, np.int64),
            errors=admitted.errors,
        )
        rows, slots, base_rows = admitted.rows, admitted.slots, admitted.base_rows
        later = self._hiddens_checked_later(step, admitted)
        if not later:
            kept = admitted.check_hiddens(step)
            rows, slots, base_rows = rows[kept], slots[kept], base_rows[kept]
        given = step.changes_grammars and any(c is not None for c in step.grammars[rows])
        if len(rows) and (self.grammars.matchers or given):
            kept = self._commit_grammars(step, rows, slots, result.errors)
            rows, slots, base_rows = rows[kept], slots[kept], base_rows[kept]
        if len(rows):
            self._draft(step, rows, slots, base_rows, asked[rows], result, later and admitted)
        self._answer_again(admitted.retried, admitted.retried_slots, result)
        return result

    def _hiddens_checked_later(self, step: Step, admitted) -> bool:
        """Whether the step's hiddens may be checked for NaN/inf while the device drafts
        (Admitted.check_hiddens): where its admitted rows change nothing before their
        chain that a refused row must not (a chain writes no KV for a row whose hidden is
        not finite; a verdict accepting every draft writes rows past the pending ones).
        Not with grammars (their matchers move first), refeeds (rewriting accepted rows),
        sampling changes, or drafts chosen by count."""
        rows = admitted.rows
        if not len(rows) or self.grammars.matchers or step.refeed_hiddens is not None:
            return False
        if step.changes_grammars or step.sampling["set"].any():
            return False
        return not (step.num_drafts[rows] == 0).any()

    def _commit_grammars(self, step, rows, slots, errors: dict) -> np.ndarray:
        """Moves the grammar states' matchers on by what each row commits (the drafts its
        verdict accepts, then its token), or where a row gives its state a grammar, starts
        that grammar's matcher at its token; which rows may go on (a row whose token its
        grammar refuses fails, its state's grammar and matcher unchanged)."""
        kept = np.ones(len(rows), bool)
        changes = step.grammars[rows]
        touched = self.grammars.which(slots) | np.not_equal(changes, None)
        for j in np.flatnonzero(touched).tolist():
            row, slot, change = int(rows[j]), int(slots[j]), changes[j]
            accepted = max(int(step.num_accepted[row]), 0)
            tokens = [*self.table.pending_drafts[slot, :accepted].tolist(), int(step.tokens[row])]
            try:
                if change is None:
                    self.grammars.commit(slot, tokens, "token")
                else:  # the drafts accepted were the old grammar's: the new starts here
                    self.grammars.switch(slot, change.grammar, tokens[-1], "token")
            except DrafterError as err:
                errors[row], kept[j] = err, False
        return kept

    def _answer_again(self, rows: np.ndarray, slots: np.ndarray, result: StepResult) -> None:
        """The retried rows' answers: their states' pending proposals, as first answered."""
        if not len(rows):
            return
        t, width = self.table, result.drafts.shape[1]
        counts = t.pending_count[slots]
        kept = np.arange(width)[None, :] < counts[:, None]
        result.drafts[rows] = np.where(kept, t.pending_drafts[slots, :width], -1)
        result.probs[rows] = np.where(kept, t.pending_probs[slots, :width], 0)
        result.counts[rows] = counts
        result.confidences[rows] = t.pending_confidence[slots]
        result.first_positions[rows] = t.pending_row[slots] + 2  # R0's position, plus one
        for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
            if (masks := t.pending_masks.get(slot)) is not None:
                result.grammar_masks[row] = masks
        pending = zip(rows.tolist(), slots.tolist(), strict=True)
        sampled = [(row, t.pending_q[slot]) for row, slot in pending if slot in t.pending_q]
        if sampled or result.q_ids is not None:  # the batch answers q: each of its rows
            support = max([ids.shape[1] for _, (ids, _) in sampled], default=1)
            _widen_q(result, support)
            _greedy_q(result, rows)
            for row, (ids, probs) in sampled:
                result.q_ids[row, : len(ids), : ids.shape[1]] = ids
                result.q_probs[row, : len(ids), : ids.shape[1]] = probs

    def _draft(self, step, rows, slots, base_rows, k, result: StepResult, unchecked=None) -> None:
        """Drafts the rows; `unchecked`: their Admitted, whose hiddens are checked while
        the device drafts (a row refused then is given back the blocks it was given and
        recorded nowhere)."""
        t = self.table
        # Rows that leave K to the drafter: their verify token cost (NaN: K was asked).
        chooses = step.num_drafts[rows] == 0
        costs = np.where(chooses, step.verify_costs[rows], np.nan)
        t.set_sampling(slots, step.sampling[rows])
        held = t.num_blocks[slots] if unchecked else None
        t.grow(slots, base_rows + k)
        recompute: list[tuple[int, Segment]] = []
        judged = np.flatnonzero(step.num_accepted[rows] >= 0)
        verdicts = None  # (drafts proposed, drafts accepted) of each verdict, to count
        later = None  # the verdicts the calibration counts while the device drafts
        if len(judged):
            refeeds = _ragged_rows(step.refeed_hiddens, step.refeed_counts, rows[judged])
            accepted = step.num_accepted[rows][judged]
            verdicts = (t.pending_count[slots[judged]], accepted)
            # A row choosing its K is calibrated with this verdict before it drafts; the
            # others' verdicts are counted off the launch's path.
            now = chooses[judged]
            if now.any():
                t.count_verdicts(slots[judged][now], accepted[now])
            later = (slots[judged][~now], accepted[~now])
            if unchecked:  # the proposals' record is all a verdict changes (none, refused)
                _, segments = self._verdict_rows(slots[judged], accepted, refeeds)
            else:
                segments = self._apply_verdicts(slots[judged], accepted, refeeds)
            recompute = [(int(judged[j]), segments[j]) for j in sorted(segments)]
        mask_starts = np.cumsum(step.mask_counts) - step.mask_counts
        index = t.device_index(slots)  # copied ahead of the chain, for the last hiddens
        # Whether the proposals may be recorded before the drafts come back, as if every
        # draft is kept: no state recomputes rows and all ask the same K.
        record_ahead = not recompute and (k == k[0]).all() and np.isnan(costs).all()
        chain_ran = False

        def count() -> None:
            self._count_verdicts(verdicts)
            if later is not None and len(later[0]):  # before _record: it reads pending counts
                t.count_verdicts(*later)

        refused = None  # the rows the hiddens' check refused once the chain ran

        def before_wait(hiddens: torch.Tensor) -> None:
            # Host work that needs no draft, done while the device drafts: the hiddens
            # checked, the verdicts counted and, with record_ahead, the proposals recorded
            # (again below if a chain is cut short).
            nonlocal chain_ran, refused
            chain_ran = True
            if unchecked and not (kept := unchecked.check_hiddens(step)).all():
                refused = ~kept
                return  # the rest after the wait, without the refused rows
            count()
            if record_ahead:
                self._record(slots, base_rows, k, k, index, hiddens[-1])

        drafted, last_hiddens, grammar_masks = draft_with_grammars(
            self.head,
            self.kv,
            t,
            ChainPlan(
                slots=slots,
                tokens=step.tokens[rows],
                hiddens=step.hiddens if len(rows) == len(step) else step.hiddens[rows],
                base_rows=base_rows,
                num_drafts=k,
                min_confidence=step.min_confidence[rows],
                mask_starts=mask_starts[rows],
                mask_counts=step.mask_counts[rows],
                bitmasks=step.bitmasks,
                recompute=recompute,
                sampling=t.sampling[slots],
                verify_costs=costs,
                calibration=t.calibration(slots) if chooses.any() else np.ones((len(slots), 0)),
                state_ids=step.state_ids[rows],
                support=self.support,
            ),
            before_wait,
            self.grammars,
        )
        if unchecked and refused is None and not (kept := unchecked.check_hiddens(step)).all():
            refused = ~kept  # (idempotent: checked here only where no chain ran)
        if refused is not None:
            t.shrink(slots[refused], held[refused])
            kept = ~refused
            rows, slots, base_rows, k = rows[kept], slots[kept], base_rows[kept], k[kept]
            on = torch.from_numpy(kept)
            index, last_hiddens = index[on.to(index.device)], last_hiddens[on.to(index.device)]
            drafted = drafted.rows(kept)
            if verdicts is not None:  # every verdict is counted later (no row chooses K)
                verdicts = tuple(v[kept[judged]] for v in verdicts)
                later = tuple(v[kept[judged]] for v in later)
            chain_ran = False  # counted and recorded below
        if not chain_ran:
            count()
        if not (chain_ran and record_ahead and (drafted.counts == k).all()):
            self._record(
                slots, base_rows, drafted.counts, drafted.rows_computed, index, last_hiddens
            )
        t.pending_drafts[slots, : drafted.all_drafts.shape[1]] = drafted.all_drafts
        width = drafted.drafts.shape[1]
        t.pending_probs[slots, :width] = drafted.probs
        self._remember_answer(slots, step.step_numbers[rows], drafted, grammar_masks)
        result.drafts[rows, :width] = drafted.drafts
        result.probs[rows, :width] = drafted.probs
        result.counts[rows] = drafted.counts
        result.confidences[rows] = drafted.confidences
        result.first_positions[rows] = step.positions[rows] + 1
        if drafted.q_ids is not None:
            b, support = len(step), drafted.q_ids.shape[2]
            result.q_ids = np.zeros((b, result.drafts.shape[1], support), np.int64)
            result.q_probs = np.zeros(result.q_ids.shape, np.float32)
            result.q_ids[rows, :width] = drafted.q_ids
            result.q_probs[rows, :width] = drafted.q_probs
        result.grammar_masks.update({int(rows[i]): m for i, m in grammar_masks.items()})

    def _remember_answer(
        self, slots: np.ndarray, numbers: np.ndarray, drafted: Drafted, masks: dict
    ) -> None:
        """What a retry of these states' steps is answered: their step numbers and what
        their proposals were answered besides the drafts and probabilities, which the
        table keeps (`masks`: the grammar states' masks, by index into `slots`)."""
        t = self.table
        if masks or t.pending_masks:
            for j, slot in enumerate(slots.tolist()):
                if j in masks:
                    t.pending_masks[slot] = masks[j]
                else:
                    t.pending_masks.pop(slot, None)
        t.pending_step[slots] = numbers
        t.last_step[slots] = np.maximum(t.last_step[slots], numbers)
        t.pending_confidence[slots] = drafted.confidences
        if drafted.q_ids is not None:  # each sampled draft's q, as answered
            for j, slot in enumerate(slots.tolist()):
                n = int(drafted.counts[j])
                t.pending_q[slot] = (drafted.q_ids[j, :n].copy(), drafted.q_probs[j, :n].copy())
        elif t.pending_q:
            for slot in slots.tolist():
                t.pending_q.pop(slot, None)

    def _count_verdicts(self, verdicts: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Hands (drafts proposed, drafts accepted) of some verdicts to on_verdicts."""
        if verdicts is not None and self.on_verdicts is not None:
            self.on_verdicts(*verdicts)

    def _record(self, slots, base_rows, counts, rows_computed, index, last_hiddens) -> None:
        """The states' proposals pending: R0 at base_rows, `counts` drafts kept, rows up to
        base_rows + rows_computed held, the last one's output hidden kept (at `index`,
        the slots on the hidden's device)."""
        t = self.table
        t.pending_row[slots] = base_rows
        t.pending_count[slots] = counts
        t.pending_computed[slots] = rows_computed
        t.num_rows[slots] = base_rows + rows_computed
        t.trim(slots)
        t.last_hidden.index_copy_(0, index, last_hiddens)

    # ---- KV hand-off -------------------------------------------------------

    def take_kv(self, state_id: int) -> TakenKV:
        state = self._idle_state(state_id, "take its KV")
        handle = KVHandle(
            id=self.ids.new(self.handles),
            blocks=self.table.detach_blocks(state.slot),
            num_rows=state.num_rows,
            expires_at=self.clock() + self.config.state_ttl,
            grammar=self.grammars.take(state.slot),  # it goes with the KV
        )
        self.handles[handle.id] = handle
        state.num_rows = 0
        log.debug(
            "state %d: KV taken into handle %d, %d rows in %d blocks",
            state_id,
            handle.id,
            handle.num_rows,
            len(handle.blocks),
        )
        return TakenKV(handle.id, handle.num_rows, self.config.state_ttl)

    def handle(self, handle_id: int) -> KVHandle:
        """The live handle, its lease renewed; NOT_FOUND if there is none."""
        handle = self.handles.get(handle_id)
        if handle is None:
            raise self.ids.handle_not_found(handle_id)
        handle.expires_at = self.clock() + self.config.state_ttl
        return handle

    def release_handle(self, handle_id: int) -> None:
        handle = self.handles.pop(handle_id, None)
        if handle is not None:
            self.pool.free(handle.blocks)

    def export_kv(self, handle_id: int) -> KVExport:
        """Reads a handle's rows out, chunk by chunk (kv_transfer.py)."""
        return KVExport(self, handle_id)

    def import_kv(self, first: KVChunk) -> KVImport:
        """Opens an import of exported KV into the empty state its first chunk names,
        with that chunk's header and rows (kv_transfer.py)."""
        return KVImport(self, first)

    def install_kv(self, state_id: int, handle_id: int) -> RowCount:
        state = self.state(state_id)
        handle = self.handles.get(handle_id)
        if handle is None:
            raise self.ids.handle_not_found(handle_id)
        if state.num_rows or state.pending is not None or state.prefilling:
            raise FailedPrecondition(
                f"state {state_id} holds {state.num_rows} rows; KV installs only into an "
                "empty state",
                reason="STATE_NOT_EMPTY",
            )
        if handle.grammar is not None:  # replayed first: a refusal changes nothing
            self.grammars.restore(state.slot, handle.grammar)
        del self.handles[handle_id]
        self.pool.free(self.table.detach_blocks(state.slot))
        self.table.attach_blocks(state.slot, handle.blocks)
        state.num_rows = handle.num_rows
        log.debug("state %d: KV handle %d installed, %d rows", state_id, handle_id, state.num_rows)
        return RowCount(state.num_rows, state.next_position)


def _ragged_rows(
    tensor: torch.Tensor | None, counts: np.ndarray, rows: np.ndarray
) -> dict[int, torch.Tensor]:
    """The part of a ragged tensor (counts[i] rows for row i) of each of `rows` that has
    any, by index into `rows`."""
    if tensor is None:
        return {}
    starts = np.cumsum(counts) - counts
    return {j: tensor[starts[i] : starts[i] + counts[i]] for j, i in enumerate(rows) if counts[i]}


def _widen_q(result: StepResult, support: int) -> None:
    """`result`'s q columns widened to `support` tokens a draft; made where no row was
    sampled, every answered row's q its draft alone."""
    b, width = result.drafts.shape
    have = 0 if result.q_ids is None else result.q_ids.shape[2]
    if have >= support:
        return
    fresh = result.q_ids is None
    ids, probs = np.zeros((b, width, support), np.int64), np.zeros((b, width, support), np.float32)
    if not fresh:
        ids[..., :have], probs[..., :have] = result.q_ids, result.q_probs
    result.q_ids, result.q_probs = ids, probs
    if fresh:
        _greedy_q(result, np.arange(b))


def _greedy_q(result: StepResult, rows: np.ndarray) -> None:
    """Rows `rows` of `result`'s q as a greedy proposal's: each kept draft alone."""
    kept = np.arange(result.drafts.shape[1])[None, :] < result.counts[rows, None]
    draft_alone(result.q_ids, result.q_probs, rows, result.drafts[rows], kept)
