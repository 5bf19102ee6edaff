#!/usr/bin/env python3
"""The replicated topology on one host, for development: N `mtpdraft serve` replicas on
loopback behind Debian's nginx, which routes every call by its x-mtpdraft-affinity key
(consistent hashing: one key, one replica).

    python3 deploy/local.py --replicas 3 --port 50050 -- --device cpu
    # verifiers: DrafterClient("127.0.0.1:50050", affinity_key="engine-7")

Arguments after `--` go to every `mtpdraft serve`. Ctrl-C or SIGTERM stops nginx and
drains the replicas. nginx runs as this user with everything under a temporary folder
(config, pid, logs); `apt-get install nginx` provides it. What the topology needs and this
host lacks (nginx, the package, torch) is named before anything starts, each with how to
get it, in one line.

The tests and bench/bench_proxy.py start the same topology with `start_replicas` and
`start_proxy`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "nginx" / "local.conf.template"
ROUTES = HERE / "nginx" / "routes.conf"
START_TIMEOUT = 120.0
# Where Debian puts nginx: /usr/sbin is not on every user's PATH.
NGINX_ELSEWHERE = ("/usr/sbin/nginx",)
# The modules a replica (`python -m mtpdraft serve`, this interpreter) imports, and how to
# get each.
REPLICA_MODULES = {
    "mtpdraft": "pip install -e . (from the repository's root)",
    "torch": "pip install torch (README.md, Set up)",
}


def find_nginx() -> str | None:
    """nginx's path: on PATH, or where Debian puts it."""
    found = shutil.which("nginx")
    if found:
        return found
    return next((path for path in NGINX_ELSEWHERE if os.access(path, os.X_OK)), None)


def missing_requirements() -> list[str]:
    """What the topology needs and this host lacks, one line each, with how to get it."""
    missing = []
    if find_nginx() is None:
        missing.append("nginx is not installed (not on PATH, nor /usr/sbin): apt-get install nginx")
    for module, install in REPLICA_MODULES.items():
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} cannot be imported by {sys.executable}: {install}")
    return missing


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    """One `mtpdraft serve` process."""

    process: subprocess.Popen
    address: str
    log: list[str] = field(default_factory=list)

    def stop(self, timeout: float = START_TIMEOUT) -> int:
        """SIGTERM (the replica drains), then waits."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def kill(self) -> None:
        """SIGKILL: a replica that dies, its states with it."""
        self.process.kill()
        self.process.wait()


def stop_all(replicas: Sequence[Replica]) -> None:
    """SIGTERM to every replica at once (each drains), then waits for each."""
    for r in replicas:
        if r.process.poll() is None:
            r.process.terminate()
    for r in replicas:
        r.stop()


# Run as the replica's own first lines, after exec: SIGTERM when the process that started it
# dies (Linux; PR_SET_PDEATHSIG survives exec), so that a killed test or script leaves no
# replica behind. Not a preexec_fn: Python running in a forked child of a process whose gRPC
# threads are live can break the child's own gRPC (seen as epoll_wait: Bad file descriptor).
_STOP_WITH_PARENT = """
import contextlib, ctypes, runpy, signal, sys
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
sys.argv[0] = "mtpdraft"
runpy.run_module("mtpdraft", run_name="__main__", alter_sys=True)
"""


def start_replicas(count: int, serve_args: Sequence[str] = (), host: str = "127.0.0.1") -> list:
    """`count` replicas on free ports of `host`, started together; returns once all listen."""
    launcher = ["-c", _STOP_WITH_PARENT] if sys.platform == "linux" else ["-m", "mtpdraft"]
    cmd = [sys.executable, *launcher, "serve", "--host", host, "--port", "0"]
    processes = [
        subprocess.Popen(
            [*cmd, *serve_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(count)
    ]
    replicas = []
    try:
        for process in processes:
            lines = []
            for line in process.stdout:  # a replica prints its port once it takes calls
                lines.append(line)
                if match := re.search(r"listening on (\S+):(\d+)", line):
                    replicas.append(Replica(process, f"{host}:{match.group(2)}", lines))
                    break
            else:
                raise RuntimeError("a replica exited before listening:\n" + "".join(lines))
            _discard(process.stdout)  # read on, so that a chatty replica never blocks
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    return replicas


def _discard(stream) -> None:
    """Reads `stream` to its end on a thread of its own, keeping nothing."""
    threading.Thread(target=stream.read, daemon=True).start()


def render_config(replicas: Sequence[str], listen: str, prefix: Path) -> str:
    """The local proxy's nginx.conf: `replicas` (host:port) behind `listen` (host:port)."""
    servers = "\n".join(
        f"        server {address} max_fails=1 fail_timeout=5s;" for address in replicas
    )
    return string.Template(TEMPLATE.read_text()).substitute(
        prefix=prefix, servers=servers, listen=listen, routes=ROUTES
    )


