"""A bench server in a subprocess on loopback: the script prints "PORT n" once it
serves and stops when its stdin closes. Its threads' CPU time is read from
/proc (Linux), so that a bench can tell how busy the server's event loop was."""

from __future__ import annotations

import bisect
import os
import subprocess
import threading
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ServerProcess:
    """Starts `cmd` and waits (at most `start_timeout` seconds) for its "PORT n" line."""

    def __init__(self, cmd: list[str], start_timeout: float) -> None:
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline()))
        reader.start()
        reader.join(start_timeout)
        if not line or not line[0].startswith("PORT "):
            self.stop()
            raise RuntimeError(f"{cmd[1]} did not start a server (exit {self.process.poll()})")
        self.target = f"127.0.0.1:{int(line[0].split()[1])}"

    def stop(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def cpu_s(self) -> tuple[float, float] | None:
        """CPU seconds so far of the main thread (the server's asyncio loop) and of all
        its other threads together; None where /proc cannot tell (not Linux).

        Two reads, whatever the thread count: the process total (clock ticks, exited
        threads included) less the main thread (nanoseconds). Reading every thread's
        schedstat took 134 us for 8 threads, and the sampler shares a process (and
        its GIL) with the bench's in-process clients.
        """
        pid = self.process.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
                main = int(f.read().split()[0]) * 1e-9
            with open(f"/proc/{pid}/stat") as f:  # after the ")" of comm: utime, stime
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        total = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        return main, max(total - main, 0.0)


class CpuTrace:
    """Samples a server's CPU (ServerProcess.cpu_s) every `period` seconds while in use,
    so that the CPU spent in any window of time.monotonic() can be read afterwards."""

    def __init__(self, server: ServerProcess, period: float = 0.02) -> None:
        self.server, self.period = server, period
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, main, other)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CpuTrace:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            cpu = self.server.cpu_s()
            if cpu is not None:
                self.samples.append((time.monotonic(), *cpu))
            if self._stop.wait(self.period):
                return

    def _at(self, t: float) -> tuple[float, float]:
        i = min(max(bisect.bisect(self.samples, (t,)), 1), len(self.samples) - 1)
        (t0, m0, o0), (t1, m1, o1) = self.samples[i - 1], self.samples[i]
        w = 0.0 if t1 == t0 else min(max((t - t0) / (t1 - t0), 0.0), 1.0)
        return m0 + w * (m1 - m0), o0 + w * (o1 - o0)

    def between(self, start: float, end: float) -> tuple[float, float] | None:
        """CPU seconds of the main thread and of the others from `start` to `end`."""
        if len(self.samples) < 2:
            return None
        (m0, o0), (m1, o1) = self._at(start), self._at(end)
        return m1 - m0, o1 - o0


def cpu_per_message(
    spent: tuple[float, float], messages: int, window: tuple[float, float]
) -> dict[str, float]:
    """A server's CPU over a window: its event loop's and its other threads' (the engine
    thread, gRPC's poller) per message, and the share of the window the loop was busy."""
    loop, others = spent
    return {
        "loop_us_per_message": loop / messages * 1e6,
        "others_us_per_message": others / messages * 1e6,
        "loop_busy": loop / (window[1] - window[0]),
    }
