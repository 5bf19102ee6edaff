"""`mtpdraft serve` options that change the serving process itself."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest
import torch

from mtpdraft.client import DrafterClient
from mtpdraft.service import cli
from mtpdraft.service.telemetry import Telemetry


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("flags", "interval"),
    [((), 500e-6), (("--gil-switch-us", "250"), 250e-6)],
    ids=["default", "250us"],
)
def test_the_server_sets_the_engine_process_gil_switch_interval(
    mimo_checkpoint: Path, flags: tuple[str, ...], interval: float
) -> None:
    args = _serve_args("--model", str(mimo_checkpoint), "--device", "cpu", "--port", "0", *flags)
    engine = cli.build_engine(args)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default: the server, not the process, sets it

    async def serve() -> float:
        server = cli.build_server(args, engine, Telemetry())
        try:
            await server.start()
            interval = sys.getswitchinterval()
            # It serves: the setting is made where the server is built, not instead of it.
            with DrafterClient(f"127.0.0.1:{server.port}") as client:
                info = await asyncio.to_thread(client.info)
            assert info.max_batch == args.max_batch
            return interval
        finally:
            await server.drain(0)

    try:
        assert asyncio.run(serve()) == pytest.approx(interval)
    finally:
        sys.setswitchinterval(before)


def test_torch_threads_are_set_where_the_engine_is_built(mimo_checkpoint: Path) -> None:
    before = torch.get_num_threads()
    assert _serve_args().torch_threads is None  # torch's own default unless asked
    args = _serve_args("--model", str(mimo_checkpoint), "--device", "cpu", "--torch-threads", "1")
    try:
        torch.set_num_threads(2)  # so that the option, not the machine, makes it 1
        engine = cli.build_engine(args)
        assert torch.get_num_threads() == 1
        assert engine.head.device.type == "cpu"
    finally:
        torch.set_num_threads(before)
