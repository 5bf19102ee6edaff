"""deploy/local.py as an operator drills with it: the command itself, three replicas behind
nginx, each replica's PID, address and log as it prints them. A replica killed (SIGKILL)
leaves nginx and the others answering, and comes back on its address on `restart N`; a
replica stopped (SIGSTOP) keeps its keys and states and answers again on SIGCONT; the
ring is reloaded from its file on SIGHUP or `reload`; `quit` drains everything and keeps
the logs. The tests run in order on one topology, each leaving it whole."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from conftest import REPLICAS, assert_same_drafts, keys_by_replica
from servers import PATIENCE, SERVER_ARGS
from verifiers import Verifier

from mtpdraft.client import DeadlineExceeded, DrafterClient, DrafterError, Replicas

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local.py"
CUT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@dataclass
class Printed:
    """A replica as the tool prints it."""

    pid: int
    address: str
    log: Path


@dataclass
class Tool:
    """`deploy/local.py` running, its output read line by line."""

    process: subprocess.Popen
    folder: Path
    output: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    seen: list[str] = field(default_factory=list)
    replicas: list[Printed] = field(default_factory=list)
    proxy: str = ""
    proxy_pid: int = 0
    proxy_log: Path | None = None

    def __post_init__(self) -> None:
        def read() -> None:
            for line in self.process.stdout:
                self.output.put(line)

        threading.Thread(target=read, daemon=True).start()

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def expect(self, pattern: str) -> re.Match:
        """The next printed line that matches `pattern` (a regex searched in each)."""
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                line = self.output.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"never printed {pattern!r}:\n{''.join(self.seen)}") from None
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match

    def quit(self) -> int:
        if self.process.poll() is None:
            self.send("quit")
        try:
            return self.process.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            self.process.kill()  # its replicas and nginx get SIGTERM as it dies
            return self.process.wait()


@pytest.fixture(scope="module")
def tool(nginx, mimo_checkpoint, tmp_path_factory) -> Iterator[Tool]:
    folder = tmp_path_factory.mktemp("drills")
    serve = ["--model", str(mimo_checkpoint), "--device", "cpu", *SERVER_ARGS]
    argv = [sys.executable, str(LOCAL), "--replicas", str(REPLICAS), "--port", "0"]
    process = subprocess.Popen(
        [*argv, "--dir", str(folder), "--", *serve],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    t = Tool(process, folder)
    try:
        for n in range(REPLICAS):
            m = t.expect(rf"^local: replica {n} pid (\d+) (\S+) log (\S+)$")
            t.replicas.append(Printed(int(m[1]), m[2], Path(m[3])))
        m = t.expect(r"^local: proxy (\S+) pid (\d+) .* log (\S+)$")
        t.proxy, t.proxy_pid, t.proxy_log = m[1], int(m[2]), Path(m[3])
        t.expect(r"^local: commands ")
        yield t
    finally:
        t.quit()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def epoch_of(address: str) -> int:
    with DrafterClient(address, timeout=PATIENCE) as c:
        return c.info().instance_epoch


def key_epochs(proxy: DrafterClient) -> dict[int, str]:
    """A key the proxy sends to each replica, by the replica's instance epoch."""
    return {epoch: keys for epoch, (keys,) in keys_by_replica(proxy, per_replica=1).items()}


def reaches(proxy: DrafterClient, key: str, epoch: int) -> bool:
    return proxy.keyed(key).info().instance_epoch == epoch


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def free_everywhere(tool: Tool, verifiers: list[Verifier]) -> None:
    """Frees each verifier's states on the replica that holds them, by its epoch."""
    by_epoch = {epoch_of(r.address): r.address for r in tool.replicas if alive(r.pid)}
    for v in verifiers:
        for s in v.seqs:
            if (s.state >> 43) in by_epoch:
                with DrafterClient(by_epoch[s.state >> 43], timeout=PATIENCE) as c:
                    c.free_state(s.state)


