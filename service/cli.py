"""The `mtpdraft` command: `mtpdraft serve` runs the drafter service, `mtpdraft loadtest`
drives one with simulated verifiers, `mtpdraft info` prints one's health and GetInfo."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import os
import signal
import sys
import typing
from collections.abc import Sequence

from .config import ServeConfig

log = logging.getLogger("mtpdraft.cli")

# Without --kv-blocks on the CPU: 256 MiB of host memory (on a GPU, --kv-memory-fraction).
# A CPU server is for trying the service and for tests; the pool is zeroed, so all of it is
# resident from the start: 1 GiB made the embedded model's server take 1.3 GB.
_CPU_KV_BYTES = 256 << 20

# The client commands: (module, help). A module's `add_<name>_parser` and `run_<name>` import
# grpc: loaded only for the command named.
_CLIENT_COMMANDS = {
    "loadtest": ("mtpdraft.client.loadtest", "load a drafter with simulated verifiers"),
    "info": ("mtpdraft.client.info", "print a server's health and GetInfo"),
}


def _load_serving() -> None:
    """Imports the serving stack (torch, grpc, the engine) into this module, once: the
    parser needs none of it, so `--help` and `--version` answer without a second of imports."""
    global torch, DraftEngine, GIL_SWITCH_INTERVAL_S, load_mtp_weights, CheckpointError
    global KVCache, MTPHead, TokenSource, server_credentials, DrafterServer
    global Telemetry, providers_from_env, serve_metrics, ListenError, check_free
    if "torch" in globals():
        return
    import torch

    from .addresses import ListenError, check_free
    from .engine.engine import DraftEngine
    from .model.checkpoint import load_mtp_weights
    from .model.errors import CheckpointError
    from .model.kv_cache import KVCache
    from .model.mtp_head import MTPHead
    from .security import TokenSource, server_credentials
    from .server import DrafterServer
    from .serving.runner import GIL_SWITCH_INTERVAL_S
    from .telemetry import Telemetry, providers_from_env, serve_metrics


def __getattr__(name: str) -> typing.Any:
    """The serving stack's names (`cli.DraftEngine`, ...) reached from outside, loaded."""
    if not name.startswith("__"):
        _load_serving()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version() -> str:
    from importlib.metadata import version

    return f"mtpdraft {version('mtpdraft')}"


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`serve`'s parser: a flag for each ServeConfig field (config.py), its default shown."""
    p = sub.add_parser(
        "serve",
        help="serve drafts from an MTP checkpoint over gRPC",
        description="Serve drafts from an MTP checkpoint over gRPC. SIGTERM or Ctrl-C drains.",
    )
    p.add_argument("--version", action="version", version=_version())
    groups = {"security": p.add_argument_group("security")}
    hints = typing.get_type_hints(ServeConfig)
    for f in dataclasses.fields(ServeConfig):
        options = dict(f.metadata)
        group = groups.get(options.pop("group", None), p)
        flag = f.name.replace("_", "-")
        options["help"] += f" (default: {options.pop('shown_default', f.default)})"
        if hints[f.name] is bool:  # a flag that turns the default over
            action = "store_false" if f.default else "store_true"
            flag = f"no-{flag}" if f.default else flag
            group.add_argument(f"--{flag}", dest=f.name, action=action, **options)
            continue
        kind = hints[f.name]  # str, int, float, or one of them | None
        kind = next(t for t in typing.get_args(kind) or [kind] if t is not type(None))
        if kind is int:
            options.setdefault("metavar", "N")
        group.add_argument(f"--{flag}", type=kind, default=f.default, **options)
    return p


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of parsed `serve` arguments."""
    return ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})


def parse_serve(argv: Sequence[str]) -> ServeConfig:
    """`mtpdraft serve ARGV`'s ServeConfig, parsed by the command's own parser."""
    parser, serve_parser = _parser(["serve"])
    config = serve_config(parser.parse_args(["serve", *argv]))
    _check_kv(serve_parser, config)
    return config


def _check_kv(parser: argparse.ArgumentParser, config: ServeConfig) -> None:
    """--kv-memory-fraction in (0, 1], and not with --kv-blocks: one or the other sizes the pool."""
    fraction = config.kv_memory_fraction
    if fraction is None:
        return
    if not 0 < fraction <= 1:
        parser.error(f"--kv-memory-fraction {fraction:g}: must be in (0, 1]")
    if config.kv_blocks is not None:
        parser.error("--kv-memory-fraction and --kv-blocks: give one (both size the KV pool)")


def _parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its `serve` parser, for ARGV."""
    parser = argparse.ArgumentParser(prog="mtpdraft", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _serve_parser(sub)
    for name, (module, summary) in _CLIENT_COMMANDS.items():
        if name in argv:
            getattr(importlib.import_module(module), f"add_{name}_parser")(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser, serve_parser


def _security(parser: argparse.ArgumentParser, config: ServeConfig) -> dict:
    """DrafterServer's credentials / tokens from the flags; bad flags or files exit."""
    if bool(config.tls_cert) != bool(config.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if config.tls_client_ca and not config.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    options: dict = {}
    try:
        if config.tls_cert:
            options["credentials"] = server_credentials(
                config.tls_cert, config.tls_key, config.tls_client_ca
            )
        if config.auth_token_file:
            options["tokens"] = TokenSource(path=config.auth_token_file)
    except ValueError as exc:
        parser.error(str(exc))
    return options


def listen_addresses(config: ServeConfig) -> list[str]:
    """Every address `mtpdraft serve` listens on, as gRPC names them."""
    unix = [f"unix:{config.unix_socket}"] if config.unix_socket else []
    return [config.address, *unix]


def _describe_security(config: ServeConfig) -> str:
    transport = "plaintext"
    if config.tls_cert:
        transport = "mutual TLS (client certificates required)" if config.tls_client_ca else "TLS"
    auth = "bearer tokens required" if config.auth_token_file else "no authentication"
    return f"{transport}, {auth}"


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mtpdraft: --device cuda, but no CUDA device is available")
    return torch.device(choice)


def limit_cpu_threads() -> None:
    """The server gives torch one intra-op thread unless OMP_NUM_THREADS says otherwise.
    Its host-side ops are small (a batch's checks, staging, bookkeeping; on a CPU server
    the forward's too): with a thread a core, each one wakes the pool, and the server's
    own threads (the event loop, gRPC's) wait behind torch's for a core
    (bench/results/verifier_threads_*.md at 99f26ad, verifier_cpu*.md at ee1e501)."""
    _load_serving()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def kv_pool_blocks(memory_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """The KV blocks that fit in `fraction` of `memory_bytes`, one at least."""
    return max(1, int(memory_bytes * fraction) // bytes_per_block)


def _kv_blocks(config: ServeConfig, head: MTPHead) -> int:
    if config.kv_blocks:
        return config.kv_blocks
    per_block = KVCache.bytes_per_block(config.block_size, head.kv_row_values, head.dtype)
    if head.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(head.device)
        return kv_pool_blocks(free, config.kv_fraction, per_block)
    return kv_pool_blocks(_CPU_KV_BYTES, 1.0, per_block)


def build_engine(config: ServeConfig) -> DraftEngine:
    """The engine `mtpdraft serve` runs, every limit from `config`, its KV pool sized
    where `--kv-blocks` does not say."""
    _load_serving()
    weights = load_mtp_weights(config.model)
    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    head = MTPHead(weights, _device(config.device), dtype, ops=config.ops)
    return DraftEngine(head, dataclasses.replace(config, kv_blocks=_kv_blocks(config, head)))


def build_server(
    config: ServeConfig,
    engine: DraftEngine,
    telemetry: Telemetry,
    security: dict | None = None,
) -> DrafterServer:
    """The server `mtpdraft serve` runs on `engine`, not yet started; `security`:
    DrafterServer's credentials / tokens (`_security`). Sets the process's GIL switch
    interval (see GIL_SWITCH_INTERVAL_S): the event loop and the engine thread share it."""
    _load_serving()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    return DrafterServer(engine, config, telemetry, **(security or {}))


async def _serve(config: ServeConfig, security: dict, telemetry: Telemetry) -> int:
    limit_cpu_threads()
    engine = build_engine(config)
    server = build_server(config, engine, telemetry, security)
    await server.start()
    info = engine.info()
    print(
        f"mtpdraft: serving {info.model_family} MTP head from {config.model} on {info.device} "
        f"({info.compute_dtype}, {info.kv_blocks_total} KV blocks of {info.kv_block_size} rows)",
        flush=True,
    )
    print(f"mtpdraft: security: {_describe_security(config)}", flush=True)
    print(f"mtpdraft: listening on {config.host}:{server.port}", flush=True)
    if config.unix_socket:
        print(f"mtpdraft: listening on unix:{config.unix_socket}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    loop.add_signal_handler(signal.SIGINT, _exit_now)
    print(f"mtpdraft: draining (grace period {config.grace_period:g} s)", flush=True)
    freed = await server.drain(config.grace_period)
    print(f"mtpdraft: stopped; freed {freed} live states", flush=True)
    return 0


def _exit_now() -> None:
    """A second Ctrl-C while draining: exit at once, as vLLM and SGLang do (130: by SIGINT)."""
    print("mtpdraft: interrupted again while draining; exiting now", file=sys.stderr, flush=True)
    os._exit(130)


def _configure_logging(level: str) -> None:
    """`level` for the service's loggers (`mtpdraft.*`); others at info or above."""
    number = getattr(logging, level.upper())
    logging.basicConfig(
        level=max(number, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("mtpdraft").setLevel(number)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, serve_parser = _parser(argv)
    args = parser.parse_args(argv)
    if args.command in _CLIENT_COMMANDS:
        _configure_logging("info")
        module = importlib.import_module(_CLIENT_COMMANDS[args.command][0])
        return getattr(module, f"run_{args.command}")(args)
    config = serve_config(args)
    _check_kv(serve_parser, config)
    _load_serving()
    security = _security(serve_parser, config)  # bad flags or files end here, before loading
    try:  # an address in use ends it here too, not once the model has loaded
        for address in listen_addresses(config):
            check_free(address)
    except ListenError as exc:
        print(f"mtpdraft: {exc}", file=sys.stderr)
        return 2
    _configure_logging(config.log_level)
    log.debug("configuration: %s", config)
    try:
        telemetry = Telemetry(*providers_from_env(prometheus=config.metrics_port is not None))
    except ValueError as exc:  # a bad OTEL_* value, named
        print(f"mtpdraft: {exc}", file=sys.stderr)
        return 2
    if config.metrics_port is not None:
        try:
            metrics = serve_metrics(config.host, config.metrics_port)
        except OSError as exc:
            print(
                f"mtpdraft: cannot serve metrics on port {config.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2
        url = f"http://{config.host}:{metrics.server_port}/metrics"
        print(f"mtpdraft: metrics for Prometheus at {url}", flush=True)
    try:
        return asyncio.run(_serve(config, security, telemetry))
    except CheckpointError as exc:  # its message begins with the file at fault
        telemetry.shutdown()
        print(f"mtpdraft: cannot load {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # taken while the model loaded
        telemetry.shutdown()
        print(f"mtpdraft: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
