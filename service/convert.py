"""Between the wire's protobuf messages and the engine's types, both ways.

In (the servicer, before the serving loop sees a request): a request's tensors are
read and checked (dtype, shape, byte count; INVALID_ARGUMENT naming the field) into
CPU tensors over a copy of the message's bytes, and its fields into the engine's
types: a Propose or a ProposeBatch message straight into the engine's `Step` (its
columns checked by `columns.step`, a Propose's row by `step.single`), a Verdict, a
PrefillChunk.
A hidden's NaN/inf check is left to the engine, which checks a whole batch's at
once: here, on the event loop, numpy would let go of the GIL for every row past
500 elements and win it back from the busy engine thread (in one H200 run, 64 Go
streams, checking each request here filled batches of 40 and 54 on average against
60, 14.1k and 18.4k drafts/s against 17.5k and 19.6k).

Out (the servicer): a step's StepResult, as a Proposal message (a Propose's one row)
or as one ProposeBatchResponse; GetInfo's answer, the engine's and the serving loop's
fields by their names.

Both ways: exported KV (ExportKV's answers, ImportKV's requests) as KVChunk messages.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING

import torch

from mtpdraft.v1 import drafter_pb2 as pb

from .engine import columns
from .engine.errors import InvalidArgument
from .engine.kv_transfer import KVChunk, KVHeader
from .engine.sampling import Sampling
from .engine.step import Step, StepResult, StepShape, single
from .engine.types import PrefillChunk, Verdict
from .grammar.spec import GrammarChange, GrammarSpec, HeldGrammar

if TYPE_CHECKING:
    from .serving.loop import ServerInfo

DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_BF16: torch.bfloat16,
    pb.DTYPE_FP16: torch.float16,
    pb.DTYPE_FP32: torch.float32,
    pb.DTYPE_INT32: torch.int32,
}
ITEMSIZE = {pb.DTYPE_BF16: 2, pb.DTYPE_FP16: 2, pb.DTYPE_FP32: 4, pb.DTYPE_INT32: 4}
HIDDEN_DTYPES = (pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32)
DTYPE_ENUM = {dtype: enum for enum, dtype in DTYPES.items()}
# The integer type of each dtype's size: a tensor's bytes are read through it.
_BITS = {2: torch.int16, 4: torch.int32}
# No real tensor here has a dimension past 2**31; an empty tensor's other
# dimensions could otherwise be anything, up to sizes torch cannot represent.
_MAX_DIM = 2**31 - 1


# --- in: requests as the engine takes them --------------------------------------------

# A tensor over a bytes object, which Python deems read-only: torch warns of that once a
# process, and is warned here, where the tensors made so are known to be private.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(2), dtype=torch.int16)


def read_tensor(msg: pb.Tensor, field: str, allowed: tuple[int, ...]) -> torch.Tensor:
    """The tensor, its dtype and byte count checked (INVALID_ARGUMENT when malformed): a CPU
    tensor over the copy of its bytes that reading the field makes, which no message's
    memory backs and nothing else holds (so writing to it harms nothing)."""
    if msg.dtype not in allowed:
        names = ", ".join(pb.DType.Name(d) for d in allowed)
        raise InvalidArgument(
            f"{field}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in ITEMSIZE else msg.dtype} "
            f"is not accepted here (expected one of {names})",
            reason="BAD_DTYPE",
            field=field,
        )
    shape = tuple(msg.shape)
    if any(not 0 <= d <= _MAX_DIM for d in shape):
        raise InvalidArgument(
            f"{field}: shape {list(shape)} has a dimension outside [0, {_MAX_DIM}]",
            reason="BAD_SHAPE",
            field=field,
        )
    data = msg.data  # each read of a bytes field builds a new bytes object
    expected = math.prod(shape) * ITEMSIZE[msg.dtype]
    if len(data) != expected:
        raise InvalidArgument(
            f"{field}: {len(data)} bytes of data, but shape {list(shape)} of "
            f"{pb.DType.Name(msg.dtype)} needs {expected}",
            reason="BAD_BYTE_COUNT",
            field=field,
        )
    dtype = DTYPES[msg.dtype]
    if not data:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=dtype)  # over `data` itself: one copy, not two
    # A Propose's hidden is mostly one row, [H]: the buffer's own shape, so no reshape,
    # which would be a torch call more per message (4 us here, and a GIL hand-off).
    return flat if len(shape) == 1 else flat.reshape(shape)


def decode_hiddens(msg: pb.Tensor, field: str) -> torch.Tensor:
    """A Prefill chunk's hiddens, their NaN/inf check left to the engine: torch's threads
    take 177 us for 2047 rows of 4096 where one numpy thread takes 2.8 ms (H200 host)."""
    return read_tensor(msg, field, HIDDEN_DTYPES)


def grammar(msg: pb.AllocStateRequest) -> GrammarSpec | None:
    """An AllocState's grammar, if it has one (Grammar.none: none)."""
    return grammar_spec(msg.grammar, "grammar") if msg.HasField("grammar") else None


