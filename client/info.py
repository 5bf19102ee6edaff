"""``mtpdraft info``: a server's health and GetInfo, from the command line.

    mtpdraft info --target drafter.internal:50051 --tls-ca ca.pem --token-file token

Asks the standard health service (``grpc.health.v1.Health/Check``) for the Drafter
service, as Kubernetes' probes do, then GetInfo (the model, the limits, the live
counters), and prints both: ``name: value`` lines, or one JSON object with ``--json``.
``--health-only`` skips GetInfo: the health service needs no token, so it serves as a
container's health check. Exit status: 0 SERVING; 1 not serving (e.g. draining), or a
call failed; 2 an option it cannot use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .command_line import (
    OptionError,
    Security,
    add_security_options,
    add_target_option,
    check_target,
    security_from_args,
)
from .errors import DrafterError
from .sync_client import DrafterClient

INFO_HELP = "print a server's health and GetInfo"
DEFAULT_TARGET = "127.0.0.1:50051"
# The service whose health the probes ask for (deploy/k8s/drafter.yaml).
HEALTH_SERVICE = "mtpdraft.v1.Drafter"
DEFAULT_TIMEOUT_S = 5.0


def add_info_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``info`` to the ``mtpdraft`` command's subcommands."""
    p = subparsers.add_parser(
        "info",
        help=INFO_HELP,
        description="The health of a server's Drafter service (grpc.health.v1, as "
        "Kubernetes' probes ask it) and its GetInfo: model, limits, live counters.",
        epilog="Exit status: 0 the service is SERVING; 1 it is not (e.g. draining), or a "
        "call failed; 2 an option it cannot use.",
    )
    add_target_option(p, DEFAULT_TARGET)
    p.add_argument(
        "--service",
        default=HEALTH_SERVICE,
        help=f"the service whose health to ask; '' for the server's (default: {HEALTH_SERVICE})",
    )
    p.add_argument(
        "--health-only",
        action="store_true",
        help="ask health alone, which needs no token: a container's health check (default: off)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (default: off, text lines)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"deadline of each call (default: {DEFAULT_TIMEOUT_S:g})",
    )
    add_security_options(p)


def _stderr(line: str) -> None:
    print(f"mtpdraft info: {line}", file=sys.stderr, flush=True)


def health_status(channel: grpc.Channel, service: str, timeout: float) -> str:
    """The service's serving status by name (SERVING, NOT_SERVING, ...); grpc.RpcError if
    the call fails (NOT_FOUND: the server does not know the service)."""
    request = health_pb2.HealthCheckRequest(service=service)
    answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _print(target: str, health: str, info: dict[str, Any] | None, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"target": target, "health": health, "info": info}))
        return
    print(f"health: {health}")
    for name, value in (info or {}).items():
        shown = json.dumps(value) if isinstance(value, (dict, list, tuple)) else value
        print(f"{name}: {shown}")


def run_info(args: argparse.Namespace) -> int:
    """The ``info`` command; its exit statuses are in its parser's epilog."""
    try:
        target = check_target(args.target)
        security = security_from_args(args)
    except OptionError as err:
        _stderr(str(err))
        return 2
    with DrafterClient(target, timeout=args.timeout, **security.client_keywords()) as client:
        try:
            health = health_status(client.channel, args.service, args.timeout)
        except grpc.RpcError as err:
            _stderr(f"health of {args.service!r} at {target}: {_failure(err, security)}")
            return 1
        info = None
        if not args.health_only:
            try:
                info = dataclasses.asdict(client.info())
            except DrafterError as err:
                _print(target, health, None, args.json)
                _stderr(f"GetInfo at {target}: {err.code.name}: {err.details}")
                return 1
    _print(target, health, info, args.json)
    return 0 if health == "SERVING" else 1


def _failure(err: grpc.RpcError, security: Security) -> str:
    return f"{err.code().name}: {err.details()}{security.hint()}"
