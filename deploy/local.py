#!/usr/bin/env python3
"""Replicas behind nginx on one host, for development and drills: N `mtpdraft serve`
replicas on loopback behind Debian's nginx, which routes every call by its
x-mtpdraft-affinity key (consistent hashing: one key, one replica).

    python3 deploy/local.py --replicas 3 --port 50050 -- --device cpu
    # verifiers: DrafterClient("127.0.0.1:50050", affinity_key="engine-7")

Arguments after `--` go to every `mtpdraft serve`. It prints each replica's number, PID,
address and log file, and nginx's PID and logs; all of them live in one folder (--dir, or
a new temporary one, kept on exit). A replica that exits (killed, crashed or drained)
leaves nginx and the others serving; these commands, one a line on stdin or written to
the folder's `control` file, act on the topology:

    status      each replica's PID, address, whether it runs, and the ring
    restart N   replica N again, on its address
    reload      nginx routes by the folder's `ring` file (SIGHUP to this process too)
    quit        stop nginx, drain the replicas (Ctrl-C and SIGTERM too)

A replica restarts on request, not by itself: a drill keeps the fault and the recovery
apart, so that what the ring does meanwhile (its keys on the next replica) can be seen.
`--nginx-config k8s` runs nginx/k8s.conf instead of the local config, only what a cluster
has replaced by this host's (render_k8s_config). nginx runs as this user, its config, pid
and logs under the folder. What the topology needs and this host lacks (nginx, the
package, torch) is named before anything starts, each with how to get it, in one line.

The tests and bench/bench_proxy.py start the same topology with `start_replicas` and
`start_proxy`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import queue
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "nginx" / "local.conf.template"
ROUTES = HERE / "nginx" / "routes.conf"
K8S_CONF = HERE / "nginx" / "k8s.conf"
START_TIMEOUT = 120.0
# Where Debian puts nginx: /usr/sbin is not on every user's PATH.
NGINX_ELSEWHERE = ("/usr/sbin/nginx",)
# The modules a replica (`python -m mtpdraft serve`, this interpreter) imports, and how to
# get each.
REPLICA_MODULES = {
    "mtpdraft": "pip install -e . (from the repository's root)",
    "torch": "pip install torch (README.md, Set up)",
}
# When nginx stops sending a replica calls, its keys going to the next replica on the ring,
# in both configs (tests/deploy checks k8s.conf's): after 3 failed connections within 10 s,
# for 10 s. A refused connection moves only its own call, not the replica's keys.
SERVER_FAILURES = "max_fails=3 fail_timeout=10s"
COMMANDS = "status | restart N | reload | quit"


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


@functools.cache
def nginx_version(nginx: str) -> tuple[int, int, int]:
    """`nginx -v`'s version, e.g. (1, 22, 1)."""
    done = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=60)
    major, minor, patch = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", done.stderr).groups()
    return int(major), int(minor), int(patch)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# A child's first lines, after exec: SIGTERM when the thread that started it ends (Linux;
# PR_SET_PDEATHSIG survives exec), so that a killed test or script leaves no replica or
# nginx behind. Not a preexec_fn: Python running in a forked child of a process whose gRPC
# threads are live can break the child's own gRPC (seen as epoll_wait: Bad file descriptor).
_STOP_WITH_PARENT = """
import contextlib, ctypes, signal
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
"""
_REPLICA = (
    _STOP_WITH_PARENT
    + """
import runpy, sys
sys.argv[0] = "mtpdraft"
runpy.run_module("mtpdraft", run_name="__main__", alter_sys=True)
"""
)
_EXEC = (
    _STOP_WITH_PARENT
    + """
import os, sys
os.execv(sys.argv[1], sys.argv[1:])
"""
)


def _stopping_with_parent(argv: list[str]) -> list[str]:
    """`argv` (a program's path first) run so that it stops with this process's thread."""
    return [sys.executable, "-c", _EXEC, *argv] if sys.platform == "linux" else argv


def _launch(argv: Sequence[str], log: Path) -> subprocess.Popen:
    """`argv` started with its output appended to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def _listening_port(process: subprocess.Popen, log: Path, offset: int) -> int:
    """The port a replica prints in `log` (past `offset`) once it takes calls."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        if match := re.search(r"listening on \S+:(\d+)", text):
            return int(match.group(1))
        if process.poll() is not None or time.monotonic() > deadline:
            why = "exited" if process.poll() is not None else "did not listen in time"
            raise RuntimeError(f"a replica {why} ({log}):\n{text}")
        time.sleep(0.05)


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