def grammar_spec(msg: pb.Grammar, field: str) -> GrammarSpec | None:
    """A Grammar message as a spec, None for Grammar.none; INVALID_ARGUMENT where it
    names no grammar."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(
            f"{field}: set, but none of its kinds is", reason="MISSING_FIELD", field=field
        )
    if kind == "none":
        if not msg.none:
            raise InvalidArgument(
                f"{field}: none is false, which names no grammar (none = true clears it; "
                "leave the field unset to keep it)",
                reason="GRAMMAR_KIND",
                field=field,
            )
        return None
    return GrammarSpec(kind, getattr(msg, kind))


def grammar_change(msg: pb.Grammar) -> GrammarChange:
    """A propose row's Grammar as the change it makes, or as the row's refusal."""
    try:
        return GrammarChange(grammar_spec(msg, "grammar"))
    except InvalidArgument as err:
        return GrammarChange(None, error=err)


def prefill_chunk(msg: pb.PrefillChunk) -> PrefillChunk:
    has_rows = msg.HasField("hiddens") or bool(msg.tokens)
    return PrefillChunk(
        state_id=msg.state_id,
        start_position=msg.start_position,
        total_rows=msg.total_rows,
        tokens=list(msg.tokens),
        hiddens=decode_hiddens(msg.hiddens, "hiddens") if has_rows else None,
    )


def verdict(msg: pb.Verdict, field: str) -> Verdict:
    if not msg.HasField("refeed_hiddens"):
        return Verdict(msg.num_accepted)
    refeed = read_tensor(msg.refeed_hiddens, f"{field}.refeed_hiddens", HIDDEN_DTYPES)
    return Verdict(msg.num_accepted, refeed)


def sampling(msg: pb.SamplingParams) -> Sampling:
    """Sampling parameters as the engine takes them (checked there)."""
    return Sampling(msg.temperature, msg.top_k, msg.top_p, msg.min_p, msg.seed)


def propose(msg: pb.ProposeRequest, shape: StepShape) -> Step:
    """A ProposeRequest as a Step of one row."""
    if not msg.HasField("hidden"):
        raise InvalidArgument("hidden: required", reason="MISSING_FIELD", field="hidden")
    return single(
        msg.state_id,
        msg.token,
        read_tensor(msg.hidden, "hidden", HIDDEN_DTYPES),
        msg.position,
        msg.num_drafts,
        bitmask=(
            read_tensor(msg.bitmask, "bitmask", (pb.DTYPE_INT32,))
            if msg.HasField("bitmask")
            else None
        ),
        min_confidence=msg.min_confidence,
        previous=verdict(msg.previous, "previous") if msg.HasField("previous") else None,
        step_number=msg.step_number,
        sampling=sampling(msg.sampling) if msg.HasField("sampling") else None,
        draft_cap=msg.draft_cap,
        verify_token_cost=msg.verify_token_cost,
        grammar=grammar_change(msg.grammar) if msg.HasField("grammar") else None,
        shape=shape,
    )


def _optional_tensor(msg: pb.Tensor, field: str, allowed: tuple[int, ...]) -> torch.Tensor | None:
    return read_tensor(msg, field, allowed) if msg.ByteSize() else None


def batch(msg: pb.ProposeBatchRequest, shape: StepShape) -> Step:
    """A ProposeBatchRequest's columns as a Step (tensors over a copy of the message's
    bytes), or INVALID_ARGUMENT when they do not fit together."""
    if not msg.HasField("hiddens"):
        raise InvalidArgument("hiddens: required", reason="MISSING_FIELD", field="hiddens")
    return columns.step(
        shape,
        state_ids=list(msg.state_ids),
        tokens=list(msg.tokens),
        positions=list(msg.positions),
        hiddens=read_tensor(msg.hiddens, "hiddens", HIDDEN_DTYPES),
        num_drafts=list(msg.num_drafts),
        num_accepted=list(msg.num_accepted),
        refeed_rows=list(msg.refeed_rows),
        refeed_hiddens=_optional_tensor(msg.refeed_hiddens, "refeed_hiddens", HIDDEN_DTYPES),
        bitmask_rows=list(msg.bitmask_rows),
        bitmasks=_optional_tensor(msg.bitmasks, "bitmasks", (pb.DTYPE_INT32,)),
        min_confidence=list(msg.min_confidence),
        step_numbers=list(msg.step_numbers),
        sampling_rows=list(msg.sampling_rows),
        sampling=[sampling(p) for p in msg.sampling],
        draft_caps=list(msg.draft_caps),
        verify_token_costs=list(msg.verify_token_costs),
        grammar_rows=list(msg.grammar_rows),
        grammars=[grammar_change(g) for g in msg.grammars],
    )


def kv_header(msg: pb.KVHeader) -> KVHeader:
    if msg.dtype not in HIDDEN_DTYPES:
        raise InvalidArgument(
            f"header.dtype: {msg.dtype} is not a KV dtype", reason="BAD_DTYPE", field="header.dtype"
        )
    return KVHeader(
        model_fingerprint=msg.model_fingerprint,
        model_family=msg.model_family,
        dtype=DTYPES[msg.dtype],
        num_kv_heads=msg.num_key_value_heads,
        head_dim=msg.head_dim,
        num_rows=msg.num_rows,
        grammar=_held_grammar(msg),
    )


def _held_grammar(msg: pb.KVHeader) -> HeldGrammar | None:
    """The grammar of an imported KV's state, with the tokens its matcher consumed."""
    spec = grammar_spec(msg.grammar, "header.grammar") if msg.HasField("grammar") else None
    if spec is None:
        if msg.grammar_tokens:
            raise InvalidArgument(
                "header.grammar_tokens: given without a grammar",
                reason="MISSING_FIELD",
                field="header.grammar",
            )
        return None
    return HeldGrammar(spec, list(msg.grammar_tokens))


