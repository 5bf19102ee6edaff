"""Mutual TLS and bearer tokens with `mtpdraft serve --front-ends 2`: as in one process.

The front-end processes read the certificate and token files themselves; each
check opens fresh connections (the kernel spreads them over the front ends),
so that every front end is held to the same rules. test_security.py holds the
one-process server to them; test_otel_export.py does the same for tracing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from certificates import cert, pem
from cryptography.hazmat.primitives.asymmetric import ec
from drafting import hiddens
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from servers import SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, DrafterError, Unavailable
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

TOKEN_A, TOKEN_B = "front-end-token-a-0123", "front-end-token-b-4567"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
CONNECTIONS = 4  # fresh connections per check


@dataclass
class Secured:
    address: str
    ca: bytes
    client_key: bytes
    client_cert: bytes
    rogue_key: bytes  # a client certificate of another CA
    rogue_cert: bytes
    token_file: Path


@pytest.fixture(scope="module")
def secured(mimo_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """`mtpdraft serve --front-ends 2` with mutual TLS and a token file."""
    folder = tmp_path_factory.mktemp("front-ends-pki")
    ca_key, rogue_ca_key, server_key, client_key, rogue_key = (
        ec.generate_private_key(ec.SECP256R1()) for _ in range(5)
    )
    ca = cert("front-ends CA", ca_key, ca=True)
    rogue_ca = cert("rogue CA", rogue_ca_key, ca=True)
    files = {
        "ca.pem": pem(ca),
        "server.pem": pem(cert("localhost", server_key, ca, ca_key, server=True)),
        "server.key": pem(server_key),
        "tokens": f"{TOKEN_A}\n{TOKEN_B}\n".encode(),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    flags = ("--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key"))
    flags += ("--tls-client-ca", str(folder / "ca.pem"))
    flags += ("--auth-token-file", str(folder / "tokens"), "--front-ends", "2")
    server = start_server(mimo_checkpoint, *SERVER_ARGS, *flags)
    try:
        out = "".join(server.lines)
        assert "mutual TLS" in out and "2 gRPC front-end processes" in out
        yield Secured(
            server.address,
            pem(ca),
            pem(client_key),
            pem(cert("verifier", client_key, ca, ca_key)),
            pem(rogue_key),
            pem(cert("verifier", rogue_key, rogue_ca, rogue_ca_key)),
            folder / "tokens",
        )
    finally:
        assert server.stop() == 0


def client(s: Secured, token: str | None = TOKEN_A, timeout: float = 20) -> DrafterClient:
    return DrafterClient(
        s.address,
        timeout=timeout,
        root_certificates=s.ca,
        private_key=s.client_key,
        certificate_chain=s.client_cert,
        token=token,
    )


def channel(s: Secured, token: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(s.ca, s.client_key, s.client_cert)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(s.address, creds)


def test_every_call_kind_is_served_to_a_certified_client_with_a_token(secured) -> None:
    for i in range(CONNECTIONS):
        with client(secured, (TOKEN_A, TOKEN_B)[i % 2]) as c:
            state = c.alloc_state()
            c.prefill(state, [1, 2, 3, 4], hiddens(4, i), 1)
            assert len(c.propose(state, 5, hiddens(1, i + 1), 5, 3).tokens) == 3
            with c.stream() as stream:
                proposal = stream.propose(state, 7, hiddens(1, i + 2), 7, 2, previous=1)
            assert len(proposal.tokens) == 2
            assert c.free_state(state)
            assert c.info().live_states == 0


def test_connections_without_tls_or_a_certificate_of_the_ca_are_refused(secured) -> None:
    s = secured
    no_certificate = dict(root_certificates=s.ca, token=TOKEN_A)
    rogue = dict(no_certificate, private_key=s.rogue_key, certificate_chain=s.rogue_cert)
    for _ in range(CONNECTIONS):
        for options in ({}, no_certificate, rogue):
            with DrafterClient(s.address, timeout=5, **options) as c, pytest.raises(Unavailable):
                c.info()


@pytest.mark.parametrize(("token", "words"), [(None, "missing"), ("wrong", "invalid bearer")])
def test_calls_without_the_right_token_are_unauthenticated(secured, token, words) -> None:
    for _ in range(CONNECTIONS):
        with client(secured, token) as c:
            for call in (c.info, c.alloc_state, lambda: c.prefill(1, [1], hiddens(1, 0), 1)):
                with pytest.raises(DrafterError) as err:
                    call()
                assert err.value.code == UNAUTHENTICATED and words in err.value.details
        with channel(secured, token) as ch:
            stream = pb_grpc.DrafterStub(ch).ProposeStream(iter(()), timeout=10)
            assert stream.code() == UNAUTHENTICATED
    with client(secured) as c:
        assert c.info().live_states == 0  # the refused AllocStates made nothing


def test_health_needs_no_token_and_reflection_does(secured) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    for _ in range(CONNECTIONS):
        with channel(secured) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
            with pytest.raises(grpc.RpcError) as err:
                ProtoReflectionDescriptorDatabase(ch).get_services()
            assert err.value.code() == UNAUTHENTICATED
        with channel(secured, TOKEN_A) as ch:
            assert "mtpdraft.v1.Drafter" in ProtoReflectionDescriptorDatabase(ch).get_services()


def _accepted(s: Secured, token: str) -> bool:
    """Whether every one of CONNECTIONS fresh connections accepts `token`."""
    for _ in range(CONNECTIONS):
        with client(s, token) as c:
            try:
                c.info()
            except DrafterError as err:
                assert err.code == UNAUTHENTICATED
                return False
    return True


def _refused(s: Secured, token: str) -> bool:
    """Whether every one of CONNECTIONS fresh connections refuses `token`."""
    for _ in range(CONNECTIONS):
        with client(s, token) as c:
            try:
                c.info()
                return False
            except DrafterError as err:
                assert err.code == UNAUTHENTICATED
    return True


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_every_front_end_rereads_the_token_file(secured) -> None:
    original = secured.token_file.read_text()
    try:
        secured.token_file.write_text(f"{TOKEN_B}\n")
        _wait_for(lambda: _refused(secured, TOKEN_A))
        assert _accepted(secured, TOKEN_B)
    finally:
        secured.token_file.write_text(original)
        _wait_for(lambda: _accepted(secured, TOKEN_A))
