"""A KV handle's rows out of this engine (ExportKV) and into an empty state of another
(ImportKV): how a draining replica hands its states to the others without a re-prefill.

Exported KV is rows, not blocks: row i's K and V ([kv_heads, head_dim] each) in the
compute dtype, in order, with a header naming the model (its fingerprint), the dtype
and the KV shape. The importing engine needs the same three; its block size may
differ. Nothing past a state's rows leaves the engine (a block's unused tail may hold
another state's stale KV). An import reserves every announced row's blocks up front,
writes rows as they come and gives the state its rows only when all have come: a
refused header or chunk, a stream cut short or a cancelled call leave the state empty
and its blocks free (`abort`).

A state's grammar travels with its KV: the header carries its spec and the tokens its
matcher consumed; the importing engine compiles the spec (a server without grammars
refuses the KV: FAILED_PRECONDITION, GRAMMARS_UNAVAILABLE, rather than take it without
its grammar) and replays the tokens, before any row is written.

An export or an import sees the engine only as a `KVStore`, so that the engine imports
this module and this module imports nothing of the engine.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..model.tensors import FP8Matrix
from .errors import FailedPrecondition, InvalidArgument, position_too_large
from .types import RowCount
from .validation import is_finite

if TYPE_CHECKING:
    from ..grammar.spec import HeldGrammar
    from ..grammar.states import StateGrammars
    from ..model.kv_cache import KVCache
    from ..model.mtp_head import MTPHead
    from .admission import Limits
    from .state import DrafterState, KVHandle

log = logging.getLogger("mtpdraft.engine")  # the lifecycle's debug lines, as engine.py's

# Elements of each weight tensor the fingerprint reads: enough to tell two fine-tunes of
# one architecture apart, few enough to take milliseconds on a GPU.
FINGERPRINT_SAMPLES = 4096


@dataclass
class KVHeader:
    """What exported KV is: the model it was computed by, its dtype, shape and rows."""

    model_fingerprint: str
    model_family: str
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    num_rows: int
    # The state's grammar and the tokens its matcher consumed, if it has one: the
    # importing state's matcher replays them.
    grammar: HeldGrammar | None = None


@dataclass
class KVChunk:
    """One message of exported KV: the header (first only), then rows in order."""

    header: KVHeader | None
    first_row: int
    k: torch.Tensor | None  # [n, kv_heads, head_dim]; None: no rows
    v: torch.Tensor | None
    state_id: int = 0  # ImportKV: the state to fill (first chunk; later ones 0 or the same)


class KVStore(Protocol):
    """What an export or an import asks of the engine: its KV cache and what that KV is,
    the handle an export reads, the state an import fills."""

    kv: KVCache
    limits: Limits  # its max_position: the most rows a state may hold
    states: Mapping[int, DrafterState]  # the live states by id, looked up as they are
    grammars: StateGrammars  # the states' grammars: a KV's comes with it

    def kv_header(self, num_rows: int) -> KVHeader:
        """This engine's KV described as an export's header, for `num_rows` rows."""

    def handle(self, handle_id: int) -> KVHandle:
        """The live handle, its lease renewed; NOT_FOUND if there is none."""

    def release_handle(self, handle_id: int) -> None:
        """Frees the handle and its blocks, if it lives."""

    def state(self, state_id: int) -> DrafterState:
        """The live state, its lease renewed; NOT_FOUND if there is none."""

    def reserve(self, state: DrafterState, rows: int, field: str) -> None:
        """Grows the state's blocks to hold `rows` rows, or refuses naming `field`."""


def model_fingerprint(head: MTPHead) -> str:
    """Names the head's weights: its family, config and a strided sample of every weight
    tensor, rounded to bfloat16 so that one checkpoint served in bf16 or fp32, with its FP8
    weights kept or dequantized, reads the same (the KV's dtype is checked on its own).
    32 hex digits."""
    digest = hashlib.sha256(f"{head.family}\n{head.config!r}\n".encode())
    tensors = _weight_tensors(head)
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}{list(t.shape)}".encode())
        digest.update(_sample(t).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:32]


