"""The addresses the server listens on: whether one is free, checked before the model
loads and again before gRPC binds it, so that one in use is refused with its reason."""

from __future__ import annotations

import errno
import os
import socket
import stat

# How long a connection to a Unix socket file may take to tell whether a server accepts
# on it (a live one answers at once, even when busy).
UNIX_PROBE_S = 1.0


class ListenError(OSError):
    """An address the server cannot listen on, and why."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"cannot listen on {address}: {why}")
        self.address = address


def check_free(address: str) -> None:
    """Raises ListenError where another server listens on `address` ("host:port", or
    "unix:PATH") already. gRPC's own bind refuses a taken port too (SO_REUSEPORT off), but
    only logs why, and it replaces a Unix socket file whatever listens on it."""
    if address.startswith("unix:"):
        _check_unix_socket(address.removeprefix("unix:"), address)
    else:
        _check_port(address)


def _check_port(address: str) -> None:
    """A port some socket listens on (any of the host's addresses) is taken; port 0 never
    is. Other errors (an address not on this host) are left for gRPC's bind to report."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        found = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return
    for family, kind, proto, _, where in found:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC's listener: a port whose connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ListenError(address, "the port is in use (another server?)") from exc


def _check_unix_socket(path: str, address: str) -> None:
    """A socket file something accepts on is live and must not be replaced; a stale one
    (its server gone) may be, as gRPC does."""
    if not os.path.lexists(path):
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise ListenError(address, "its folder does not exist")
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ListenError(address, "the path exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(UNIX_PROBE_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale
        except TimeoutError:
            pass  # bound and listening, its backlog full: live
        except OSError as exc:
            raise ListenError(address, f"cannot tell whether a server uses it ({exc})") from exc
    raise ListenError(address, "a server accepts connections on this socket")
