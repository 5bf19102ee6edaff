"""Replicas behind a proxy on loopback: `mtpdraft serve` processes of the test checkpoint
behind Debian's nginx (deploy/local.py starts both, as a developer would), and the
reference drafts of one server for the same verifiers.

nginx must be installed (.ci/run installs it); without it these tests skip, unless
MTPDRAFT_REQUIRE_NGINX is set (CI), where they fail.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import PATIENCE, SERVER_ARGS
from verifiers import Verifier

from mtpdraft.client import DrafterClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
import local  # deploy/local.py

REPLICAS = 3
STEPS = 5


@pytest.fixture(scope="session")
def nginx() -> str:
    path = local.find_nginx()
    if path is None:
        why = "nginx is not installed (apt-get install nginx; .ci/run installs it)"
        if os.environ.get("MTPDRAFT_REQUIRE_NGINX"):
            pytest.fail(why)
        pytest.skip(why)
    return path


@dataclass
class Topology:
    replicas: list[local.Replica]
    proxy: local.Proxy

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def epochs(self) -> dict[int, local.Replica]:
        """Each live replica by its instance epoch (GetInfo)."""
        found = {}
        for r in self.replicas:
            if r.process.poll() is None:
                with DrafterClient(r.address, timeout=PATIENCE) as c:
                    found[c.info().instance_epoch] = r
        return found

    def live_states(self) -> dict[int, int]:
        """GetInfo.live_states of each live replica, by epoch."""
        counts = {}
        for epoch, r in self.epochs().items():
            with DrafterClient(r.address, timeout=PATIENCE) as c:
                counts[epoch] = c.info().live_states
        return counts

    def stop(self) -> None:
        self.proxy.stop()
        local.stop_all(self.replicas)


def start_topology(checkpoint: Path, prefix: Path, *extra: str, config: str = "local") -> Topology:
    """Replicas of `checkpoint` (`extra`: more serve flags) behind nginx with `config`:
    "local" (nginx/local.conf.template) or "k8s" (nginx/k8s.conf on loopback)."""
    args = ["--model", str(checkpoint), "--device", "cpu", *SERVER_ARGS, *extra]
    replicas = local.start_replicas(REPLICAS, args, log_dir=prefix)
    try:
        addresses = [r.address for r in replicas]
        proxy = local.start_proxy(addresses, prefix / "nginx", render=local.CONFIGS[config])
    except BaseException:
        local.stop_all(replicas)
        raise
    return Topology(replicas, proxy)


@pytest.fixture(scope="module", params=sorted(local.CONFIGS))
def topology(request, nginx, mimo_checkpoint, tmp_path_factory) -> Iterator[Topology]:
    """Three replicas behind nginx, with each of its configs, shared by a module's tests,
    each of which must leave them holding nothing."""
    prefix = tmp_path_factory.mktemp("nginx")
    topo = start_topology(mimo_checkpoint, prefix, config=request.param)
    yield topo
    topo.stop()


@pytest.fixture
def proxy_client(topology: Topology) -> Iterator[DrafterClient]:
    with DrafterClient(topology.proxy.address, timeout=PATIENCE) as c:
        yield c
    assert set(topology.live_states().values()) <= {0}, "a state leaked on a replica"


@pytest.fixture(scope="session")
def reference(server) -> dict:
    """The drafts one server gives a verifier (by seed and sequences), each run once."""
    cache: dict = {}

    def drafts(seed: int, sequences: int, steps: int = STEPS) -> Verifier:
        if (seed, sequences, steps) not in cache:
            verifier = Verifier(seed, "reference", sequences)
            with DrafterClient(server.address, timeout=PATIENCE) as c:
                verifier.run(c, steps)
                verifier.finish(c)
            cache[seed, sequences, steps] = verifier
        return cache[seed, sequences, steps]

    return drafts


def keys_by_replica(client: DrafterClient, per_replica: int, replicas: int = REPLICAS) -> dict:
    """{epoch: [key, ...]}: `per_replica` keys that the proxy sends to each replica, found
    by asking (a state allocated and freed per key tried)."""
    found: dict[int, list[str]] = {}
    for n in range(1000):
        key = f"engine-{n}"
        keyed = client.keyed(key)
        state = keyed.alloc_state()
        keyed.free_state(state)
        bucket = found.setdefault(state >> 43, [])
        if len(bucket) < per_replica:
            bucket.append(key)
        if len(found) == replicas and all(len(b) == per_replica for b in found.values()):
            return found
    raise AssertionError(f"1000 keys did not reach every replica: {found}")


def assert_same_drafts(got: Verifier, want: Verifier) -> None:
    assert got.drafts == want.drafts, got.key
    for step_got, step_want in zip(got.probs, want.probs, strict=True):
        for p, q in zip(step_got, step_want, strict=True):
            assert p == pytest.approx(q, rel=1e-4, abs=1e-6), got.key