@dataclass
class Replica:
    """One `mtpdraft serve` process; its output goes to `log`, across restarts."""

    process: subprocess.Popen
    address: str
    log: Path
    command: list[str] = field(repr=False)  # `mtpdraft serve` and its flags, but --port

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        """Whether the process is there (a stopped one, SIGSTOP, is)."""
        return self.process.poll() is None

    def restart(self) -> None:
        """Starts it again on its address, as a StatefulSet's pod comes back under its name;
        returns once it takes calls. RuntimeError while it runs, or if it cannot start."""
        if self.running():
            raise RuntimeError(f"{self.address} is running (pid {self.pid}): stop it first")
        offset = self.log.stat().st_size
        self.process = _launch([*self.command, "--port", self.address.rpartition(":")[2]], self.log)
        _listening_port(self.process, self.log, offset)

    def stop(self, timeout: float = START_TIMEOUT) -> int:
        """SIGTERM (the replica drains; SIGCONT, should it be stopped), then waits."""
        if self.running():
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)
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
        if r.running():
            r.process.terminate()
            r.process.send_signal(signal.SIGCONT)
    for r in replicas:
        r.stop()


def start_replicas(
    count: int,
    serve_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
) -> list[Replica]:
    """`count` replicas on free ports of `host`, started together, replica N writing to
    `log_dir`/replica-N.log (a new temporary folder if None); returns once all listen."""
    log_dir = Path(tempfile.mkdtemp(prefix="mtpdraft-replicas-")) if log_dir is None else log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    launcher = ["-c", _REPLICA] if sys.platform == "linux" else ["-m", "mtpdraft"]
    command = [sys.executable, *launcher, "serve", "--host", host, *serve_args]
    logs = [log_dir / f"replica-{n}.log" for n in range(count)]
    for log in logs:
        log.write_bytes(b"")
    processes = [_launch([*command, "--port", "0"], log) for log in logs]
    try:
        ports = [_listening_port(p, log, 0) for p, log in zip(processes, logs, strict=True)]
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    return [
        Replica(process, f"{host}:{port}", log, command)
        for process, port, log in zip(processes, ports, logs, strict=True)
    ]


def render_config(replicas: Sequence[str], listen: str, prefix: Path) -> str:
    """The local proxy's nginx.conf: `replicas` (host:port) behind `listen` (host:port)."""
    servers = "\n".join(f"        server {address} {SERVER_FAILURES};" for address in replicas)
    return string.Template(TEMPLATE.read_text()).substitute(
        prefix=prefix, servers=servers, listen=listen, routes=ROUTES
    )


def _once(text: str, pattern: str, replacement: str) -> str:
    """`text` with the one match of `pattern` replaced; ValueError where there is not one."""
    new, found = re.subn(pattern, lambda _: replacement, text, flags=re.M)
    if found != 1:
        raise ValueError(f"{K8S_CONF.name}: {pattern!r} found {found} times, not once")
    return new