def test_it_prints_each_replicas_pid_address_and_log_and_nginxs(tool: Tool) -> None:
    for r in tool.replicas:
        assert alive(r.pid)
        assert "serve" in Path(f"/proc/{r.pid}/cmdline").read_text()
        assert epoch_of(r.address) >= 0  # it answers there
        assert f"listening on {r.address}" in r.log.read_text()  # its log: a file, kept
        assert r.log.parent == tool.folder
    assert alive(tool.proxy_pid) and tool.proxy_log.exists()
    config = (tool.proxy_log.parent / "nginx.conf").read_text()
    assert all(f"server {r.address} " in config for r in tool.replicas)
    ring = (tool.folder / "ring").read_text().splitlines()
    assert [line for line in ring if not line.startswith("#")] == [r.address for r in tool.replicas]


def test_a_killed_replica_leaves_the_others_serving_and_restarts_on_its_address(
    tool: Tool,
) -> None:
    victim = tool.replicas[0]
    with DrafterClient(tool.proxy, timeout=PATIENCE) as proxy:
        keys = key_epochs(proxy)
        old_epoch = epoch_of(victim.address)
        verifiers = {epoch: Verifier(10 + i, key, 1) for i, (epoch, key) in enumerate(keys.items())}
        for v in verifiers.values():
            v.run(proxy.keyed(v.key), 1)
        os.kill(victim.pid, signal.SIGKILL)
        tool.expect(rf"replica 0 \(pid {victim.pid}, {victim.address}\) ended, killed by SIGKILL")
        for epoch, v in verifiers.items():
            v.run_more(proxy.keyed(v.key), 2, retry=lambda err: err.code in CUT)
            if epoch == old_epoch:  # lost with its replica, rebuilt on the next one
                assert v.recoveries == 1 and len(v.epochs) == 2
            else:  # through the same nginx, untouched
                assert (v.recoveries, v.epochs) == (0, {epoch})
        assert tool.process.poll() is None and alive(tool.proxy_pid)

        tool.send("restart 0")
        m = tool.expect(rf"replica 0 pid (\d+) {victim.address} restarted")
        assert int(m[1]) != victim.pid and alive(int(m[1]))
        new_epoch = epoch_of(victim.address)  # the same address, a new instance
        assert new_epoch != old_epoch
        wait_for(lambda: reaches(proxy, keys[old_epoch], new_epoch), "its key came back")
        tool.replicas[0] = Printed(int(m[1]), victim.address, victim.log)
        free_everywhere(tool, list(verifiers.values()))


def live_states(tool: Tool) -> dict[int, int]:
    """GetInfo.live_states of each running replica, by its instance epoch."""
    counts = {}
    for r in tool.replicas:
        if alive(r.pid):
            with DrafterClient(r.address, timeout=PATIENCE) as c:
                info = c.info()
                counts[info.instance_epoch] = info.live_states
    return counts


def test_a_restarted_replica_takes_its_keys_back_and_their_states_move_with_them(
    tool: Tool, reference
) -> None:
    """Killed, replica 0's states are lost and re-prefilled on the next replica; restarted
    on its address, it takes its keys back, and each state there moves back to it from the
    replica that holds it (`recover_state` with the replicas' own addresses): no second
    re-prefill, no state left behind until its lease ends, the drafts those of one server."""
    victim = tool.replicas[0]
    addresses = [r.address for r in tool.replicas]
    with (
        DrafterClient(tool.proxy, timeout=PATIENCE) as proxy,
        Replicas(addresses, timeout=PATIENCE) as replicas,
    ):
        keys = key_epochs(proxy)
        old_epoch = epoch_of(victim.address)
        verifiers = {
            epoch: Verifier(30 + i, key, 2, replicas=replicas)
            for i, (epoch, key) in enumerate(keys.items())
        }
        for v in verifiers.values():
            v.run(proxy.keyed(v.key), 1)
        os.kill(victim.pid, signal.SIGKILL)
        tool.expect(rf"replica 0 \(pid {victim.pid}, {victim.address}\) ended, killed by SIGKILL")
        for v in verifiers.values():
            v.run_more(proxy.keyed(v.key), 2, retry=lambda err: err.code in CUT)
        lost = verifiers[old_epoch]
        assert (lost.recoveries, lost.moves) == (1, 0)  # its replica died: rebuilt elsewhere
        (neighbour,) = {s.state >> 43 for s in lost.seqs}

        tool.send("restart 0")
        m = tool.expect(rf"replica 0 pid (\d+) {victim.address} restarted")
        tool.replicas[0] = Printed(int(m[1]), victim.address, victim.log)
        new_epoch = epoch_of(victim.address)
        wait_for(lambda: reaches(proxy, keys[old_epoch], new_epoch), "its key came back")
        for v in verifiers.values():
            v.run_more(proxy.keyed(v.key), 2, retry=lambda err: err.code in CUT)
        assert (lost.recoveries, lost.moves) == (2, 2)  # both states moved back, not rebuilt
        assert {s.state >> 43 for s in lost.seqs} == {new_epoch} != {neighbour}
        for epoch, v in verifiers.items():
            if epoch != old_epoch:
                assert (v.recoveries, v.epochs) == (0, {epoch})
        # Nothing left behind: each replica holds its keys' states, and no other.
        held = Counter(s.state >> 43 for v in verifiers.values() for s in v.seqs)
        assert live_states(tool) == {epoch: held[epoch] for epoch in live_states(tool)}
        for v in verifiers.values():
            assert_same_drafts(v, reference(v.seed, 2))
        free_everywhere(tool, list(verifiers.values()))


