"""Transport security and call authentication: TLS / mutual TLS and bearer tokens.

TLS uses grpcio's own server credentials (`server_credentials`); with a client
CA the server requires a client certificate signed by it. Bearer tokens are
checked by `TokenAuthInterceptor`, a grpc.aio server interceptor placed before
every other interceptor: a call without `authorization: Bearer <token>` metadata
naming one of the configured tokens ends with UNAUTHENTICATED before anything
else sees it. The standard health service is exempt so that probes need no
token; reflection is not.

The token file holds one token per line (several during a rotation; blank lines
are ignored) and is the whole truth: it is re-read at most once a second, so a
token can be rotated without restarting the server (add the new one, move the
clients over, remove the old one), and a token removed from it is refused from
the next reading on. An empty or deleted file accepts no token at all (fail
closed). A file that cannot be read (e.g. permissions) or holds a line no
client could send (a character outside printable ASCII) says nothing about
which tokens to revoke: the tokens read before stay until it reads again. Each
such change is logged once. At start, any of these is an error. A call is
checked when it starts, and a client stream (ProposeStream, Prefill) again at
each message it sends: one opened before its token's removal ends there.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import inspect
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from .refusals import refusals

log = logging.getLogger("mtpdraft.security")

# Calls to these method prefixes need no token: liveness / readiness probes.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
_SCHEME = "bearer"
_REVOKED = "unauthenticated: the bearer token was revoked"
# What a token may hold: printable ASCII, as a gRPC metadata value.
_PRINTABLE = re.compile(rb"[\x20-\x7e]+")


class TokenFileError(ValueError):
    """The token file cannot be read, holds a line no client could send, or holds no token."""


def read_file(path: str | os.PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


def server_credentials(
    cert_file: str | os.PathLike,
    key_file: str | os.PathLike,
    client_ca_file: str | os.PathLike | None = None,
) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; with `client_ca_file`, clients must present a
    certificate signed by that CA (mutual TLS)."""
    cert = read_file(cert_file, "TLS certificate")
    key = read_file(key_file, "TLS key")
    client_ca = None if client_ca_file is None else read_file(client_ca_file, "client CA")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def parse_tokens(text: str | bytes) -> tuple[bytes, ...]:
    """The tokens of a token file's text: one per line, blank lines and spaces around
    ignored. TokenFileError for a line with a character outside printable ASCII,
    which no gRPC metadata value can carry."""
    if isinstance(text, str):
        text = text.encode()
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token:
            continue
        if not _PRINTABLE.fullmatch(token):  # the token itself is a secret: not in the message
            raise TokenFileError(f"line {number} holds a character outside printable ASCII")
        tokens.append(token)
    return tuple(tokens)


def load_tokens(path: str | os.PathLike) -> tuple[bytes, ...]:
    """The file's tokens, at least one; TokenFileError otherwise (a server's start)."""
    tokens = _read_tokens(path)
    if tokens is None:
        raise TokenFileError(f"cannot read the token file {path}: {os.strerror(errno.ENOENT)}")
    if not tokens:
        raise TokenFileError(f"the token file {path} holds no token")
    return tokens


