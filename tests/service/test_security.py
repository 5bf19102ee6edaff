"""TLS, mutual TLS and bearer tokens, against real `mtpdraft serve` processes on loopback.

Two servers: one with mutual TLS and a token file (most checks), one with TLS
only. The certificates are made at run time: a CA, a server certificate for
localhost / 127.0.0.1, a client certificate, and a second CA with a client
certificate of its own that the server must refuse.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from certificates import cert, new_key, pem
from drafting import hiddens
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from servers import (
    SERVER_ARGS,
    InProcessServer,
    ServerProcess,
    recording_tracer,
    small_engine,
    start_server,
)

from mtpdraft.client import AsyncDrafterClient, DrafterClient, DrafterError, Unavailable
from mtpdraft.service import cli
from mtpdraft.service.telemetry import Telemetry
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

TOKEN_A = "token-a-0123456789"
TOKEN_B = "token-b-9876543210"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
RELOAD_INTERVAL_S = 1.0  # how often a server reads its token file again, at most
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Pki:
    ca: Path  # the CA that signs the server's and the client's certificates
    server_cert: Path
    server_key: Path
    client_cert: bytes
    client_key: bytes
    rogue_ca: Path  # another CA, and a client certificate it signed
    rogue_cert: bytes
    rogue_key: bytes


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca_key, rogue_ca_key = new_key(), new_key()
    ca = cert("mtpdraft test CA", ca_key, ca=True)
    rogue_ca = cert("mtpdraft rogue CA", rogue_ca_key, ca=True)
    server_key, client_key, rogue_key = new_key(), new_key(), new_key()
    files = {
        "ca.pem": pem(ca),
        "rogue-ca.pem": pem(rogue_ca),
        "server.pem": pem(cert("localhost", server_key, ca, ca_key, server=True)),
        "server.key": pem(server_key),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return Pki(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=pem(cert("verifier", client_key, ca, ca_key)),
        client_key=pem(client_key),
        rogue_ca=folder / "rogue-ca.pem",
        rogue_cert=pem(cert("verifier", rogue_key, rogue_ca, rogue_ca_key)),
        rogue_key=pem(rogue_key),
    )


# --- servers --------------------------------------------------------------------------


@dataclass
class Servers:
    secure: str  # mutual TLS and tokens
    tls: str  # TLS only
    token_file: Path


@pytest.fixture(scope="module")
def servers(mimo_checkpoint, pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("auth") / "tokens"
    token_file.write_text(f"{TOKEN_A}\n\n{TOKEN_B}\n")
    tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    secure_args = (*tls, "--tls-client-ca", str(pki.ca), "--auth-token-file", str(token_file))
    with ThreadPoolExecutor(2) as pool:  # start both at once: half the wait
        secure = pool.submit(start_server, mimo_checkpoint, *SERVER_ARGS, *secure_args)
        tls_only = pool.submit(start_server, mimo_checkpoint, *SERVER_ARGS, *tls)
        procs = [secure.result(), tls_only.result()]
    try:
        assert "mutual TLS" in "".join(procs[0].lines)
        yield Servers(procs[0].address, procs[1].address, token_file)
    finally:
        for proc in procs:  # both drain at once; one SIGTERM each (a second may kill)
            proc.process.terminate()
        assert [_exit_code(proc.process) for proc in procs] == [0, 0]


def _exit_code(process: subprocess.Popen) -> int:
    try:
        return process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def mtls_client(servers: Servers, pki: Pki, token: str | None = TOKEN_A, **kw) -> DrafterClient:
    return DrafterClient(
        servers.secure,
        timeout=20,
        root_certificates=str(pki.ca),
        private_key=pki.client_key,
        certificate_chain=pki.client_cert,
        token=token,
        **kw,
    )


def mtls_channel(servers: Servers, pki: Pki, token: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key, pki.client_cert)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(servers.secure, creds)


def a_round_trip(c: DrafterClient, seed: int) -> None:
    """Every call kind: unary, the Prefill client stream, ProposeStream."""
    state = c.alloc_state()
    try:
        c.prefill(state, [1, 2, 3, 4], hiddens(4, seed), 1)
        proposal = c.propose(state, 5, hiddens(1, seed + 1), 5, 3)
        assert len(proposal.tokens) == 3
        with c.stream() as stream:
            proposal = stream.propose(state, 7, hiddens(1, seed + 2), 7, 2, previous=1)
        assert len(proposal.tokens) == 2
    finally:
        c.free_state(state)


def assert_unauthenticated(err: pytest.ExceptionInfo, words: str) -> None:
    assert err.value.code == UNAUTHENTICATED
    assert words in err.value.details


# --- TLS and mutual TLS ---------------------------------------------------------------


def test_tls_serves_a_trusting_client_and_refuses_plaintext(servers: Servers, pki: Pki) -> None:
    port = servers.tls.rsplit(":", 1)[1]
    # By IP (the certificate names 127.0.0.1), by name, and by an overridden name.
    for target, options in [
        (servers.tls, None),
        (f"localhost:{port}", None),
        (servers.tls, [("grpc.ssl_target_name_override", "localhost")]),
    ]:
        with DrafterClient(target, timeout=20, root_certificates=pki.ca, options=options) as c:
            assert c.info().model_family == "mimo"
    with DrafterClient(servers.tls, timeout=20, root_certificates=pki.ca.read_bytes()) as c:
        a_round_trip(c, 10)
    with DrafterClient(servers.tls, timeout=5) as c, pytest.raises(Unavailable):
        c.info()  # plaintext
    distrusting = DrafterClient(servers.tls, timeout=5, root_certificates=pki.rogue_ca)
    with distrusting as c, pytest.raises(Unavailable):
        c.info()  # the server's certificate is not signed by a CA it trusts


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(servers: Servers, pki: Pki) -> None:
    with mtls_client(servers, pki) as c:
        assert c.info().model_family == "mimo"
    anonymous = DrafterClient(servers.secure, timeout=5, root_certificates=pki.ca, token=TOKEN_A)
    rogue = DrafterClient(
        servers.secure,
        timeout=5,
        root_certificates=pki.ca,
        private_key=pki.rogue_key,
        certificate_chain=pki.rogue_cert,
        token=TOKEN_A,
    )
    for client in (anonymous, rogue, DrafterClient(servers.secure, timeout=5)):
        with client as c, pytest.raises(Unavailable):
            c.info()


# --- bearer tokens --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "words"), [(None, "missing 'authorization: Bearer"), ("wrong", "invalid bearer")]
)
def test_calls_without_the_right_token_are_unauthenticated(
    servers: Servers, pki: Pki, token: str | None, words: str
) -> None:
    with mtls_client(servers, pki, token) as c:
        with pytest.raises(DrafterError) as err:
            c.info()
        assert_unauthenticated(err, words)
        with pytest.raises(DrafterError) as err:
            c.prefill(1, [1, 2], hiddens(2, 1), 1)  # client stream
        assert_unauthenticated(err, words)
    # ProposeStream is refused as soon as it opens, before the client sends anything.
    with mtls_channel(servers, pki, token) as channel:
        call = pb_grpc.DrafterStub(channel).ProposeStream(iter(()), timeout=10)
        assert call.code() == UNAUTHENTICATED
        assert words in call.details()


def test_both_tokens_of_the_file_work(servers: Servers, pki: Pki) -> None:
    for seed, token in enumerate((TOKEN_A, TOKEN_B)):
        with mtls_client(servers, pki, token) as c:
            a_round_trip(c, seed)
            assert c.info().live_states == 0


def test_the_authorization_metadata_must_be_a_bearer_token(servers: Servers, pki: Pki) -> None:
    with mtls_channel(servers, pki) as channel:
        info = pb_grpc.DrafterStub(channel).GetInfo
        assert info(pb.GetInfoRequest(), metadata=[("authorization", f"bearer {TOKEN_B}")])
        for value in (f"Basic {TOKEN_A}", TOKEN_A, "Bearer "):
            with pytest.raises(grpc.RpcError) as err:
                info(pb.GetInfoRequest(), metadata=[("authorization", value)], timeout=10)
            assert err.value.code() == UNAUTHENTICATED
            assert "must be 'Bearer <token>'" in err.value.details()


def test_asyncio_client_with_and_without_the_token(servers: Servers, pki: Pki) -> None:
    def client(token: str | None) -> AsyncDrafterClient:
        return AsyncDrafterClient(
            servers.secure,
            timeout=20,
            root_certificates=pki.ca,
            private_key=pki.client_key,
            certificate_chain=pki.client_cert,
            token=token,
        )

    async def run() -> None:
        async with client(TOKEN_B) as c:
            state = await c.alloc_state()
            await c.prefill(state, [1, 2, 3], hiddens(3, 20), 1)
            assert len((await c.propose(state, 4, hiddens(1, 21), 4, 2)).tokens) == 2
            async with c.stream() as stream:
                proposal = await stream.propose(state, 6, hiddens(1, 22), 6, 2, previous=1)
            assert len(proposal.tokens) == 2
            assert await c.free_state(state)
        async with client("wrong") as c:
            for call in (c.info(), c.prefill(1, [1], hiddens(1, 23), 1)):
                with pytest.raises(DrafterError) as err:
                    await call
                assert_unauthenticated(err, "invalid bearer token")
            call = pb_grpc.DrafterStub(c.channel).ProposeStream(timeout=10)
            assert await call.code() == UNAUTHENTICATED

    asyncio.run(run())


def test_health_needs_no_token_and_reflection_does(servers: Servers, pki: Pki) -> None:
    with mtls_channel(servers, pki) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "mtpdraft.v1.Drafter"):
            request = health_pb2.HealthCheckRequest(service=service)
            assert check(request, timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert err.value.code() == UNAUTHENTICATED
    with mtls_channel(servers, pki, TOKEN_A) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "mtpdraft.v1.Drafter" in services


# --- the token file: rotation and revocation ----------------------------------------------

ORIGINAL_TOKENS = f"{TOKEN_A}\n\n{TOKEN_B}\n"


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _lines(log: str, words: str) -> int:
    return sum(words in line for line in log.splitlines())


@dataclass
class TokenServer:
    """A plaintext server with a token file (the client's token rides on local
    credentials: loopback), whose output is read without blocking."""

    server: ServerProcess
    token_file: Path

    def write(self, data: bytes | None) -> None:
        """Replaces the file at once, as an operator should: no reading sees it half
        written. None: by a link to a directory, which cannot be read."""
        new = self.token_file.with_suffix(".new")
        if data is None:
            new.symlink_to(self.token_file.parent)
        else:
            new.write_bytes(data)
        new.replace(self.token_file)

    def works(self, token: str) -> bool:
        with DrafterClient(self.server.address, timeout=20, token=token) as c:
            try:
                c.info()
            except DrafterError as err:
                assert err.code == UNAUTHENTICATED and "invalid bearer token" in err.details
                return False
            return True

    def new_log(self) -> str:
        """What the server wrote since the last call (a line is written before the
        answer of the call that caused it leaves)."""
        return self.server.new_output()

    def wait_for_reload(self, words: str) -> str:
        """Calls until the server has logged `words`, having read the file's change (it
        reads it again on a call, once a second at most). Returns the log."""
        log = ""

        def read_it() -> bool:
            nonlocal log
            self.works(TOKEN_B)
            log += self.new_log()
            return _lines(log, words) >= 1

        _wait_for(read_it)
        return log


@pytest.fixture(scope="module")
def token_server(mimo_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(ORIGINAL_TOKENS)
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--auth-token-file", str(token_file))
    os.set_blocking(server.process.stdout.fileno(), False)
    yield TokenServer(server, token_file)
    assert server.stop() == 0


@pytest.fixture
def tokens(token_server: TokenServer):
    """The server with both tokens, having read them; put back after the test, which
    must have let the server read its last change."""
    token_server.new_log()
    assert token_server.works(TOKEN_A) and token_server.works(TOKEN_B)
    yield token_server
    token_server.write(ORIGINAL_TOKENS.encode())
    token_server.wait_for_reload("reloaded: 2 tokens")


def test_a_token_is_rotated_and_revoked_by_rewriting_the_file(tokens: TokenServer) -> None:
    """Add the new token, move the clients over, remove the old one: no restart."""
    tokens.write(f"{TOKEN_B}\n".encode())
    tokens.wait_for_reload("reloaded: 1 tokens")
    assert not tokens.works(TOKEN_A)
    with DrafterClient(tokens.server.address, timeout=20, token=TOKEN_B) as c:
        a_round_trip(c, 30)  # unary, the Prefill client stream and ProposeStream
    with DrafterClient(tokens.server.address, timeout=20, token=TOKEN_A) as c:
        with pytest.raises(DrafterError) as err:
            c.prefill(1, [1, 2], hiddens(2, 1), 1)
        assert_unauthenticated(err, "invalid bearer token")
        with c.stream() as stream, pytest.raises(DrafterError) as err:
            stream.propose(1, 1, hiddens(1, 0), 1, 1)
        assert_unauthenticated(err, "invalid bearer token")


def test_a_stream_ends_at_its_first_message_after_its_token_is_revoked(
    tokens: TokenServer,
) -> None:
    address = tokens.server.address
    with DrafterClient(address, timeout=20, token=TOKEN_B) as admin:
        state = admin.alloc_state()
        admin.prefill(state, [1, 2, 3, 4], hiddens(4, 40), 1)
        try:
            with DrafterClient(address, timeout=20, token=TOKEN_A) as c, c.stream() as stream:
                assert len(stream.propose(state, 5, hiddens(1, 41), 5, 2).tokens) == 2
                tokens.write(f"{TOKEN_B}\n".encode())
                tokens.wait_for_reload("reloaded: 1 tokens")
                with pytest.raises(DrafterError) as err:
                    stream.propose(state, 6, hiddens(1, 42), 6, 2, previous=0)
                assert_unauthenticated(err, "the bearer token was revoked")
            # The refused message's verdict was not applied: the proposal still waits.
            assert admin.after_verify(state, 0).num_rows == 5
        finally:
            admin.free_state(state)


@pytest.mark.parametrize("how", ["emptied", "deleted"])
def test_an_emptied_or_deleted_file_accepts_no_token(tokens: TokenServer, how: str) -> None:
    if how == "emptied":
        tokens.write(b"\n  \n")
    else:
        tokens.token_file.unlink()
    words = ("holds no token" if how == "emptied" else "is gone") + ": every call is refused"
    log = tokens.wait_for_reload(words)
    # Refused on every call over several reload intervals, and logged once.
    started = time.monotonic()
    while time.monotonic() - started < 3 * RELOAD_INTERVAL_S:
        assert not tokens.works(TOKEN_A) and not tokens.works(TOKEN_B)
    log += tokens.new_log()
    assert _lines(log, words) == 1, log
    with grpc.insecure_channel(tokens.server.address) as channel:  # health needs no token
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    tokens.write(f"{TOKEN_A}\n".encode())
    tokens.wait_for_reload("reloaded: 1 tokens")
    assert tokens.works(TOKEN_A) and not tokens.works(TOKEN_B)


@pytest.mark.parametrize("how", ["unreadable", "garbled"])
def test_a_file_that_cannot_be_read_keeps_the_tokens_read_before(
    tokens: TokenServer, how: str
) -> None:
    if how == "unreadable":  # a directory: unreadable even to root, unlike permissions
        tokens.write(None)
        words = "cannot read the token file"
    else:
        tokens.write(f"{TOKEN_A}\n\x00garbage\xff\n".encode("latin-1"))
        words = "line 2 holds a character outside printable ASCII"
    log = tokens.wait_for_reload(words)
    assert _lines(log, "keeping the 2 tokens read before") == 1, log
    assert tokens.works(TOKEN_A) and tokens.works(TOKEN_B)


def test_unauthenticated_calls_are_refused_before_telemetry_sees_them(mimo_checkpoint) -> None:
    """In process, plaintext: the client's token rides on local credentials (loopback)."""
    tracer_provider, exporter = recording_tracer()
    server = InProcessServer(
        small_engine(mimo_checkpoint), telemetry=Telemetry(tracer_provider), tokens=[TOKEN_A]
    )
    try:
        with DrafterClient(server.address, timeout=10) as c, pytest.raises(DrafterError) as err:
            c.info()
        assert_unauthenticated(err, "missing")
        assert exporter.get_finished_spans() == ()
        with DrafterClient(server.address, timeout=10, token=TOKEN_A) as c:
            assert c.info().model_family == "mimo"
        assert [s.name for s in exporter.get_finished_spans()] == ["/mtpdraft.v1.Drafter/GetInfo"]
    finally:
        server.stop()


