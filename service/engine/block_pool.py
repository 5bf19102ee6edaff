"""Free-list allocator of the KV cache's fixed-size blocks, shared by all states."""

from __future__ import annotations

from .errors import ResourceExhausted


class BlockPool:
    """Hands out block indices in [0, num_blocks); all or nothing per request."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_total = num_blocks
        # Low indices first, so that a quiet server touches a compact range of memory.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ResourceExhausted(
                f"no free KV blocks: {count} needed, {len(self._free)} of {self.num_total} free",
                reason="KV_BLOCKS_EXHAUSTED",
            )
        if count <= 0:
            return []
        taken = self._free[-count:]
        del self._free[-count:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