def _sample(t: torch.Tensor | FP8Matrix) -> torch.Tensor:
    """Evenly spaced values of t (an FP8 matrix's scaled), as bfloat16 on the CPU."""
    values = t.values if isinstance(t, FP8Matrix) else t
    flat = values.detach().reshape(-1)
    # Indices in integers: float32 steps overshoot the last index of a tensor past 2**24
    # elements (an LM head).
    count = min(flat.numel(), FINGERPRINT_SAMPLES)
    picks = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)
    sample = flat[picks.to(flat.device)].float().cpu()
    if isinstance(t, FP8Matrix):
        (rows, cols), (bn, bk) = values.shape[-2:], t.block
        scale = t.scale.reshape(-1, *t.scale.shape[-2:]).cpu()
        lead, at = picks // (rows * cols), picks % (rows * cols)
        sample = sample * scale[lead, at // cols // bn, at % cols // bk]
    return sample.to(torch.bfloat16)


def _weight_tensors(head: MTPHead) -> dict[str, torch.Tensor | FP8Matrix]:
    """The head's public tensors, and those of the model's objects it holds (a MoE MLP's),
    by name: not its ops, nor its CUDA graphs' buffers (private). FP8 experts come with
    their scales."""
    model_package = __package__.rsplit(".", 1)[0] + ".model"
    found: dict[str, torch.Tensor | FP8Matrix] = {}
    for name, value in vars(head).items():
        if name.startswith("_") or name == "ops":
            continue
        if isinstance(value, torch.Tensor | FP8Matrix):
            found[name] = value
        elif type(value).__module__.startswith(model_package):
            for inner, tensor in vars(value).items():
                if isinstance(tensor, torch.Tensor | FP8Matrix):
                    found[f"{name}.{inner}"] = tensor
    scales = getattr(head.moe, "scales", None)
    if scales:
        for part in ("gate_up", "down"):
            values = found[f"moe.experts_{part}"]
            found[f"moe.experts_{part}"] = FP8Matrix(
                values, scales[f"{part}_scale"], scales["scale_block"]
            )
    return found


def _row_slots(blocks: np.ndarray, rows: np.ndarray, block_size: int) -> np.ndarray:
    """The flat KV slot of each row of a sequence whose block table is `blocks`."""
    return blocks[rows // block_size].astype(np.int64) * block_size + rows % block_size


class KVExport:
    """A handle's rows read out chunk by chunk, on the engine thread. Every call looks
    the handle up again (and renews its lease): it may be installed or expire meanwhile."""

    def __init__(self, store: KVStore, handle_id: int) -> None:
        self.store = store
        self.handle_id = handle_id
        handle = self._handle()
        self.header = store.kv_header(handle.num_rows)
        self.header.grammar = handle.grammar

    def _handle(self) -> KVHandle:
        return self.store.handle(self.handle_id)

    def rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows first .. first + count - 1 as CPU tensors [count, kv_heads, head_dim]."""
        handle, kv = self._handle(), self.store.kv
        rows = np.arange(first, min(first + count, handle.num_rows))
        slots = _row_slots(np.asarray(handle.blocks), rows, kv.block_size)
        k, v = kv.read(torch.from_numpy(slots).to(kv.k.device))
        return k.cpu(), v.cpu()

    def finish(self, keep_handle: bool) -> None:
        """The export is complete: frees the handle unless asked to keep it."""
        if not keep_handle:
            self.store.release_handle(self.handle_id)
        log.debug(
            "KV handle %d exported, %d rows; %s",
            self.handle_id,
            self.header.num_rows,
            "kept" if keep_handle else "freed",
        )


class KVImport:
    """An open ImportKV into an empty state: opened with the first chunk (its header and
    rows checked before the state, every announced row's blocks reserved), later rows
    written as they come, the state's own at finish."""

    def __init__(self, store: KVStore, first: KVChunk) -> None:
        header, state_id = first.header, first.state_id
        assert header is not None, "the first chunk carries the header"
        if header.num_rows < 0:
            raise InvalidArgument(
                f"header.num_rows: {header.num_rows} is negative",
                reason="BAD_SHAPE",
                field="header.num_rows",
            )
        if header.num_rows > store.limits.max_position:
            last_row = header.num_rows - 1
            raise position_too_large(last_row, store.limits.max_position, "header.num_rows")
        self.store, self.state_id, self.header = store, state_id, header
        self.received = 0
        if first.k is not None:
            self._check_rows(first.first_row, first.k, first.v)
        _check_header(header, store.kv_header(header.num_rows))
        state = store.state(state_id)
        if state.prefilling:
            raise FailedPrecondition(
                f"cannot import KV: a Prefill or ImportKV stream is open on state {state_id}",
                reason="PREFILL_IN_PROGRESS",
            )
        if state.num_rows or state.pending is not None:
            raise FailedPrecondition(
                f"state {state_id} holds {state.num_rows} rows; KV imports only into an "
                "empty state",
                reason="STATE_NOT_EMPTY",
            )
        self.matcher = None  # the KV's grammar's, where it has one, at its committed tokens
        if header.grammar is not None:
            store.grammars.compile_held(header.grammar)  # the serving loop's done so already
            self.matcher = store.grammars.replayed(header.grammar)
        store.reserve(state, header.num_rows, "header.num_rows")
        state.prefilling = True  # no other call may touch it until finish or abort
        if first.k is not None:
            try:
                self._store(state, first.k, first.v)
            except BaseException:
                self.abort()
                raise

    def write(self, first_row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the next rows; each chunk must continue the one before."""
        self._check_rows(first_row, k, v)
        self._store(self.store.state(self.state_id), k, v)

    def _check_rows(self, first_row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A chunk's rows continue the ones received, within the header's, in its shape and
        dtype, finite."""
        h = self.header
        if first_row != self.received:
            raise InvalidArgument(
                f"first_row: {first_row} does not continue the rows received ({self.received})",
                reason="CHUNK_MISMATCH",
                field="first_row",
            )
        # V's row is K's (MLA: the rotated k_pe beside the latent, fixed by the model).
        v_row = tuple(self.store.kv.v.shape[2:])
        for name, t, row in (("k", k, (h.num_kv_heads, h.head_dim)), ("v", v, v_row)):
            shape = (k.shape[0], *row)
            if t.dim() != 3 or tuple(t.shape) != shape:
                raise InvalidArgument(
                    f"{name}: expected shape [n, {row[0]}, {row[1]}] with the "
                    f"same n as k, got {list(t.shape)}",
                    reason="BAD_SHAPE",
                    field=name,
                )
            if t.dtype != h.dtype:
                raise InvalidArgument(
                    f"{name}: dtype {t.dtype} where the header says {h.dtype}",
                    reason="BAD_DTYPE",
                    field=name,
                )
        if self.received + k.shape[0] > h.num_rows:
            raise InvalidArgument(
                f"first_row: rows up to {self.received + k.shape[0]} where the header "
                f"announced {h.num_rows}",
                reason="CHUNK_MISMATCH",
                field="first_row",
            )
        for name, t in (("k", k), ("v", v)):
            if not is_finite(t):
                raise InvalidArgument(
                    f"{name}: holds NaN or infinite values", reason="NOT_FINITE", field=name
                )

    def _store(self, state: DrafterState, k: torch.Tensor, v: torch.Tensor) -> None:
        count = k.shape[0]
        if not count:
            return
        kv = self.store.kv
        slots = state.kv_slots(np.arange(self.received, self.received + count))
        kv.write(k.to(kv.k.device), v.to(kv.v.device), torch.from_numpy(slots).to(kv.k.device))
        self.received += count

    def finish(self) -> RowCount:
        """The stream ended: the state holds the rows if every announced one came."""
        state = self.store.state(self.state_id)
        if self.received != self.header.num_rows:
            raise InvalidArgument(
                f"the stream ended after {self.received} of the {self.header.num_rows} rows "
                "its header announced",
                reason="INCOMPLETE_KV",
                field="header.num_rows",
            )
        state.prefilling = False
        state.num_rows = self.header.num_rows
        if self.header.grammar is not None:
            self.store.grammars.restore(state.slot, self.header.grammar, self.matcher)
        log.debug("state %d: KV imported, %d rows", self.state_id, state.num_rows)
        return RowCount(state.num_rows, state.next_position)

    def abort(self) -> None:
        """Puts the state back as it was: empty, its reserved blocks free."""
        state = self.store.states.get(self.state_id)
        if state is None:
            return
        state.prefilling = False
        state.num_rows = 0
        state.trim()
        log.debug(
            "state %d: KV import undone after %d of %d rows",
            self.state_id,
            self.received,
            self.header.num_rows,
        )


def _check_header(header: KVHeader, ours: KVHeader) -> None:
    """The KV `header` announces fits this engine's (`ours`): same dtype, KV shape and
    model (in that order, so that each error names the first difference)."""
    if header.dtype != ours.dtype:
        raise FailedPrecondition(
            f"the KV was exported in {_name(header.dtype)}; this server computes in "
            f"{_name(ours.dtype)} (serve both with the same --dtype)",
            reason="KV_DTYPE_MISMATCH",
            field="header.dtype",
        )
    if (header.num_kv_heads, header.head_dim) != (ours.num_kv_heads, ours.head_dim):
        raise FailedPrecondition(
            f"the KV has {header.num_kv_heads} KV heads of {header.head_dim}; this server's "
            f"model has {ours.num_kv_heads} of {ours.head_dim}",
            reason="KV_SHAPE_MISMATCH",
            field="header.num_key_value_heads",
        )
    if header.model_fingerprint != ours.model_fingerprint:
        raise FailedPrecondition(
            f"the KV was computed by another model ({header.model_family or '?'}, fingerprint "
            f"{header.model_fingerprint or '(none)'}); this server serves {ours.model_family}, "
            f"fingerprint {ours.model_fingerprint}",
            reason="KV_MODEL_MISMATCH",
            field="header.model_fingerprint",
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
