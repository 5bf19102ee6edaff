"""Three replicas behind nginx, many verifiers with distinct affinity keys: every call of a
key reaches one replica, the drafts are one server's, a replica killed mid-load loses no
other replica's state and its verifiers resume with the same drafts, a draining replica's
states move to the others by export / import. Then gRPC's own ring_hash, without a proxy."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import (
    STEPS,
    Topology,
    assert_same_drafts,
    keys_by_replica,
    start_topology,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import PATIENCE
from verifiers import Verifier

from mtpdraft.client import (
    DrafterClient,
    DrafterError,
    InvalidArgument,
    Unavailable,
    move_state,
)
from mtpdraft.client.routing import replicas_target, ring_hash_options


def run_all(verifiers: list[Verifier], client: DrafterClient, steps: int = STEPS, **run) -> None:
    """Each verifier on a thread of its own, all at once, over one channel."""
    failures: list[BaseException] = []

    def go(v: Verifier) -> None:
        try:
            v.run(client.keyed(v.key), steps, **run)
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=go, args=(v,)) for v in verifiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads), "a verifier hung"


def finish_all(verifiers: list[Verifier], client: DrafterClient) -> None:
    for v in verifiers:
        v.finish(client.keyed(v.key))


def test_a_call_without_a_key_is_refused_at_the_proxy(proxy_client: DrafterClient) -> None:
    with pytest.raises(InvalidArgument) as err:
        proxy_client.alloc_state()
    assert err.value.reason == "AFFINITY_KEY_MISSING" and "x-mtpdraft-affinity" in str(err.value)
    assert proxy_client.info().hidden_size == 64  # GetInfo needs none: any replica answers
    health = health_pb2_grpc.HealthStub(proxy_client.channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service="mtpdraft.v1.Drafter"))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_every_key_lands_on_one_replica_and_drafts_as_one_server(
    topology: Topology, proxy_client: DrafterClient, reference
) -> None:
    keys = keys_by_replica(proxy_client, per_replica=2)
    verifiers = [
        Verifier(seed, key, sequences=2, columns=seed % 2 == 0)
        for seed, key in enumerate(key for bucket in keys.values() for key in bucket)
    ]
    run_all(verifiers, proxy_client)
    live = topology.live_states()  # before the states are freed: each replica's own
    for v in verifiers:
        assert len(v.epochs) == 1, (v.key, v.epochs)  # one replica for all its calls
        assert (v.recoveries, v.retries) == (0, 0)
        assert_same_drafts(v, reference(v.seed, 2))
    assert live == {epoch: 2 * len(bucket) for epoch, bucket in keys.items()}
    finish_all(verifiers, proxy_client)


def test_a_draining_replicas_states_move_to_the_ring_without_it(
    nginx, mimo_checkpoint, tmp_path, reference
) -> None:
    """SIGTERM: the replica answers NOT_SERVING and takes no new state; the proxy's ring
    drops it (Kubernetes: its readiness fails; here: a reload), and each verifier moves its
    states there by export / import, then goes on with the same drafts. With no state
    left, the replica's drain ends before its grace period."""
    topology = start_topology(mimo_checkpoint, tmp_path, "--grace-period", "30")
    try:
        with DrafterClient(topology.proxy.address, timeout=PATIENCE) as proxy:
            keys = keys_by_replica(proxy, per_replica=2)
            epochs = topology.epochs()
            victim_epoch = next(iter(keys))
            victim = epochs[victim_epoch]
            verifiers = [Verifier(40 + i, key) for i, key in enumerate(keys[victim_epoch])]
            run_all(verifiers, proxy, steps=2)
            with DrafterClient(victim.address, timeout=PATIENCE) as direct:
                for v in verifiers:
                    v.settle(direct)  # TakeKV needs no proposal pending
                victim.process.terminate()
                health = health_pb2_grpc.HealthStub(direct.channel)
                request = health_pb2.HealthCheckRequest(service="mtpdraft.v1.Drafter")
                while health.Check(request).status == health_pb2.HealthCheckResponse.SERVING:
                    time.sleep(0.01)  # the signal is on its way
                with pytest.raises(Unavailable) as err:
                    direct.alloc_state()
                assert err.value.reason == "DRAINING"
                topology.proxy.reload([r.address for r in topology.replicas if r is not victim])
                for v in verifiers:
                    keyed = proxy.keyed(v.key)
                    # The proxy's old workers finish the calls of their connections: the
                    # key reaches its new replica a moment later (GetInfo with it says).
                    deadline = time.monotonic() + PATIENCE
                    while keyed.info().instance_epoch == victim_epoch:
                        assert time.monotonic() < deadline, "the proxy never moved the key"
                        time.sleep(0.05)
                    for s in v.seqs:
                        s.state = move_state(direct, keyed, s.state)
                        v.epochs.add(s.state >> 43)
            assert victim.process.wait(PATIENCE) == 0  # no state left: drained, stopped
            for v in verifiers:
                v.run_more(proxy.keyed(v.key), STEPS - 2)
                assert len(v.epochs) == 2 and victim_epoch in v.epochs
                assert_same_drafts(v, reference(v.seed, 2))
            finish_all(verifiers, proxy)
    finally:
        topology.stop()