# --- configuration errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "none.pem", "--tls-key", "none.key"], "cannot read the TLS certificate"),
        (["--auth-token-file", "none"], "cannot read the token file"),
        (["--auth-token-file", "empty"], "holds no token"),
        (["--auth-token-file", "garbled"], "line 2 holds a character outside printable ASCII"),
    ],
)
def test_serve_names_bad_security_flags(flags, message, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").write_text("\n  \n")
    (tmp_path / "garbled").write_bytes(b"token\nto\tken\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--port", "0", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_client_security_arguments_are_checked(pki: Pki) -> None:
    with pytest.raises(ValueError, match="go together"):
        DrafterClient("127.0.0.1:1", root_certificates=pki.ca, private_key=pki.client_key)
    with pytest.raises(ValueError, match="put the credentials"):
        DrafterClient(channel=grpc.insecure_channel("127.0.0.1:1"), token=TOKEN_A)
    with pytest.raises(ValueError, match="one line"):
        AsyncDrafterClient("127.0.0.1:1", token="a\nb")


def test_a_refused_stream_reports_unauthenticated_to_every_call(servers: Servers, pki: Pki) -> None:
    with mtls_client(servers, pki, token=None) as c, c.stream() as stream:
        for _ in range(2):  # the call in flight, and one made after the stream closed
            with pytest.raises(DrafterError) as err:
                stream.propose(1, 1, hiddens(1, 0), 1, 1)
            assert_unauthenticated(err, "authorization")