def _read_tokens(path: str | os.PathLike) -> tuple[bytes, ...] | None:
    """The file's tokens, None where there is no file; TokenFileError where it cannot
    be read or holds a line no client could send."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    try:
        return parse_tokens(text)
    except TokenFileError as exc:
        raise TokenFileError(f"the token file {path}: {exc}") from None


class TokenSource:
    """The accepted tokens: fixed, or read from a file and re-read at most every
    `reload_interval` seconds (see the module's docstring for what a change does)."""

    def __init__(
        self,
        tokens: Sequence[str | bytes] = (),
        *,
        path: str | os.PathLike | None = None,
        reload_interval: float = 1.0,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.reload_interval = reload_interval
        self._checked = time.monotonic()
        if self.path is not None:
            self._tokens = load_tokens(self.path)
            # What the last reading found: tokens, None (no file) or why it failed.
            self._outcome: tuple[bytes, ...] | str | None = self._tokens
        else:
            self._tokens = tuple(t.encode() if isinstance(t, str) else t for t in tokens)
            if not self._tokens or not all(self._tokens):
                raise TokenFileError("give at least one non-empty token")

    def tokens(self) -> tuple[bytes, ...]:
        if self.path is not None:
            now = time.monotonic()
            if now - self._checked >= self.reload_interval:
                self._checked = now
                self._reload()
        return self._tokens

    def _reload(self) -> None:
        # Read every time, not on a changed mtime: a rewrite within the file system's
        # timestamp resolution to the same size would otherwise go unseen.
        try:
            outcome: tuple[bytes, ...] | str | None = _read_tokens(self.path)
        except TokenFileError as exc:
            outcome = str(exc)
        if outcome == self._outcome:
            return
        self._outcome = outcome
        if isinstance(outcome, str):  # unreadable or garbled: revokes nothing
            log.warning("%s; keeping the %d tokens read before", outcome, len(self._tokens))
        elif not outcome:
            self._tokens = ()
            state = "is gone" if outcome is None else "holds no token"
            log.warning("the token file %s %s: every call is refused", self.path, state)
        else:
            self._tokens = outcome
            log.info("token file %s reloaded: %d tokens", self.path, len(outcome))

    def accepts(self, token: bytes) -> bool:
        # Compare with every token, in constant time each, so the time taken tells
        # nothing about which token (or which prefix) came close.
        matches = [hmac.compare_digest(token, known) for known in self.tokens()]
        return any(matches)


async def _unauthenticated(context: grpc.aio.ServicerContext, message: str) -> None:
    """Ends the call with UNAUTHENTICATED; a debug line says so (refusals.py)."""
    if refusals.enabled():
        refusals.refused("UNAUTHENTICATED", None, "authorization", context.peer(), message)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


def _abort_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts.

    It has no request deserializer: an unauthenticated request is never parsed.
    """

    async def abort(_request, context: grpc.aio.ServicerContext) -> None:
        await _unauthenticated(context, message)

    # An unknown method is answered as a bidirectional stream: the abort goes out at
    # once whatever the client's kind, and an unauthenticated caller cannot probe
    # which methods exist.
    request_streaming = handler.request_streaming if handler is not None else True
    response_streaming = handler.response_streaming if handler is not None else True
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


def _rechecking_handler(
    handler: grpc.RpcMethodHandler, tokens: TokenSource, token: bytes
) -> grpc.RpcMethodHandler:
    """`handler` of a client stream, made to end with UNAUTHENTICATED at the first
    message read once `token` is revoked: a stream can outlive the token it opened with."""

    async def while_accepted(requests: AsyncIterator, context: grpc.aio.ServicerContext):
        async for request in requests:
            if not tokens.accepts(token):
                await _unauthenticated(context, _REVOKED)
            yield request

    behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
    if inspect.isasyncgenfunction(behavior):

        async def rechecked(requests, context):
            # Closed here rather than by the garbage collector: its cleanup runs at once.
            async with contextlib.aclosing(
                behavior(while_accepted(requests, context), context)
            ) as out:
                async for response in out:
                    yield response

    else:

        async def rechecked(requests, context):
            return await behavior(while_accepted(requests, context), context)

    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(
        rechecked,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` naming an accepted token, and
    ends a client stream at its first message after its token was revoked."""

    def __init__(self, tokens: TokenSource, exempt: Sequence[str] = EXEMPT_PREFIXES) -> None:
        self.tokens = tokens
        self.exempt = tuple(exempt)

    def _bearer(self, metadata) -> tuple[bytes, str | None]:
        """The call's token, and why the call is refused (None if the token is accepted)."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return b"", "missing 'authorization: Bearer <token>' metadata"
        if len(values) > 1:
            return b"", "more than one authorization metadata entry"
        value = values[0]
        if isinstance(value, str):
            value = value.encode()
        scheme, _, token = value.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != _SCHEME.encode() or not token:
            return b"", "the authorization metadata must be 'Bearer <token>'"
        if not self.tokens.accepts(token):
            return token, "invalid bearer token"
        return token, None

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if method.startswith(self.exempt):
            return await continuation(handler_call_details)
        token, refusal = self._bearer(handler_call_details.invocation_metadata)
        # A refused call's handler only tells the method's streaming kind: no behaviour
        # runs (the interceptors after this one, telemetry's included, start their work
        # when the behaviour does).
        handler = await continuation(handler_call_details)
        if refusal is not None:
            return _abort_handler(handler, f"unauthenticated: {refusal}")
        if handler is not None and handler.request_streaming:
            return _rechecking_handler(handler, self.tokens, token)
        return handler
