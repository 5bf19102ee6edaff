"""Servers that ask the client commands for their security options: mutual TLS and a
token on 127.0.0.1, a token on a Unix socket (both in-process, on the test checkpoint)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from certificates import cert, new_key, pem
from servers import InProcessServer, small_engine

from mtpdraft.service.security import server_credentials

TOKEN = "client-command-token-0123"


@dataclass
class SecuredServers:
    tls_address: str  # mutual TLS (a client certificate of `ca`) and TOKEN, on 127.0.0.1
    unix_target: str  # plaintext and TOKEN, on a Unix socket: unix:PATH
    ca: Path
    client_cert: Path
    client_key: Path
    token_file: Path


@contextlib.contextmanager
def start_secured_servers(checkpoint: Path, folder: Path) -> Iterator[SecuredServers]:
    """Both servers, their certificates and token file written to `folder`."""
    ca_key, server_key, client_key = new_key(), new_key(), new_key()
    ca = cert("mtpdraft test CA", ca_key, ca=True)
    files = {
        "ca.pem": pem(ca),
        "server.pem": pem(cert("localhost", server_key, ca, ca_key, server=True)),
        "server.key": pem(server_key),
        "client.pem": pem(cert("verifier", client_key, ca, ca_key)),
        "client.key": pem(client_key),
        "token": f"{TOKEN}\n".encode(),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    pair = (folder / "server.pem", folder / "server.key")
    credentials = server_credentials(*pair, client_ca_file=folder / "ca.pem")
    tls = InProcessServer(small_engine(checkpoint), credentials=credentials, tokens=[TOKEN])
    socket = folder / "drafter.sock"
    unix = InProcessServer(small_engine(checkpoint), unix_socket=str(socket), tokens=[TOKEN])
    try:
        yield SecuredServers(
            tls.address, f"unix:{socket}", folder / "ca.pem", folder / "client.pem",
            folder / "client.key", folder / "token",
        )  # fmt: skip
    finally:
        tls.stop()
        unix.stop()
