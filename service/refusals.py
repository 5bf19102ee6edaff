"""Log lines about refused requests, rate-limited so that no client can flood the log.

`Throttle` is a token bucket per key: `burst` lines at once, then `rate` a second;
a line let through after some were held back says how many. The servicer (and the
token check) log every refused request at debug through `refusals`, one bucket per
reason: a client that repeats one bad request gets a few lines, then one a second,
while a refusal of another reason still shows at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mtpdraft.refusals")

# At most REFUSAL_BURST lines of one reason at once, then REFUSAL_RATE a second.
REFUSAL_BURST = 10
REFUSAL_RATE = 1.0


@dataclass
class _Bucket:
    tokens: float
    at: float  # when tokens was counted
    held: int = 0  # lines held back since the last one let through


class Throttle:
    """A token bucket per key: `burst` lines at once, refilled at `rate` a second."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str) -> int | None:
        """None: hold this line back; else the lines of `key` held back before it."""
        now = self.clock()
        bucket = self._buckets.setdefault(key, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens < 1:
            bucket.held += 1
            return None
        bucket.tokens -= 1
        held, bucket.held = bucket.held, 0
        return held


class RefusalLog:
    """One debug line per refused request (its code, reason, field, the client and the
    message), `throttle`d per reason. Costs one level check when debug is off."""

    def __init__(self, throttle: Throttle) -> None:
        self.throttle = throttle

    @staticmethod
    def enabled() -> bool:
        return log.isEnabledFor(logging.DEBUG)

    def refused(
        self, code: str, reason: str | None, field: str | None, peer: str, message: str
    ) -> None:
        if not self.enabled():
            return
        held = self.throttle.take(reason or code)
        if held is None:
            return
        log.debug(
            "refused %s %s (field %s) from %s: %s%s",
            code,
            reason or "-",
            field or "-",
            peer,
            message,
            f" [{held} more {reason or code} refusals not logged]" if held else "",
        )


refusals = RefusalLog(Throttle(REFUSAL_RATE, REFUSAL_BURST))