def render_k8s_config(replicas: Sequence[str], listen: str, prefix: Path) -> str:
    """nginx/k8s.conf on this host, in front of `replicas` (host:port) on `listen`: only
    what a cluster has is replaced. Its replicas' DNS names (server lines, `resolve`) by
    the addresses, with the same parameters; the cluster's DNS resolver by 127.0.0.1
    (nothing is resolved); its ports by `listen` and, for the status server, a socket
    under `prefix`; its files by ones under `prefix`, nginx run in the foreground as the
    image runs it; and, on an nginx before 1.25.1 (Debian 12's 1.22), `http2 on` by the
    listen parameter. ValueError where k8s.conf no longer has a part as written."""
    text = K8S_CONF.read_text()
    (parameters,) = set(re.findall(r"^\s*server \S+ resolve (.+);$", text, re.M))
    servers = "".join(f"        server {address} {parameters};\n" for address in replicas)
    text = _once(text, r"(^\s*server \S+ resolve .+;\n)+", servers)
    text = _once(text, r"resolver kube-dns\.kube-system\S* ", "resolver 127.0.0.1 ")
    text = _once(text, r"^error_log /dev/stderr ", f"error_log {prefix}/error.log ")
    text = _once(text, r"^pid \S+;", f"pid {prefix}/nginx.pid;")
    text = _once(text, r"include /etc/nginx/mtpdraft/routes\.conf;", f"include {ROUTES};")
    proxy_port, status_port = re.findall(r"^\s*listen (\d+);$", text, re.M)
    http2 = ""
    nginx = find_nginx()
    if nginx is not None and nginx_version(nginx) < (1, 25, 1):
        text, http2 = _once(text, r"^\s*http2 on;\n", ""), " http2"
    text = _once(text, rf"listen {proxy_port};", f"listen {listen}{http2};")
    text = _once(text, rf"listen {status_port};", f"listen unix:{prefix}/status.sock;")
    temp = "".join(
        f"    {kind}_temp_path {prefix}/temp/{kind.removeprefix('client_')};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return "daemon off;\n" + _once(text, r"^http \{\n", "http {\n" + temp)


@dataclass
class Proxy:
    """An nginx process in front of replicas."""

    process: subprocess.Popen
    address: str
    prefix: Path
    nginx: str
    render: Callable[[Sequence[str], str, Path], str] = render_config

    @property
    def config(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def log(self) -> Path:
        return self.prefix / "error.log"

    def error_log(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def reload(self, replicas: Sequence[str]) -> None:
        """Routes to `replicas` from now on (a new ring): the new config checked by
        `nginx -t`, then re-read (SIGHUP; the old workers finish their calls).
        RuntimeError, the running config kept, where nginx refuses the new one."""
        candidate = self.prefix / "nginx.conf.new"
        candidate.write_text(self.render(replicas, self.address, self.prefix))
        done = subprocess.run(
            [self.nginx, "-t", "-q", "-p", str(self.prefix), "-c", str(candidate)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            candidate.unlink()
            raise RuntimeError(f"nginx refused the new config:\n{done.stderr.strip()}")
        candidate.replace(self.config)
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)
            try:
                self.process.wait(START_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_proxy(
    replicas: Sequence[str],
    prefix: Path,
    port: int = 0,
    host: str = "127.0.0.1",
    render: Callable[[Sequence[str], str, Path], str] = render_config,
) -> Proxy:
    """nginx in front of `replicas` (host:port each) on `host`:`port` (0: a free one),
    with its config (`render`'s: the local one, or render_k8s_config's), pid, logs and
    temporary files under `prefix`; returns once it takes connections. RuntimeError if
    nginx is not installed or does not start."""
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError("nginx is not installed (apt-get install nginx)")
    prefix.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):  # a free port can be taken between the look and nginx's bind
        listen = f"{host}:{port or free_port(host)}"
        (prefix / "temp").mkdir(exist_ok=True)
        config = prefix / "nginx.conf"
        config.write_text(render(replicas, listen, prefix))
        (prefix / "error.log").write_text("")
        argv = [nginx, "-p", str(prefix), "-c", str(config), "-e", str(prefix / "error.log")]
        process = subprocess.Popen(
            _stopping_with_parent(argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        proxy = Proxy(process, listen, prefix, nginx, render)
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


CONFIGS = {"local": render_config, "k8s": render_k8s_config}


def say(line: str) -> None:
    print(f"local: {line}", flush=True)


class Drills:
    """The running topology and the operator's commands on it: a replica that exits is
    told of and leaves the others serving; `restart N` brings it back on its address;
    `reload` routes by the ring file."""

    def __init__(self, replicas: list[Replica], proxy: Proxy, folder: Path) -> None:
        self.replicas, self.proxy = replicas, proxy
        self.routed = [r.address for r in replicas]  # the ring nginx routes by
        self.ring = folder / "ring"
        self.ring.write_text(
            "# The proxy's ring: one replica address (host:port) a line. A line removed or\n"
            "# commented out (#) takes that replica off the ring, its keys going to the\n"
            "# next replica on it. After an edit: `reload`, or SIGHUP to local.py\n"
            f"# (pid {os.getpid()}).\n" + "".join(f"{address}\n" for address in self.routed)
        )
        self.told: set[subprocess.Popen] = set()  # the processes whose end was told

    def watch(self) -> None:
        """Tells of each replica, and nginx, that ended since the last look."""
        for n, r in enumerate(self.replicas):
            if not r.running() and r.process not in self.told:
                self.told.add(r.process)
                say(
                    f"replica {n} (pid {r.pid}, {r.address}) ended, "
                    f"{_how_it_ended(r.process.returncode)}; nginx and the others serve on "
                    f"(`restart {n}` starts it again)"
                )
        nginx = self.proxy.process
        if nginx.poll() is not None and nginx not in self.told:
            self.told.add(nginx)
            say(f"nginx ended, {_how_it_ended(nginx.returncode)}; see {self.proxy.log}")

    def run(self, line: str) -> bool:
        """Runs one command line; False for `quit`."""
        match line.split():
            case []:
                pass
            case ["status"]:
                self.status()
            case ["restart", n] if n.isdigit() and int(n) < len(self.replicas):
                self.restart(int(n))
            case ["reload"]:
                self.reload()
            case ["quit"]:
                return False
            case _:
                say(f"unknown command {line.strip()!r}: {COMMANDS}")
        return True

    def status(self) -> None:
        for n, r in enumerate(self.replicas):
            state = "running" if r.running() else _how_it_ended(r.process.returncode)
            ring = "on the ring" if r.address in self.routed else "off the ring"
            say(f"replica {n} pid {r.pid} {r.address} {state}, {ring}; log {r.log}")
        proxy = self.proxy
        say(f"proxy pid {proxy.process.pid} {proxy.address}; ring {' '.join(self.routed)}")

    def restart(self, n: int) -> None:
        r = self.replicas[n]
        try:
            r.restart()
        except RuntimeError as err:
            say(f"replica {n} not restarted: {err}")
            return
        say(
            f"replica {n} pid {r.pid} {r.address} restarted, a new instance (its old states "
            f"answer STATE_LOST); log {r.log}"
        )

    def reload(self) -> None:
        lines = (line.split("#", 1)[0].strip() for line in self.ring.read_text().splitlines())
        ring = [line for line in lines if line]
        malformed = [a for a in ring if not re.fullmatch(r"\S+:\d+", a)]
        try:
            if malformed:
                raise RuntimeError(f"not host:port in {self.ring}: {' '.join(malformed)}")
            self.proxy.reload(ring)
        except RuntimeError as err:
            say(f"ring not reloaded, nginx routes as before: {err}")
            return
        self.routed = ring
        say(
            f"ring reloaded: {len(ring)} replicas, {' '.join(ring)} (nginx's old workers finish "
            "their calls)"
        )


def _read_commands(opened: Callable[[], TextIO], commands: queue.SimpleQueue) -> None:
    """Each line of the stream `opened()` gives onto `commands`, from a thread of its own."""

    def read() -> None:
        with contextlib.suppress(OSError, ValueError), opened() as stream:
            for line in stream:
                commands.put(line)

    threading.Thread(target=read, daemon=True).start()


def _stdin_is_ours() -> bool:
    """False where reading stdin would stop this process: a terminal it runs in the
    background of (`local.py ... &`)."""
    try:
        return not os.isatty(0) or os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _control_file(folder: Path) -> Path:
    """A named pipe in `folder` that commands can be written to (`echo reload > FILE`)."""
    path = folder / "control"
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def _open_control(path: Path) -> TextIO:
    """The control pipe, for reading and writing: with this process a writer, a reader
    never meets its end between one `echo` and the next."""
    return open(os.open(path, os.O_RDWR))


def serve_drills(drills: Drills, folder: Path) -> None:
    """Runs commands from stdin, the control file and signals until `quit`. Everything
    happens on this thread: PR_SET_PDEATHSIG ties each child to the thread that started it."""
    commands: queue.SimpleQueue = queue.SimpleQueue()
    signal.signal(signal.SIGHUP, lambda *_: commands.put("reload"))
    signal.signal(signal.SIGTERM, lambda *_: commands.put("quit"))
    control = _control_file(folder)
    _read_commands(lambda: _open_control(control), commands)
    if _stdin_is_ours():
        _read_commands(lambda: sys.stdin, commands)
    say(f"commands ({COMMANDS}) on stdin or to {control}; SIGHUP (pid {os.getpid()}) reloads")
    try:
        while True:
            drills.watch()
            try:
                line = commands.get(timeout=0.2)
            except queue.Empty:
                continue
            if not drills.run(line):
                return
    except KeyboardInterrupt:
        pass


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
    parser.add_argument(
        "--nginx-config", choices=sorted(CONFIGS), default="local",
        help="local: nginx/local.conf.template; k8s: nginx/k8s.conf, its cluster's names "
        "replaced by this host's (default: local)",
    )  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, help="the replicas' logs, nginx's files, the ring (default: a new "
        "temporary folder); kept on exit",
    )  # fmt: skip
    args = parser.parse_args(argv)
    missing = missing_requirements()
    for line in missing:
        print(f"local: {line}", file=sys.stderr)
    if missing:
        return 2
    folder = args.dir or Path(tempfile.mkdtemp(prefix="mtpdraft-local-"))
    folder.mkdir(parents=True, exist_ok=True)
    say(f"folder {folder}: the replicas' logs, nginx's config and logs, the ring")
    try:
        replicas = start_replicas(args.replicas, serve_args, args.host, folder)
    except RuntimeError as err:  # a replica that exits says why in its output
        print(f"local: {err}", file=sys.stderr)
        return 1
    for n, r in enumerate(replicas):
        say(f"replica {n} pid {r.pid} {r.address} log {r.log}")
    try:
        addresses = [r.address for r in replicas]
        render = CONFIGS[args.nginx_config]
        proxy = start_proxy(addresses, folder / "nginx", args.port, args.host, render)
    except BaseException as err:
        stop_all(replicas)
        if not isinstance(err, RuntimeError):
            raise
        print(f"local: {err}", file=sys.stderr)  # nginx's own words
        return 1
    say(
        f"proxy {proxy.address} pid {proxy.process.pid} (nginx, routing by x-mtpdraft-affinity); "
        f"config {proxy.config}, log {proxy.log}"
    )
    drills = Drills(replicas, proxy, folder)
    say(f"ring {drills.ring}: edit it, then `reload`")
    try:
        serve_drills(drills, folder)
    finally:
        say("stopping: nginx, then the replicas drain")
        proxy.stop()
        stop_all(replicas)
        say(f"logs kept in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