@dataclass
class Proxy:
    """An nginx process in front of replicas."""

    process: subprocess.Popen
    address: str
    prefix: Path

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text() if path.exists() else ""

    def reload(self, replicas: Sequence[str]) -> None:
        """Routes to `replicas` from now on (a new ring): nginx re-reads its config."""
        (self.prefix / "nginx.conf").write_text(render_config(replicas, self.address, self.prefix))
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(START_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_proxy(
    replicas: Sequence[str], prefix: Path, port: int = 0, host: str = "127.0.0.1"
) -> Proxy:
    """nginx in front of `replicas` (host:port each) on `host`:`port` (0: a free one),
    with its config, pid, logs and temporary files under `prefix`; returns once it takes
    connections. RuntimeError if nginx is not installed or does not start."""
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError("nginx is not installed (apt-get install nginx)")
    prefix.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):  # a free port can be taken between the look and nginx's bind
        listen = f"{host}:{port or free_port(host)}"
        (prefix / "temp").mkdir(exist_ok=True)
        config = prefix / "nginx.conf"
        config.write_text(render_config(replicas, listen, prefix))
        (prefix / "error.log").write_text("")
        process = subprocess.Popen(
            [nginx, "-p", str(prefix), "-c", str(config), "-e", str(prefix / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        proxy = Proxy(process, listen, prefix)
        if _wait_listening(proxy):
            return proxy
        proxy.stop()
        failure = (process.stderr.read() if process.stderr else "") + proxy.error_log()
        if port or "Address already in use" not in failure or attempt == 4:
            raise RuntimeError(f"nginx did not start:\n{failure}")
    raise AssertionError("unreachable")


def _wait_listening(proxy: Proxy) -> bool:
    host, _, port = proxy.address.rpartition(":")
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proxy.process.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 1.0):
            return True
        time.sleep(0.05)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3, help="replicas (default: 3)")
    parser.add_argument("--port", type=int, default=50050, help="the proxy's port (0: free)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    for line in missing:
        print(f"local: {line}", file=sys.stderr)
    if missing:
        return 2
    try:
        replicas = start_replicas(args.replicas, serve_args, args.host)
    except RuntimeError as err:  # a replica that exits says why in its output
        print(f"local: {err}", file=sys.stderr)
        return 1
    for r in replicas:
        print(f"local: replica {r.address}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mtpdraft-nginx-") as tmp:
        try:
            proxy = start_proxy([r.address for r in replicas], Path(tmp), args.port, args.host)
        except BaseException as err:
            stop_all(replicas)
            if not isinstance(err, RuntimeError):
                raise
            print(f"local: {err}", file=sys.stderr)  # nginx's own words
            return 1
        print(f"local: proxy {proxy.address} (nginx, routing by x-mtpdraft-affinity)", flush=True)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        try:
            while not stop and all(r.process.poll() is None for r in replicas):
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        print("local: stopping", flush=True)
        proxy.stop()
        stop_all(replicas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
