"""Transport security and call authentication: TLS / mutual TLS and bearer tokens.

TLS uses grpcio's own server credentials (`server_credentials`); with a client
CA the server requires a client certificate signed by it. Bearer tokens are
checked by `TokenAuthInterceptor`, a grpc.aio server interceptor placed before
every other interceptor: a call without `authorization: Bearer <token>` metadata
naming one of the configured tokens ends with UNAUTHENTICATED before anything
else sees it. The standard health service is exempt so that probes need no
token; reflection is not.

The token file holds one token per line (several during a rotation; blank lines
are ignored). It is re-read when it changes, at most once a second, so a token
can be rotated without restarting the server: add the new one, move the
clients over, remove the old one.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

log = logging.getLogger("mtpdraft.security")

# Calls to these method prefixes need no token: liveness / readiness probes.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
_SCHEME = "bearer"


class TokenFileError(ValueError):
    """The token file cannot be read or holds no token."""


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
    """The tokens of a token file's text: one per line, blank lines and spaces ignored."""
    if isinstance(text, str):
        text = text.encode()
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def load_tokens(path: str | os.PathLike) -> tuple[bytes, ...]:
    try:
        tokens = parse_tokens(Path(path).read_bytes())
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if not tokens:
        raise TokenFileError(f"the token file {path} holds no token")
    return tokens


class TokenSource:
    """The accepted tokens: fixed, or read from a file and re-read when it changes."""

    def __init__(
        self,
        tokens: Sequence[str | bytes] = (),
        *,
        path: str | os.PathLike | None = None,
        reload_interval: float = 1.0,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.reload_interval = reload_interval
        self._signature: tuple[int, int, int] | None = None
        self._checked = time.monotonic()
        if self.path is not None:
            self._signature = self._stat()
            self._tokens = load_tokens(self.path)
        else:
            self._tokens = tuple(t.encode() if isinstance(t, str) else t for t in tokens)
            if not self._tokens or not all(self._tokens):
                raise TokenFileError("give at least one non-empty token")

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def tokens(self) -> tuple[bytes, ...]:
        if self.path is None:
            return self._tokens
        now = time.monotonic()
        if now - self._checked >= self.reload_interval:
            self._checked = now
            signature = self._stat()
            if signature != self._signature:
                self._signature = signature
                self._reload()
        return self._tokens

    def _reload(self) -> None:
        try:
            tokens = load_tokens(self.path)
        except TokenFileError as exc:
            # Half-written or removed: keep the tokens we have rather than lock everyone out.
            log.warning("%s; keeping the %d tokens loaded before", exc, len(self._tokens))
            return
        log.info("token file %s reloaded: %d tokens", self.path, len(tokens))
        self._tokens = tokens

    def accepts(self, token: bytes) -> bool:
        # Compare with every token, in constant time each, so the time taken tells
        # nothing about which token (or which prefix) came close.
        matches = [hmac.compare_digest(token, known) for known in self.tokens()]
        return any(matches)


def _abort_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts.

    It has no request deserializer: an unauthenticated request is never parsed.
    """

    async def abort(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

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


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` naming an accepted token."""

    def __init__(self, tokens: TokenSource, exempt: Sequence[str] = EXEMPT_PREFIXES) -> None:
        self.tokens = tokens
        self.exempt = tuple(exempt)

    def _refusal(self, metadata) -> str | None:
        """Why the call is refused, or None if it carries an accepted token."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        if len(values) > 1:
            return "more than one authorization metadata entry"
        value = values[0]
        if isinstance(value, str):
            value = value.encode()
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() != _SCHEME.encode() or not token.strip():
            return "the authorization metadata must be 'Bearer <token>'"
        if not self.tokens.accepts(token.strip()):
            return "invalid bearer token"
        return None

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if method.startswith(self.exempt):
            return await continuation(handler_call_details)
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return await continuation(handler_call_details)
        # Only to learn the method's streaming kind: no behaviour runs (the interceptors
        # after this one, telemetry's included, start their work when the behaviour does).
        handler = await continuation(handler_call_details)
        return _abort_handler(handler, f"unauthenticated: {refusal}")
