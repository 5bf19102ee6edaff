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
