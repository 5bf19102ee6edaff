"""Channel credentials of the clients: TLS, mutual TLS and a bearer token.

The token travels as gRPC call credentials (`grpc.access_token_call_credentials`,
which sends `authorization: Bearer <token>` on every call, streams included),
composed with the channel's credentials. Call credentials need a secure
transport, so:

* with TLS (``root_certificates``, or ``tls=True`` for the system's roots) they
  are composed with ``grpc.ssl_channel_credentials``;
* without TLS they are composed with ``grpc.local_channel_credentials``: a
  plaintext connection that gRPC allows only to a loopback address or a Unix
  socket (tests, a sidecar proxy), and that it refuses to open to another host,
  so a token never crosses the network in the clear.

One mechanism serves the blocking and the asyncio clients alike and every call
kind (the ``ProposeStream`` calls too), with no Python interceptor on the hot path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

PemSource = bytes | str | os.PathLike
"""PEM bytes, or the path (str or PathLike) of a PEM file."""


def read_pem(source: PemSource | None) -> bytes | None:
    """The PEM bytes of `source`: bytes as they are, a str or PathLike read from its file."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


def _local_connection_type(target: str) -> grpc.LocalConnectionType:
    if target.startswith(("unix:", "unix-abstract:")):
        return grpc.LocalConnectionType.UDS
    return grpc.LocalConnectionType.LOCAL_TCP


def channel_credentials(
    target: str,
    *,
    tls: bool = False,
    root_certificates: PemSource | None = None,
    private_key: PemSource | None = None,
    certificate_chain: PemSource | None = None,
    token: str | None = None,
) -> grpc.ChannelCredentials | None:
    """The credentials of a channel to `target`, or None for a plain insecure channel."""
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain go together (a client certificate)")
    if token is not None and (not token.strip() or any(c in token for c in "\r\n")):
        raise ValueError("token must be non-empty and on one line")
    tls = tls or root_certificates is not None or private_key is not None
    if tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=read_pem(root_certificates),
            private_key=read_pem(private_key),
            certificate_chain=read_pem(certificate_chain),
        )
    elif token is not None:
        creds = grpc.local_channel_credentials(_local_connection_type(target))
    else:
        return None
    if token is not None:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token.strip())
        )
    return creds


def open_channel(
    grpc_module: Any,
    target: str,
    options: Sequence[tuple[str, Any]] | None,
    interceptors: Sequence[Any] | None = None,
    **security: Any,
) -> Any:
    """A channel of `grpc_module` (``grpc`` or ``grpc.aio``) to `target`: secure when
    `security` (the keywords of `channel_credentials`) asks for TLS or a token.
    `interceptors`: an asyncio channel's, given at its creation."""
    credentials = channel_credentials(target, **security)
    extra = {"interceptors": list(interceptors)} if interceptors else {}
    if credentials is None:
        return grpc_module.insecure_channel(target, options=list(options or ()), **extra)
    return grpc_module.secure_channel(target, credentials, options=list(options or ()), **extra)


def asks_for_security(*, tls: bool = False, **sources: Any) -> bool:
    """Whether the client's security keywords ask for anything."""
    return tls or any(v is not None for v in sources.values())
