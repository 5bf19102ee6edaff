"""The wire's tensors and Propose requests (a ProposeColumns step's too) as the engine
takes them (torch tensors).

`wire_values.py` reads and checks them (in a front-end process, for the split
server); this turns its plain values into the engine's arguments.
"""

from __future__ import annotations

import torch

from mtpdraft.v1 import drafter_pb2 as pb

from .engine.columns import Columns
from .engine.errors import InvalidArgument
from .engine.types import ProposeArgs, Verdict
from .wire_values import HIDDEN_DTYPES, RawPropose, RawTensor, RawVerdict, read_tensor

DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_BF16: torch.bfloat16,
    pb.DTYPE_FP16: torch.float16,
    pb.DTYPE_FP32: torch.float32,
    pb.DTYPE_INT32: torch.int32,
}


def to_tensor(raw: RawTensor) -> torch.Tensor:
    """A CPU tensor over the raw value's buffer (no copy)."""
    dtype = DTYPES[raw.dtype]
    if not raw.data:
        return torch.empty(raw.shape, dtype=dtype)
    flat = torch.frombuffer(raw.data, dtype=dtype)
    # A Propose's hidden is mostly one row, [H]: the buffer's own shape, so no reshape,
    # which would be a torch call more per message (4 us here, and a GIL hand-off).
    return flat if len(raw.shape) == 1 else flat.reshape(raw.shape)


def decode_hiddens(msg: pb.Tensor, field: str) -> torch.Tensor:
    """A Prefill chunk's hiddens, their NaN/inf check left to the engine: torch's threads
    take 177 us for 2047 rows of 4096 where one numpy thread takes 2.8 ms (H200 host)."""
    return to_tensor(read_tensor(msg, field, HIDDEN_DTYPES))


def verdict(raw: RawVerdict) -> Verdict:
    refeed = raw.refeed_hiddens
    if refeed is None:
        return Verdict(raw.num_accepted)
    return Verdict(raw.num_accepted, to_tensor(refeed), refeed_finite=refeed.finite)


def propose_args(raw: RawPropose) -> ProposeArgs:
    return ProposeArgs(
        state_id=raw.state_id,
        token=raw.token,
        hidden=to_tensor(raw.hidden),
        position=raw.position,
        num_drafts=raw.num_drafts,
        bitmask=None if raw.bitmask is None else to_tensor(raw.bitmask),
        min_confidence=raw.min_confidence,
        previous=None if raw.previous is None else verdict(raw.previous),
        hidden_finite=raw.hidden.finite,
    )


def _optional_tensor(msg: pb.Tensor, field: str, allowed: tuple[int, ...]) -> torch.Tensor | None:
    return to_tensor(read_tensor(msg, field, allowed)) if msg.ByteSize() else None


def columns(msg: pb.ColumnsRequest) -> Columns:
    """A ColumnsRequest's columns as the engine takes them (tensors over the message's bytes)."""
    if not msg.HasField("hiddens"):
        raise InvalidArgument("hiddens: required", reason="MISSING_FIELD", field="hiddens")
    hiddens = to_tensor(read_tensor(msg.hiddens, "hiddens", HIDDEN_DTYPES))
    return Columns(
        state_ids=list(msg.state_ids),
        tokens=list(msg.tokens),
        positions=list(msg.positions),
        hiddens=hiddens if hiddens.dim() != 1 else hiddens.reshape(1, -1),
        num_drafts=list(msg.num_drafts),
        num_accepted=list(msg.num_accepted),
        refeed_rows=list(msg.refeed_rows),
        refeed_hiddens=_optional_tensor(msg.refeed_hiddens, "refeed_hiddens", HIDDEN_DTYPES),
        bitmask_rows=list(msg.bitmask_rows),
        bitmasks=_optional_tensor(msg.bitmasks, "bitmasks", (pb.DTYPE_INT32,)),
        min_confidence=list(msg.min_confidence),
    )
