"""The Python client replays the conformance vector (vector.json) over real servers.

The Node.js, Go and C++ runners (client/node, client/go, client/cpp) replay the same
vector; .ci/polyglot.sh runs all four against one server, whose address it passes in
MTPDRAFT_CONFORMANCE_ADDRESS. Without it, this test starts the server itself:
`python3 -m mtpdraft serve --port 0 --device cpu` (the embedded default model, bf16).

The vector's drafts are the float64 oracle's, so it holds for any valid server
within its derived tolerances: here also a `--dtype float32` server within the
tight float32 one, and both dtypes on the kernels torch picks for other x86-64
CPUs (vector_runner.OTHER_CPUS), as CI runs on whatever CPU it gets.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest
from vector_runner import OTHER_CPUS, DefaultServer, Outcome, load_vector, replay, variant

from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

ADDRESS_ENV = "MTPDRAFT_CONFORMANCE_ADDRESS"
FLOAT32 = ("--dtype", "float32")

#: name: (server options, environment, the vector's variant)
SERVERS = {
    "float32": (FLOAT32, None, "float32"),
    **{f"bfloat16-{cpu}": ((), env, None) for cpu, env in OTHER_CPUS.items()},
    **{f"float32-{cpu}": (FLOAT32, env, "float32") for cpu, env in OTHER_CPUS.items()},
}


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    if os.environ.get(ADDRESS_ENV):
        yield os.environ[ADDRESS_ENV]
        return
    with DefaultServer() as server:
        yield server.address


def assert_passes(outcomes: list[Outcome], name: str, count: int) -> None:
    for o in outcomes:
        print(o.line())
    failed = [o.line() for o in outcomes if not o.ok]
    print(f"python ({name}): {len(outcomes) - len(failed)} passed, {len(failed)} failed")
    assert not failed, "\n".join(failed)
    assert len(outcomes) == count


def test_vector_was_made_from_the_default_checkpoint() -> None:
    digests = load_vector()["checkpoint"]["sha256"]
    for name, digest in digests.items():
        got = hashlib.sha256((DEFAULT_CHECKPOINT / name).read_bytes()).hexdigest()
        assert got == digest, f"{name} changed: run tests/conformance/make_vector.py"


def test_python_client_replays_the_vector(address: str) -> None:
    ops, tol = variant(load_vector())
    assert_passes(replay(address, ops, tol), "bfloat16", len(ops))


@pytest.mark.parametrize("name", SERVERS)
def test_vector_holds_on_other_servers(name: str) -> None:
    extra, env, var = SERVERS[name]
    ops, tol = variant(load_vector(), var)
    with DefaultServer(*extra, env=env) as server:
        assert_passes(replay(server.address, ops, tol), name, len(ops))
