"""The refused requests' debug lines: one per refusal, but no flood (service/refusals.py)."""

from __future__ import annotations

import logging

import pytest

from mtpdraft.service.refusals import RefusalLog, Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_throttle_lets_a_burst_through_then_its_rate_and_counts_what_it_held() -> None:
    clock = Clock()
    throttle = Throttle(rate=2.0, burst=3, clock=clock)
    assert [throttle.take("a") for _ in range(5)] == [0, 0, 0, None, None]
    assert throttle.take("b") == 0  # another key has its own bucket
    clock.now += 0.5  # one line's worth of time
    assert throttle.take("a") == 2  # the two held back since the last line
    assert throttle.take("a") is None
    clock.now += 60.0  # refilled to the burst, no more
    assert [throttle.take("a") for _ in range(4)] == [1, 0, 0, None]


def refusal(log: RefusalLog, reason: str) -> None:
    log.refused("INVALID_ARGUMENT", reason, "position", "ipv4:10.0.0.7:5555", "position: 0")


def test_refusals_are_logged_at_debug_each_reason_rate_limited(caplog) -> None:
    clock = Clock()
    log = RefusalLog(Throttle(rate=1.0, burst=2, clock=clock))
    caplog.set_level(logging.DEBUG, logger="mtpdraft.refusals")
    for _ in range(50):  # a client repeating one bad request
        refusal(log, "POSITION_OUT_OF_RANGE")
    refusal(log, "TOKEN_OUT_OF_RANGE")  # another reason shows at once
    clock.now += 1.0
    refusal(log, "POSITION_OUT_OF_RANGE")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "refused INVALID_ARGUMENT POSITION_OUT_OF_RANGE (field position) from "
        "ipv4:10.0.0.7:5555: position: 0"
    )
    assert len(lines) == 4 and "TOKEN_OUT_OF_RANGE" in lines[2]
    assert lines[3].endswith("[48 more POSITION_OUT_OF_RANGE refusals not logged]")
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_refusals_cost_a_level_check_unless_debug_is_on(caplog, level) -> None:
    class Untouchable(Throttle):
        def take(self, key: str) -> int | None:
            raise AssertionError("the throttle is not consulted when debug is off")

    caplog.set_level(level, logger="mtpdraft.refusals")
    log = RefusalLog(Untouchable(rate=1.0, burst=1))
    refusal(log, "POSITION_OUT_OF_RANGE")
    assert not caplog.records
