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
from vector_runner import (
    OTHER_CPUS,
    DefaultServer,
    Outcome,
    load_vector,
    mismatches,
    replay,
    variant,
)

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


def test_batches_are_compared_field_by_field() -> None:
    """No server: a batch's answer that departs from its expect anywhere (a draft, a prob
    beyond the tolerance, a row error's field, a missing row) is a mismatch; probs within
    the tolerance are not."""
    columns = {
        "width": 2,
        "drafts": [[5, -1], [-1, -1]],
        "probs": [[0.5, 0.0], [0.0, 0.0]],
        "draft_counts": [1, 0],
        "confidences": [0.25, 0.0],
        "first_positions": [9, 0],
        "errors": [{"row": 1, "code": "NOT_FOUND", "reason": "STATE_NOT_FOUND", "field": "x"}],
    }
    assert mismatches(columns, columns | {"probs": [[0.55, 0.0], [0.0, 0.01]]}, 0.1) == []
    for key, value in [
        ("drafts", [[6, -1], [-1, -1]]),
        ("probs", [[0.7, 0.0], [0.0, 0.0]]),
        ("probs", [[0.5, 0.0]]),
        ("confidences", [0.25, 0.2]),
        ("first_positions", [9, 10]),
        ("errors", [{**columns["errors"][0], "field": "state_ids"}]),
        ("errors", []),
        ("width", 3),
    ]:
        assert [m.split(":")[0] for m in mismatches(columns, columns | {key: value}, 0.1)] == [key]
