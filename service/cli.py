"""The `mtpdraft` command: `mtpdraft serve` runs the drafter service, `mtpdraft loadtest`
drives one with simulated verifiers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from mtpdraft.client.loadtest import add_loadtest_parser, run_loadtest

from .engine.engine import DraftEngine
from .engine.runner import GIL_SWITCH_INTERVAL_S
from .engine.scheduler import DEFAULT_BATCH_WAIT_S
from .front_end_process import FrontEndSpec
from .model.checkpoint import load_mtp_weights
from .model.default_model import DEFAULT_CHECKPOINT
from .model.errors import CheckpointError
from .model.kv_cache import KVCache
from .model.mtp_head import MTPHead
from .server import DEFAULT_MAX_MESSAGE_BYTES, DrafterServer, create_server
from .split_server import SplitServer
from .telemetry import Telemetry, providers_from_env

log = logging.getLogger("mtpdraft")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Without --kv-blocks: a quarter of free GPU memory, or 1 GiB of host memory.
_GPU_KV_FRACTION = 0.25
_CPU_KV_BYTES = 1 << 30


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve drafts from an MTP checkpoint over gRPC")
    p.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default: the checkpoint's")
    p.add_argument("--max-states", type=int, default=1024)
    p.add_argument("--max-states-per-client", type=int, help="live states one client host may hold")
    p.add_argument(
        "--max-rows-per-state", type=int, help="rows (prompt + drafts) one state may hold"
    )
    p.add_argument("--max-inflight", type=int, help="concurrent RPCs; streams count as one")
    p.add_argument("--kv-blocks", type=int, help="KV pool size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="rows per KV block")
    p.add_argument("--state-ttl", type=float, default=600.0, help="idle seconds before freeing")
    p.add_argument("--max-drafts", type=int, default=16, help="largest K")
    p.add_argument("--max-batch", type=int, default=64, help="largest ProposeBatch")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--max-queue", type=int, default=4096, help="Propose calls waiting, at most")
    p.add_argument(
        "--batch-wait-us",
        type=float,
        default=DEFAULT_BATCH_WAIT_S * 1e6,
        help="the most a batch waits for verifiers due back (0: start at once)",
    )
    p.add_argument(
        "--gil-switch-us",
        type=float,
        default=GIL_SWITCH_INTERVAL_S * 1e6,
        help="the engine process's GIL switch interval (Python's default: 5000)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        metavar="N",
        help="threads for torch's CPU ops in the engine process (default: torch's, one a "
        "core); with CUDA those ops are a batch's small host copies and checks",
    )
    p.add_argument(
        "--front-ends",
        type=int,
        default=0,
        metavar="N",
        help="serve gRPC from N processes before the engine's (0: from the engine's own)",
    )
    p.add_argument("--grace-period", type=float, default=10.0, help="seconds to drain")
    p.add_argument("--no-reflection", action="store_true", help="turn server reflection off")
    p.add_argument(
        "--ops",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="forward ops: Triton kernels on CUDA, torch elsewhere (auto)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the draft step eagerly")
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-cert", metavar="FILE", help="serve TLS: the server's PEM certificate")
    sec.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    sec.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="mutual TLS: require client certificates signed by this PEM CA",
    )
    sec.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health; "
        "one token per line (several while rotating), re-read every second; "
        "an emptied or deleted file accepts no token",
    )


def _front_end_spec(args: argparse.Namespace) -> FrontEndSpec:
    """The options of each front-end process (they build their own credentials)."""
    return FrontEndSpec(
        socket_path="",
        address="",
        max_message_bytes=args.max_message_bytes,
        reflection_enabled=not args.no_reflection,
        max_inflight=args.max_inflight,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_token_file=args.auth_token_file,
    )


def _security(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """create_server's credentials / tokens from the flags; bad flags or files exit."""
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    try:
        return _front_end_spec(args).security()  # what each front-end process builds too
    except ValueError as exc:
        parser.error(str(exc))


def _describe_security(args: argparse.Namespace) -> str:
    transport = "plaintext"
    if args.tls_cert:
        transport = "mutual TLS (client certificates required)" if args.tls_client_ca else "TLS"
    auth = "bearer tokens required" if args.auth_token_file else "no authentication"
    return f"{transport}, {auth}"


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mtpdraft: --device cuda, but no CUDA device is available")
    return torch.device(choice)


