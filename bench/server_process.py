"""A bench server in a subprocess on loopback: the script prints "PORT n" once it
serves and stops when its stdin closes."""

from __future__ import annotations

import subprocess
import threading


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
