"""The engine's errors: one class per outcome a caller must tell apart.

The engine knows nothing of gRPC; the servicer maps each class to its status
code. `reason` is a stable machine-readable word, `field` names the offending
request field where there is one.
"""

from __future__ import annotations


class DrafterError(Exception):
    """A request the engine refused; the state it names is unchanged."""

    def __init__(self, message: str, *, reason: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field


class NotFound(DrafterError):
    """The state or KV handle does not exist (never did, freed, or its lease ran out)."""


class InvalidArgument(DrafterError):
    """The request is malformed: shape, dtype, token, position or a count out of range."""


class FailedPrecondition(DrafterError):
    """The request is well-formed but does not fit the state's current step."""


class ResourceExhausted(DrafterError):
    """No free KV blocks or state slots."""


class Unavailable(DrafterError):
    """The engine is draining and takes no new states."""


class DeadlineExceeded(DrafterError):
    """The caller's deadline passed before the request was computed."""


# --- refusals that several calls share, each naming its field


def not_finite(field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: holds NaN or infinite values", reason="NOT_FINITE", field=field
    )


def position_mismatch(position: int, expected: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: position {position} does not continue the state, which expects {expected}",
        reason="POSITION_MISMATCH",
        field=field,
    )


def position_out_of_range(position: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: {position} is before a state's first row, at position 1",
        reason="POSITION_OUT_OF_RANGE",
        field=field,
    )


def position_too_large(last_row: int, limit: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: row at position {last_row + 1} exceeds the model's "
        f"max_position_embeddings ({limit})",
        reason="POSITION_TOO_LARGE",
        field=field,
    )


def num_accepted_negative(a: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}.num_accepted: {a} is negative",
        reason="NUM_ACCEPTED_OUT_OF_RANGE",
        field=f"{field}.num_accepted",
    )


def num_accepted_out_of_range(a: int, k: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}.num_accepted: {a} is outside [0, {k}] (the proposal had {k} drafts)",
        reason="NUM_ACCEPTED_OUT_OF_RANGE",
        field=f"{field}.num_accepted",
    )
