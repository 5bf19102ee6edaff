"""Which calls land their hiddens in page-locked memory: while few calls wait, on a GPU."""

from __future__ import annotations

import asyncio

import torch

from mtpdraft.service.backend import LocalBackend
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.types import ProposeArgs
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint


def test_calls_read_during_a_flood_stay_pageable(tmp_path) -> None:
    folder = write_random_checkpoint(tmp_path, "mimo", seed=4)
    head = MTPHead(load_mtp_weights(folder), torch.device("cpu"))
    engine = DraftEngine(head, kv_blocks=16, block_size=4, max_batch=8)

    async def queue_up() -> list[bool]:
        backend = LocalBackend(engine)  # its scheduler is not started: calls stay queued
        pinned = [backend.pinned_inputs]  # a CPU engine copies nothing to a device
        backend.pin_while_queued_below = 2  # as a GPU engine's is max_batch
        calls = []
        for i in range(3):
            pinned.append(backend.pinned_inputs)
            args = ProposeArgs(i + 1, 7, torch.zeros(1, 64), 1, 2)
            calls.append(backend.propose([args], None))
        for call in calls:
            call.cancel()
        return pinned

    assert asyncio.run(queue_up()) == [False, True, True, False]
