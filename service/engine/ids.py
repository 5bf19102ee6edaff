"""State and KV handle ids that say which server instance issued them.

An id is 63 random-looking bits whose top EPOCH_BITS are the issuing engine's epoch, drawn
at random when the engine starts (never 0: an id of epoch 0 was never issued). A state lives
in one process's memory: an id of another epoch was issued by another replica, or by this
one before it restarted, and its KV is not here. Such an id, or one of this instance whose
lease ran out, is *lost* (NOT_FOUND, reason STATE_LOST: allocate again and re-prefill, or
import the exported KV), which a verifier must tell from a state it freed or never had
(STATE_NOT_FOUND).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from .errors import NotFound

ID_BITS = 63
EPOCH_BITS = 20
EPOCH_SHIFT = ID_BITS - EPOCH_BITS  # an id's epoch: id >> EPOCH_SHIFT
# Ids whose lease ran out, remembered so that their calls say "lost": a bounded memory
# (about 1 MB), the oldest forgotten first (they then read as never allocated).
REMEMBERED_EXPIRED = 65536


def epoch_of(state_id: int) -> int:
    """The epoch of the instance that issued `state_id`."""
    return state_id >> EPOCH_SHIFT


class Ids:
    """Issues one engine instance's ids and explains why an id is not live."""

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = epoch if epoch is not None else 1 + secrets.randbelow(2**EPOCH_BITS - 1)
        if not 0 < self.epoch < 2**EPOCH_BITS:
            raise ValueError(f"epoch {self.epoch} is outside [1, {2**EPOCH_BITS})")
        self._expired: OrderedDict[int, None] = OrderedDict()

    def new(self, taken: dict) -> int:
        """A fresh id of this epoch, not in `taken`."""
        high = self.epoch << EPOCH_SHIFT
        while True:
            new = high | secrets.randbits(EPOCH_SHIFT)
            if new not in taken:
                return new

    def ours(self, any_id: int) -> bool:
        return epoch_of(any_id) == self.epoch

    def lost_elsewhere(self, any_id: int) -> bool:
        """Issued by another instance (epoch 0 is no instance's: such an id never was)."""
        return epoch_of(any_id) not in (0, self.epoch)

    def expired(self, state_id: int) -> None:
        """Remembers that `state_id`'s lease ran out."""
        self._expired[state_id] = None
        if len(self._expired) > REMEMBERED_EXPIRED:
            self._expired.popitem(last=False)

    def state_not_found(self, state_id: int, ttl: float) -> NotFound:
        """Why no live state has this id: lost (another instance's, or its lease expired),
        or never allocated here / freed."""
        recover = (
            "its KV is gone; allocate a new state and prefill it again from the verifier's "
            "tokens and hiddens (or import its exported KV)"
        )
        if self.lost_elsewhere(state_id):
            return NotFound(
                f"state {state_id} is lost: server instance {epoch_of(state_id)} issued it, "
                f"this is instance {self.epoch} (a replica that restarted, or a call routed "
                f"to another replica); {recover}",
                reason="STATE_LOST",
                field="state_id",
            )
        if state_id in self._expired:
            return NotFound(
                f"state {state_id} is lost: its lease expired ({ttl:g} s idle); {recover}",
                reason="STATE_LOST",
                field="state_id",
            )
        return NotFound(
            f"state {state_id} not found (never allocated, or freed)",
            reason="STATE_NOT_FOUND",
            field="state_id",
        )

    def handle_not_found(self, handle_id: int) -> NotFound:
        where = (
            f"server instance {epoch_of(handle_id)} took it, this is instance {self.epoch}"
            if self.lost_elsewhere(handle_id)
            else "never taken, installed, exported, or its lease expired"
        )
        return NotFound(
            f"KV handle {handle_id} not found ({where})",
            reason="HANDLE_NOT_FOUND",
            field="handle_id",
        )
