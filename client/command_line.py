"""What the client commands (``mtpdraft loadtest``, ``mtpdraft info``) share: the server's
target and the clients' TLS, mutual TLS and token options.

The options map one to one onto the clients' keywords (``DrafterClient(...,
root_certificates=, private_key=, certificate_chain=, token=)``): ``--tls-ca FILE`` (or
``--tls`` for the system's roots) turns TLS on, ``--tls-cert`` with ``--tls-key`` present a
client certificate, ``--token-file`` sends its first line as a bearer token. Files are read
once, when the command starts.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# gRPC's own URI schemes: whatever follows is the resolver's to check.
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.%\w]+\]|[^\s/\[\]:]+):(\d{1,5})$")


class OptionError(ValueError):
    """A client option that cannot be used (a file that cannot be read, a target without a port)."""


def check_target(target: str) -> str:
    """`target` if gRPC can dial it: HOST:PORT, [IPv6]:PORT, or a gRPC URI (unix:PATH,
    dns:///HOST:PORT, ipv4:..., ...). A bare host is refused: gRPC would dial its port 443."""
    target = target.strip()
    if target.startswith(_SCHEMES):
        return target
    match = _HOST_PORT.match(target)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise OptionError(
            f"--target {target!r}: give HOST:PORT (e.g. drafter.internal:50051, [::1]:50051) "
            "or unix:PATH"
        )
    return target


@dataclass(frozen=True)
class Security:
    """The clients' security keywords, their PEM files and token already read."""

    tls: bool = False
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    token: str | None = None
    server_name: str | None = None  # the name the server's certificate must hold

    def client_keywords(self) -> dict[str, Any]:
        """Keywords for DrafterClient / AsyncDrafterClient."""
        options = []
        if self.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return dict(
            tls=self.tls,
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
            token=self.token,
            options=options,
        )

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.root_certificates is not None or self.private_key is not None

    def describe(self) -> str:
        """What a report may say of it (never the token or a key)."""
        transport = "plaintext"
        if self.uses_tls:
            transport = "mutual TLS" if self.private_key is not None else "TLS"
        return transport + (", bearer token" if self.token is not None else "")

    def hint(self) -> str:
        """A likely cause of a failure to connect, or ''."""
        if self.token is not None and not self.uses_tls:
            return (
                " (note: without TLS a token is sent only to a loopback address or a Unix "
                "socket; --tls or --tls-ca FILE for another)"
            )
        return ""


def add_target_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--target",
        default=default,
        metavar="HOST:PORT",
        help=f"the server: HOST:PORT, [IPv6]:PORT or unix:PATH (default: {default})",
    )


def add_security_options(parser: argparse.ArgumentParser) -> None:
    """The clients' TLS, mutual TLS and token options, in a group of their own."""
    group = parser.add_argument_group("security (as the clients' keywords)")
    group.add_argument(
        "--tls",
        action="store_true",
        help="TLS, trusting the system's root certificates (default: plaintext)",
    )
    group.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="TLS, trusting this PEM's certificates (default: none, plaintext)",
    )
    group.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="a client certificate (PEM), with --tls-key: mutual TLS (default: none)",
    )
    group.add_argument(
        "--tls-key", metavar="FILE", help="the client certificate's key (PEM) (default: none)"
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must hold, when the target's host is "
        "another (default: the target's host)",
    )
    group.add_argument(
        "--token-file",
        metavar="FILE",
        help="send its first line as 'authorization: Bearer <token>' on every call; without "
        "TLS only to a loopback address or Unix socket (default: no token)",
    )


def _read(path: str | None, option: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise OptionError(f"{option} {path}: cannot read it ({err.strerror})") from None


def security_from_args(args: argparse.Namespace) -> Security:
    """The Security of parsed `add_security_options` options; OptionError names a bad one."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise OptionError("--tls-cert and --tls-key go together (a client certificate)")
    token = None
    if args.token_file is not None:
        lines = _read(args.token_file, "--token-file").decode(errors="replace").splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise OptionError(f"--token-file {args.token_file}: its first line holds no token")
    return Security(
        tls=args.tls,
        root_certificates=_read(args.tls_ca, "--tls-ca"),
        private_key=_read(args.tls_key, "--tls-key"),
        certificate_chain=_read(args.tls_cert, "--tls-cert"),
        token=token,
        server_name=args.tls_server_name,
    )