def _kv_blocks(args: argparse.Namespace, head: MTPHead) -> int:
    if args.kv_blocks:
        return args.kv_blocks
    c = head.config
    per_block = KVCache.bytes_per_block(
        args.block_size, c.num_key_value_heads, c.head_dim, head.dtype
    )
    if head.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(head.device)
        return max(1, int(free * _GPU_KV_FRACTION) // per_block)
    return max(1, _CPU_KV_BYTES // per_block)


def build_engine(args: argparse.Namespace) -> DraftEngine:
    if args.torch_threads:
        # A batch's host ops are small: on a 16-core H200 host the NaN/inf check of 64
        # rows of 4096 took 496 us with torch's 16 threads, 184-208 us with 1 or 4.
        torch.set_num_threads(args.torch_threads)
    weights = load_mtp_weights(args.model)
    head = MTPHead(weights, _device(args.device), _DTYPES.get(args.dtype), ops=args.ops)
    return DraftEngine(
        head,
        kv_blocks=_kv_blocks(args, head),
        block_size=args.block_size,
        max_states=args.max_states,
        max_states_per_owner=args.max_states_per_client,
        max_rows_per_state=args.max_rows_per_state,
        max_drafts=args.max_drafts,
        max_batch=args.max_batch,
        state_ttl=args.state_ttl,
        cuda_graphs=not args.no_cuda_graphs,
    )


def build_server(
    args: argparse.Namespace,
    engine: DraftEngine,
    telemetry: Telemetry,
    security: dict | None = None,
    front_end_telemetry: Callable[[], Telemetry] | None = None,
) -> DrafterServer | SplitServer:
    """The server `mtpdraft serve` runs on `engine`, not yet started: one process, or the
    engine's before --front-ends processes (which read the security flags' files
    themselves, and make their telemetry with `front_end_telemetry` if given)."""
    sys.setswitchinterval(args.gil_switch_us * 1e-6)  # see GIL_SWITCH_INTERVAL_S
    scheduling = {"max_queue": args.max_queue, "batch_wait": args.batch_wait_us * 1e-6}
    if args.front_ends > 0:
        spec = replace(_front_end_spec(args), telemetry=front_end_telemetry)
        return SplitServer(
            engine,
            args.host,
            args.port,
            args.front_ends,
            spec,
            telemetry=telemetry,
            **scheduling,
        )
    server, _ = create_server(
        engine,
        f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
        reflection_enabled=not args.no_reflection,
        max_inflight=args.max_inflight,
        telemetry=telemetry,
        **scheduling,
        **(security or {}),
    )
    return server


async def _serve(args: argparse.Namespace, security: dict) -> int:
    engine = build_engine(args)
    server = build_server(args, engine, Telemetry(*providers_from_env()), security)
    # Set once every front-end process has gone; one process never sets it.
    gone = server.gone if isinstance(server, SplitServer) else asyncio.Event()
    await server.start()
    port = server.port
    info = engine.info()
    print(
        f"mtpdraft: serving {info.model_family} MTP head from {args.model} on {info.device} "
        f"({info.compute_dtype}, {info.kv_blocks_total} KV blocks of {info.kv_block_size} rows)",
        flush=True,
    )
    print(f"mtpdraft: security: {_describe_security(args)}", flush=True)
    if args.front_ends > 0:
        print(f"mtpdraft: {args.front_ends} gRPC front-end processes", flush=True)
    print(f"mtpdraft: listening on {args.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(gone.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    lost = gone.is_set()  # before the drain, which stops the front ends itself
    if lost:
        print("mtpdraft: every front-end process has gone: stopping", flush=True)
    print(f"mtpdraft: draining (grace period {args.grace_period:g} s)", flush=True)
    freed = await server.drain(0.0 if lost else args.grace_period)
    print(f"mtpdraft: stopped; freed {freed} live states", flush=True)
    return 1 if lost else 0  # it lost its front ends: a supervisor should know


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    add_loadtest_parser(sub)
    args = parser.parse_args(argv)
    # Bad security flags or files end here, before anything starts.
    security = _security(sub.choices["serve"], args) if args.command == "serve" else {}
    if args.command == "serve" and args.front_ends < 0:
        sub.choices["serve"].error("--front-ends must be 0 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.command == "loadtest":
        return run_loadtest(args)
    if args.command == "serve":
        try:
            return asyncio.run(_serve(args, security))
        except CheckpointError as exc:
            print(f"mtpdraft: cannot load the model: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