def read_kv_chunk(msg: pb.KVChunk) -> KVChunk:
    """An ImportKV message: its header (first), its rows' K and V (absent: no rows)."""
    has_rows = msg.HasField("k") or msg.HasField("v")
    return KVChunk(
        header=kv_header(msg.header) if msg.HasField("header") else None,
        first_row=msg.first_row,
        k=read_tensor(msg.k, "k", HIDDEN_DTYPES) if has_rows else None,
        v=read_tensor(msg.v, "v", HIDDEN_DTYPES) if has_rows else None,
        state_id=msg.state_id,
    )


# --- out: the engine's results as responses -------------------------------------------


def info(served: ServerInfo, max_message_bytes: int) -> pb.GetInfoResponse:
    """GetInfo's answer: every field of the engine's EngineInfo and of the serving loop's
    counters under its own name (tests/service/test_get_info_fields.py keeps the names
    one set with the message's), and what the server itself takes."""
    loop = {f.name: getattr(served, f.name) for f in dataclasses.fields(served)}
    engine = dataclasses.asdict(loop.pop("engine"))
    return pb.GetInfoResponse(
        **engine, **loop, hidden_dtypes=HIDDEN_DTYPES, max_message_bytes=max_message_bytes
    )


def tensor(t: torch.Tensor) -> pb.Tensor:
    """A CPU tensor as a Tensor message: its raw little-endian bytes."""
    t = t.contiguous()
    raw = t.view(_BITS[t.element_size()]) if t.is_floating_point() else t
    return pb.Tensor(dtype=DTYPE_ENUM[t.dtype], shape=t.shape, data=raw.numpy().tobytes())


