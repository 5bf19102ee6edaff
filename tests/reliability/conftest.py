"""The reliability tests' pace: their leases follow how fast this machine is, now."""

from __future__ import annotations

import pytest
from reliability_support import Pace, measure_pace


@pytest.fixture(scope="module")
def pace(mimo_checkpoint) -> Pace:
    """Measured again for each module: the load may change while the suite runs."""
    measured = measure_pace(mimo_checkpoint)
    print(f"\npace: fill {measured.fill:.2f} s, busy {measured.busy:.2f} s")
    return measured
