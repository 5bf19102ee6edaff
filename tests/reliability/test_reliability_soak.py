"""A soak: thousands of randomized verifier sessions from several processes, every block
accounted for throughout, and nothing left once the leases have run out.

Workers (reliability_soak_worker.py, one process each) run sessions for
MTPDRAFT_SOAK_SECONDS (20 by default), and for at least 50 sessions each however slow
the machine, against one server with a 1.5 s state TTL. Each publishes an upper bound
on what the server may hold for it; every 0.2 s the monitor here checks GetInfo
against the sum: blocks in use <= the blocks of the states and handles the clients
know of (abandoned ones until their lease and the reaper's delay have passed, a delay
that follows the measured pace of the machine), and the same for live states and
handles. At the end, after the TTL: no state, no handle, every block free.

The figures are printed (pytest -s); MTPDRAFT_SOAK_REPORT=1 also writes them to
tests/reliability/soak_report.json (or to the path it names). MTPDRAFT_SOAK_WORKERS
sets the number of processes (4).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from pathlib import Path

import reliability_soak_worker as worker
from reliability_support import PATIENCE, ManagedServer, Pace, server_args, used_blocks, wait_clean

SECONDS = float(os.environ.get("MTPDRAFT_SOAK_SECONDS", "20"))
WORKERS = int(os.environ.get("MTPDRAFT_SOAK_WORKERS", "4"))
TTL = 1.5
LEAST_SESSIONS = 50  # per worker
# The least delay past its lease before the reaper frees an abandoned state; it is also
# LEASE_FACTOR times the slowest step measured on this machine (`pace`).
REAPER_DELAY = 5.0
# Codes a session may meet: refused requests, leases run out under load, its own cuts.
EXPECTED = {
    "NOT_FOUND",
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
}


class Monitor:
    """Checks the server's counters against the workers' published bounds."""

    def __init__(self, server: ManagedServer, shared, lock) -> None:
        self.server, self.shared, self.lock = server, shared, lock
        self.checks, self.max_used, self.max_states = 0, 0, 0
        self.violations: list[str] = []

    def check(self) -> None:
        slots = worker.SLOTS
        with self.lock:  # from now on each peak is the largest bound since this moment
            for w in range(WORKERS):
                for base in range(w * slots, w * slots + 6, 2):
                    self.shared[base + 1] = self.shared[base]
        info = self.server.info()
        with self.lock:
            peaks = [
                sum(self.shared[w * slots + 2 * i + 1] for w in range(WORKERS)) for i in range(3)
            ]
        held = (used_blocks(info), info.live_states, info.kv_handles)
        for name, got, bound in zip(("blocks", "states", "handles"), held, peaks, strict=True):
            if got > bound:
                self.violations.append(f"{name}: server holds {got}, clients know of {bound}")
        self.checks += 1
        self.max_used = max(self.max_used, held[0])
        self.max_states = max(self.max_states, held[1])

    def sessions(self) -> int:
        with self.lock:
            return sum(self.shared[w * worker.SLOTS + worker.SESSIONS] for w in range(WORKERS))


def test_soak_every_block_is_accounted_for(mimo_checkpoint, pace: Pace) -> None:
    limits = {"kv_blocks": 8192, "max_states": 512, "max_batch": 8}
    server = ManagedServer(mimo_checkpoint, *server_args(TTL, **limits))
    ctx = multiprocessing.get_context("spawn")  # no fork: grpc's threads do not survive it
    shared, lock, results = (
        ctx.Array("q", WORKERS * worker.SLOTS, lock=False),
        ctx.Lock(),
        ctx.Queue(),
    )
    slack = pace.lease(REAPER_DELAY)
    procs = [
        ctx.Process(
            target=worker.run,
            args=(i, server.address, shared, lock, results),
            kwargs={"seconds": SECONDS, "least": LEAST_SESSIONS, "seed": 1000 + i}
            | {"ttl": TTL, "slack": slack},
            daemon=True,
        )
        for i in range(WORKERS)
    ]
    monitor = Monitor(server, shared, lock)
    started = time.monotonic()
    try:
        for proc in procs:
            proc.start()
        # The workers must make progress: a session ends now and then, however slowly.
        progress, progressed_at = 0, time.monotonic()
        while any(p.is_alive() for p in procs):
            if (sessions := monitor.sessions()) > progress:
                progress, progressed_at = sessions, time.monotonic()
            assert time.monotonic() - progressed_at < PATIENCE, "the workers are stuck"
            monitor.check()
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        figures = [results.get(timeout=PATIENCE) for _ in procs]
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        monitor.check()
        after_workers = server.info()
        clean = wait_clean(server)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        assert server.alive(), "the server died"
        assert server.stop() == 0
    server.assert_no_traceback()

    stats, errors = Counter(), Counter()
    for _, s, e in figures:
        stats.update(s)
        errors.update(e)
    report = {
        "seconds": round(elapsed, 1),
        "workers": WORKERS,
        "state_ttl_seconds": TTL,
        "reaper_delay_seconds": round(slack, 1),
        "sessions": stats["sessions"],
        "rpcs": stats["rpcs"],
        "rpcs_per_second": round(stats["rpcs"] / elapsed),
        "rpcs_by_method": {k[4:]: v for k, v in sorted(stats.items()) if k.startswith("rpc.")},
        "stream_messages": stats["stream_messages"],
        "streams": stats["streams"],
        "drafts": stats["drafts"],
        "hand_overs": stats["hand_overs"],
        "abandoned_states": stats["abandoned_states"],
        "abandoned_handles": stats["abandoned_handles"],
        "faults": {k[6:]: v for k, v in sorted(stats.items()) if k.startswith("fault.")},
        "errors_by_code": dict(sorted(errors.items())),
        "invariant_checks": monitor.checks,
        "invariant_violations": len(monitor.violations),
        "max_blocks_used": monitor.max_used,
        "max_live_states": monitor.max_states,
        "held_when_workers_ended": {
            "states": after_workers.live_states,
            "handles": after_workers.kv_handles,
            "blocks": used_blocks(after_workers),
        },
        "blocks_leaked": used_blocks(clean),
        "states_leaked": clean.live_states,
        "handles_leaked": clean.kv_handles,
    }
    print("\nsoak report: " + json.dumps(report, indent=2))
    if target := os.environ.get("MTPDRAFT_SOAK_REPORT"):
        path = Path(__file__).with_name("soak_report.json") if target == "1" else Path(target)
        path.write_text(json.dumps(report, indent=2) + "\n")

    assert not monitor.violations, monitor.violations[:10]
    assert set(errors) <= EXPECTED, errors
    assert stats["sessions"] >= WORKERS * LEAST_SESSIONS, "a worker stopped early"
    assert report["blocks_leaked"] == report["states_leaked"] == report["handles_leaked"] == 0