def kv_chunk(chunk: KVChunk) -> pb.KVChunk:
    """An ExportKV answer."""
    msg = pb.KVChunk(first_row=chunk.first_row)
    if (h := chunk.header) is not None:
        msg.header.model_fingerprint = h.model_fingerprint
        msg.header.model_family = h.model_family
        msg.header.dtype = DTYPE_ENUM[h.dtype]
        msg.header.num_key_value_heads = h.num_kv_heads
        msg.header.head_dim = h.head_dim
        msg.header.num_rows = h.num_rows
        if h.grammar is not None:
            setattr(msg.header.grammar, h.grammar.spec.kind, h.grammar.spec.source)
            msg.header.grammar_tokens.extend(h.grammar.tokens)
    if chunk.k is not None and chunk.v is not None:
        msg.k.CopyFrom(tensor(chunk.k))
        msg.v.CopyFrom(tensor(chunk.v))
    return msg


def proposal(step: Step, result: StepResult, with_bitmasks: bool = False) -> pb.Proposal:
    """A Propose's answer: the drafts of its step's one row (drafted: no error), and with
    `with_bitmasks` its grammar's bitmasks, where its state has a grammar."""
    n = int(result.counts[0])
    masks = result.grammar_masks.get(0) if with_bitmasks else None
    answer = pb.Proposal(
        state_id=int(step.state_ids[0]),
        tokens=result.drafts[0, :n].tolist(),
        probs=result.probs[0, :n].tolist(),
        confidence=float(result.confidences[0]),
        first_position=int(result.first_positions[0]),
        bitmasks=None if masks is None else tensor(masks),
    )
    if result.q_ids is not None:
        answer.q_support = result.q_ids.shape[2]
        answer.q_ids.extend(result.q_ids[0, :n].ravel().tolist())
        answer.q_probs.extend(result.q_probs[0, :n].ravel().tolist())
    return answer


# Which column a per-state request's field comes from, for the errors of a row.
COLUMN_OF_FIELD = {
    "state_id": "state_ids",
    "token": "tokens",
    "position": "positions",
    "hidden": "hiddens",
    "num_drafts": "num_drafts",
    "bitmask": "bitmasks",
    "min_confidence": "min_confidence",
    "draft_cap": "draft_caps",
    "verify_token_cost": "verify_token_costs",
    "previous.num_accepted": "num_accepted",
    "previous.refeed_hiddens": "refeed_hiddens",
    "step_number": "step_numbers",
    "grammar": "grammars",
}


def batch_answer(
    request_id: int, result: StepResult, failed: dict[int, pb.Error], with_bitmasks: bool = False
) -> pb.ProposeBatchResponse:
    """A step's result as a ProposeBatchResponse, column by column; `failed` holds the
    failed rows' errors (their columns are -1 and 0 already); with `with_bitmasks`, the
    grammar states' bitmasks, row by row."""
    answer = pb.ProposeBatchResponse(
        request_id=request_id,
        width=result.drafts.shape[1],
        drafts=result.drafts.ravel().tolist(),
        probs=result.probs.ravel().tolist(),
        draft_counts=result.counts.tolist(),
        confidences=result.confidences.tolist(),
        first_positions=result.first_positions.tolist(),
        errors=[pb.RowError(row=row, error=error) for row, error in sorted(failed.items())],
    )
    if result.q_ids is not None:
        answer.q_support = result.q_ids.shape[2]
        answer.q_ids.extend(result.q_ids.ravel().tolist())
        answer.q_probs.extend(result.q_probs.ravel().tolist())
    if with_bitmasks and result.grammar_masks:
        rows = result.grammar_masks
        b = len(result.counts)
        answer.bitmask_rows.extend(len(rows[i]) if i in rows else 0 for i in range(b))
        answer.bitmasks.CopyFrom(tensor(torch.cat([rows[i] for i in sorted(rows)])))
    return answer