def test_a_stopped_replica_keeps_its_keys_and_states(tool: Tool) -> None:
    victim = tool.replicas[1]
    with DrafterClient(tool.proxy, timeout=PATIENCE) as proxy:
        keys = key_epochs(proxy)
        stopped_epoch = epoch_of(victim.address)
        verifiers = {epoch: Verifier(20 + i, key, 1) for i, (epoch, key) in enumerate(keys.items())}
        for v in verifiers.values():
            v.run(proxy.keyed(v.key), 1)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            for epoch, v in verifiers.items():
                if epoch != stopped_epoch:
                    v.run_more(proxy.keyed(v.key), 1)
            key = keys[stopped_epoch]
            with (
                DrafterClient(tool.proxy, timeout=1.0, affinity_key=key) as c,
                pytest.raises(DeadlineExceeded),
            ):
                c.info()  # it hangs; nginx passes the wait on, and moves no key
            tool.send("status")
            tool.expect(rf"replica 1 pid {victim.pid} {victim.address} running, on the ring")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        for v in verifiers.values():
            v.run_more(proxy.keyed(v.key), 1)
            assert v.recoveries == 0 and len(v.epochs) == 1  # no state lost
        assert reaches(proxy, keys[stopped_epoch], stopped_epoch)
        free_everywhere(tool, list(verifiers.values()))


def test_a_reload_takes_a_replica_off_the_ring_and_back(tool: Tool) -> None:
    ring = tool.folder / "ring"
    whole = ring.read_text()
    out = tool.replicas[2]
    with DrafterClient(tool.proxy, timeout=PATIENCE) as proxy:
        keys = key_epochs(proxy)
        out_epoch = epoch_of(out.address)
        stay_epoch, stay_key = next((e, k) for e, k in keys.items() if e != out_epoch)
        ring.write_text(whole.replace(f"{out.address}\n", f"# {out.address}\n"))
        os.kill(tool.process.pid, signal.SIGHUP)
        tool.expect(r"ring reloaded: 2 replicas")
        # nginx's old workers finish their connections' calls: the key moves a moment later.
        wait_for(lambda: not reaches(proxy, keys[out_epoch], out_epoch), "its key moved")
        assert reaches(proxy, stay_key, stay_epoch)  # only the removed replica's keys move
        assert epoch_of(out.address) == out_epoch  # off the ring, still serving

        ring.write_text("# no replica\n")
        tool.send("reload")
        tool.expect(r"ring not reloaded, nginx routes as before: nginx refused the new config")
        assert reaches(proxy, stay_key, stay_epoch)

        ring.write_text(whole)
        with (tool.folder / "control").open("w") as control:
            control.write("reload\n")
        tool.expect(r"ring reloaded: 3 replicas")
        wait_for(lambda: reaches(proxy, keys[out_epoch], out_epoch), "its key came back")


def test_quit_stops_nginx_and_drains_the_replicas_keeping_their_logs(tool: Tool) -> None:
    assert tool.quit() == 0
    assert not alive(tool.proxy_pid)
    for r in tool.replicas:
        assert not alive(r.pid)
        assert "mtpdraft: stopped; freed 0 live states" in r.log.read_text()
    with pytest.raises(DrafterError), DrafterClient(tool.proxy, timeout=5.0) as c:
        c.info()  # nothing listens there any more
