"""The Python client replays the conformance vector (vector.json) over a real server.

The Node.js, Go and C++ runners (client/node, client/go, client/cpp) replay the same
vector; .ci/polyglot.sh runs all four against one server, whose address it passes in
MTPDRAFT_CONFORMANCE_ADDRESS. Without it, this test starts the server itself:
`python3 -m mtpdraft serve --port 0 --device cpu` (the embedded default model).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest
from vector_runner import DefaultServer, Replayer, load_vector

from mtpdraft.client import DrafterClient
from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

ADDRESS_ENV = "MTPDRAFT_CONFORMANCE_ADDRESS"


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    if os.environ.get(ADDRESS_ENV):
        yield os.environ[ADDRESS_ENV]
        return
    with DefaultServer() as server:
        yield server.address


def test_vector_was_made_from_the_default_checkpoint() -> None:
    digests = load_vector()["checkpoint"]["sha256"]
    for name, digest in digests.items():
        got = hashlib.sha256((DEFAULT_CHECKPOINT / name).read_bytes()).hexdigest()
        assert got == digest, f"{name} changed: run tests/conformance/make_vector.py"


def test_python_client_replays_the_vector(address: str) -> None:
    vector = load_vector()
    with DrafterClient(address, timeout=30.0) as client:
        outcomes = Replayer(client, tolerance=vector["prob_tolerance"]).run(vector["operations"])
    for o in outcomes:
        print(o.line())
    failed = [o.line() for o in outcomes if not o.ok]
    print(f"python: {len(outcomes) - len(failed)} passed, {len(failed)} failed")
    assert not failed, "\n".join(failed)
    assert len(outcomes) == len(vector["operations"])
