"""The service as the benches run it, built by `mtpdraft serve`'s own code from the same
options: its random model, the engine in process, or the whole server in a subprocess of
its own (this file, run), traced or not.

    python bench/drafter_service.py [--traced] SERVE_OPTIONS...   # prints "PORT n"

Kept free of torch at import, as workload.py.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from pathlib import Path
from typing import Any

from server_process import ServerProcess
from workload import MAX_POSITIONS, Workload, random_hiddens

BLOCK_SIZE = 16
SERVER_START_TIMEOUT_S = 600.0  # loading a 3 GB checkpoint and capturing CUDA graphs


def write_model(folder: str | Path, shape: dict[str, int]) -> None:
    """A random MiMo checkpoint of `shape` (bench/shapes.py) in bf16, with room for
    MAX_POSITIONS rows."""
    import torch

    from mtpdraft.service.model.synthetic import write_random_checkpoint

    write_random_checkpoint(
        folder, "mimo", **shape, dtype=torch.bfloat16, seed=0,
        extra_config={"max_position_embeddings": MAX_POSITIONS},
    )  # fmt: skip


def kv_blocks_for(states: int, work: Workload) -> int:
    """The KV blocks `states` states of the workload hold at most, and some to spare."""
    return states * math.ceil(work.rows_per_state / BLOCK_SIZE) + 64


def serve_argv(model: Path, device: str, kv_blocks: int, num_drafts: int) -> list[str]:
    """`mtpdraft serve` options: the in-process engine and the servers use the same ones."""
    return [
        "--model", str(model), "--device", device, "--kv-blocks", str(kv_blocks),
        "--block-size", str(BLOCK_SIZE), "--max-batch", "64", "--max-states", "1024",
        "--max-drafts", str(max(num_drafts, 16)), "--port", "0",
    ]  # fmt: skip


def build_engine(argv: list[str]) -> tuple[Any, str | None]:
    """The engine exactly as `mtpdraft serve ARGV` builds it; (engine, note)."""
    try:
        from mtpdraft.service import cli
    except ImportError as exc:  # the CLI imports OpenTelemetry; the engine needs none
        import torch

        from mtpdraft.service.config import ServeConfig
        from mtpdraft.service.engine.engine import DraftEngine
        from mtpdraft.service.model.checkpoint import load_mtp_weights
        from mtpdraft.service.model.mtp_head import MTPHead

        opts = dict(zip(argv[::2], argv[1::2], strict=True))
        head = MTPHead(load_mtp_weights(opts["--model"]), torch.device(opts["--device"]))
        config = ServeConfig(
            kv_blocks=int(opts["--kv-blocks"]),
            block_size=BLOCK_SIZE,
            max_drafts=int(opts["--max-drafts"]),
            max_batch=int(opts["--max-batch"]),
        )
        engine = DraftEngine(head, config)
        return engine, f"in-process engine built without the CLI ({exc})"
    config = cli.parse_serve(argv)
    cli.limit_cpu_threads()  # the threads `mtpdraft serve` runs with
    return cli.build_engine(config), None


def engine_states(engine: Any, batch: int, work: Workload, seed: int) -> list[int]:
    """`batch` new states of the in-process engine, each prefilled with one prompt of
    work.prompt - 1 rows (its own random tokens, the hiddens drawn from `seed`)."""
    rng = random.Random(seed)
    prompt = random_hiddens(work.prompt - 1, work, seed)
    states = [engine.alloc_state() for _ in range(batch)]
    for state in states:
        session = engine.begin_prefill(state, 1)
        session.append([rng.randrange(work.vocab_size) for _ in range(work.prompt - 1)], prompt)
        session.finish()
    return states


class _NoOpExporter:
    """Accepts spans and drops them: what tracing costs in the server itself."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def traced_telemetry() -> Any:
    """Server spans through an SDK TracerProvider to an exporter that drops them: what
    tracing costs the server itself."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from mtpdraft.service.telemetry import Telemetry

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_NoOpExporter()))  # type: ignore[arg-type]
    return Telemetry(provider, None)


def serve_main(argv: list[str], tracing: bool) -> int:
    """The server process: `mtpdraft serve ARGV`'s engine and server, optionally traced;
    prints "PORT n", serves until its stdin closes."""
    from mtpdraft.service import cli
    from mtpdraft.service.telemetry import Telemetry

    config = cli.parse_serve(argv)
    cli.limit_cpu_threads()

    async def serve() -> None:
        engine = cli.build_engine(config)
        telemetry = traced_telemetry() if tracing else Telemetry()
        server = cli.build_server(config, engine, telemetry)
        await server.start()
        print(f"PORT {server.port}", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # the bench closes our stdin to stop us
        await server.drain(0)

    asyncio.run(serve())
    return 0


def start_server(argv: list[str], tracing: bool) -> ServerProcess:
    """This file run (the service on ARGV, traced or not) in a subprocess."""
    traced = ["--traced"] if tracing else []
    cmd = [sys.executable, str(Path(__file__).resolve()), *traced, *argv]
    return ServerProcess(cmd, SERVER_START_TIMEOUT_S)


if __name__ == "__main__":
    traced = sys.argv[1:2] == ["--traced"]
    sys.exit(serve_main(sys.argv[2 if traced else 1 :], traced))
