"""`mtpdraft info`: a server's health and GetInfo, as the command prints them, over the
targets and security options the clients have."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
from pathlib import Path

import pytest
from secured_servers import SecuredServers
from servers import PATIENCE, InProcessServer, ServerProcess, small_engine

from mtpdraft.client import DrafterClient
from mtpdraft.client.info import add_info_parser
from mtpdraft.service import cli


def _info(*argv: str) -> int:
    return cli.main(["info", *argv])


def test_info_prints_the_health_and_every_getinfo_field(
    server: ServerProcess, capsys: pytest.CaptureFixture
) -> None:
    assert _info("--target", server.address) == 0
    health, *lines = capsys.readouterr().out.splitlines()
    assert health == "health: SERVING"
    with DrafterClient(server.address, timeout=PATIENCE) as client:
        expected = dataclasses.asdict(client.info())
    shown = dict(line.split(": ", 1) for line in lines)
    assert list(shown) == list(expected)
    assert shown["model_family"] == "mimo" and shown["max_states"] == "32"
    assert json.loads(shown["hidden_dtypes"]) == list(expected["hidden_dtypes"])

    assert _info("--target", server.address, "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["target"] == server.address and printed["health"] == "SERVING"
    assert printed["info"]["model_family"] == "mimo" and printed["info"]["max_drafts"] == 8


def test_info_over_mutual_tls_and_a_unix_socket_with_a_token(
    secured_servers: SecuredServers, capsys: pytest.CaptureFixture
) -> None:
    s = secured_servers
    tls = ("--tls-ca", str(s.ca), "--tls-cert", str(s.client_cert), "--tls-key", str(s.client_key))
    token = ("--token-file", str(s.token_file))
    assert _info("--target", s.tls_address, *tls, *token) == 0
    assert "model_family: mimo" in capsys.readouterr().out.splitlines()
    assert _info("--target", s.unix_target, *token, "--json") == 0
    assert json.loads(capsys.readouterr().out)["info"]["model_family"] == "mimo"
    # Health needs no token, GetInfo does: a container's health check asks health alone.
    assert _info("--target", s.tls_address, *tls, "--health-only") == 0
    assert capsys.readouterr().out == "health: SERVING\n"
    assert _info("--target", s.tls_address, *tls) == 1
    captured = capsys.readouterr()
    assert captured.out == "health: SERVING\n"
    assert captured.err.startswith(f"mtpdraft info: GetInfo at {s.tls_address}: UNAUTHENTICATED")
    # No client certificate: the TLS handshake fails, in one line.
    assert _info("--target", s.tls_address, "--tls-ca", str(s.ca), *token) == 1
    err = capsys.readouterr().err
    assert err.startswith("mtpdraft info: health of 'mtpdraft.v1.Drafter' at ")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_draining_server_is_not_serving(mimo_checkpoint: Path, capsys) -> None:
    server = InProcessServer(small_engine(mimo_checkpoint))
    try:
        health = server.server.health  # NOT_SERVING for good, as a drain turns it
        asyncio.run_coroutine_threadsafe(health.enter_graceful_shutdown(), server.loop).result(
            PATIENCE
        )
        assert _info("--target", server.address) == 1
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "health: NOT_SERVING" and "model_family: mimo" in lines
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_or_a_bad_option_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target = f"127.0.0.1:{_free_port()}"
    assert _info("--target", target) == 1
    err = capsys.readouterr().err
    health = f"mtpdraft info: health of 'mtpdraft.v1.Drafter' at {target}: UNAVAILABLE"
    assert err.startswith(health)
    assert err.count("\n") == 1
    (tmp_path / "token").write_text("secret\n")
    missing = f"unix:{tmp_path / 'none.sock'}"
    assert _info("--target", missing, "--token-file", str(tmp_path / "token")) == 1
    assert "without TLS a token is sent only to a loopback address" in capsys.readouterr().err
    for argv, message in [
        (("--target", "drafter.internal"), "--target 'drafter.internal': give HOST:PORT"),
        (("--tls-key", "client.key"), "--tls-cert and --tls-key go together"),
        (("--tls-ca", str(tmp_path / "none.pem")), "--tls-ca"),
    ]:
        assert _info(*argv) == 2
        assert message in capsys.readouterr().err


def test_help_shows_every_default() -> None:
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_info_parser(parser.add_subparsers(dest="command"))
    (info,) = parser._subparsers._group_actions[0].choices.values()
    for action in info._actions:
        if action.dest != "help":
            assert "(default: " in action.help, action.option_strings