@pytest.mark.parametrize("config", ["local", "k8s"])
def test_killing_a_replica_mid_load_loses_no_other_state(
    nginx, mimo_checkpoint, tmp_path, reference, config
) -> None:
    """SIGKILL one replica while every verifier is mid-run: the others' verifiers never
    notice; the victim's see STATE_LOST (or their call cut off), re-prefill from their own
    rows where the key now goes, and draft what one server drafts. Through each config."""
    topology = start_topology(mimo_checkpoint, tmp_path, config=config)
    try:
        with DrafterClient(topology.proxy.address, timeout=PATIENCE) as proxy:
            keys = keys_by_replica(proxy, per_replica=2)
            epochs = topology.epochs()
            victim_epoch = next(iter(keys))
            verifiers = [
                Verifier(seed, key, sequences=2, columns=seed % 2 == 1)
                for seed, key in enumerate(key for bucket in keys.values() for key in bucket)
            ]
            ready = threading.Barrier(len(verifiers) + 1)
            cut = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

            def between(step: int) -> None:
                if step == 2:  # all have states everywhere; the kill comes as they go on
                    ready.wait(PATIENCE)

            def retry(err: DrafterError) -> bool:  # a call cut off as its replica died
                return err.code in cut

            def kill() -> None:
                ready.wait(PATIENCE)
                epochs[victim_epoch].kill()

            killer = threading.Thread(target=kill)
            killer.start()
            run_all(verifiers, proxy, between=between, retry=retry)
            killer.join(PATIENCE)
            for v in verifiers:
                (home,) = [epoch for epoch, bucket in keys.items() if v.key in bucket]
                if home == victim_epoch:
                    assert v.recoveries >= 1 and len(v.epochs) == 2, (v.key, v.epochs)
                else:  # nothing lost, nothing retried
                    assert (v.recoveries, v.retries, v.epochs) == (0, 0, {home}), v.key
                assert_same_drafts(v, reference(v.seed, 2))
            # Each survivor holds its own keys' states and the victim's moved ones.
            live = topology.live_states()
            assert sum(live.values()) == 2 * len(verifiers) and len(live) == 2
            finish_all(verifiers, proxy)
            assert set(topology.live_states().values()) == {0}
    finally:
        topology.stop()


def test_one_refused_connection_moves_one_call_not_the_replicas_keys(
    topology: Topology, proxy_client: DrafterClient
) -> None:
    """A replica killed and back on its address: the one call nginx could not connect
    for went to the next replica on the ring, and the very next call of the key reaches
    the replica again; its keys did not move for fail_timeout after one error."""
    keys = keys_by_replica(proxy_client, per_replica=1)
    victim_epoch, (key,) = next(iter(keys.items()))
    victim = topology.epochs()[victim_epoch]
    keyed = proxy_client.keyed(key)
    victim.kill()
    assert keyed.info().instance_epoch != victim_epoch  # refused: answered by the next one
    victim.restart()
    assert keyed.info().instance_epoch in set(topology.epochs()) - set(keys)


def test_ring_hash_without_a_proxy(topology: Topology, proxy_client, reference) -> None:
    """gRPC's ring_hash policy over the replicas' addresses, hashing the same key header:
    one replica per key, one server's drafts."""
    with DrafterClient(
        replicas_target(topology.addresses), options=ring_hash_options(), timeout=PATIENCE
    ) as ring:
        verifiers = [Verifier(seed, f"ring-{seed}", sequences=1) for seed in range(10)]
        run_all(verifiers, ring, steps=3)
        homes = set()
        for v in verifiers:
            assert len(v.epochs) == 1
            homes |= v.epochs
            assert_same_drafts(v, reference(v.seed, 1, 3))
        assert len(homes) > 1  # the keys spread (10 keys all on one of 3: 1 in 20,000)
        finish_all(verifiers, ring)
