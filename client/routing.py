"""Several replicas without a proxy: gRPC's own ring_hash policy, hashing the affinity key.

A channel to all replicas (a multi-address target, or a DNS name with one address per
replica, e.g. a Kubernetes headless Service) with the ring_hash load-balancing policy
and its request hash header set to ``x-mtpdraft-affinity`` sends every call of one key
to one replica, as the proxy does (its ring is gRPC's, not nginx's: use one or the
other for a deployment):

    from mtpdraft.client import DrafterClient
    from mtpdraft.client.routing import replicas_target, ring_hash_options

    client = DrafterClient(
        replicas_target(["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]),
        options=ring_hash_options(),
        affinity_key="engine-7",
    )

A replica that stops taking connections drops out of the ring: its keys go to the next
replica, where their states answer STATE_LOST. gRPC C-core (Python, C++) reads the hash
header from the policy's config only while GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY
is true (gRFC A76; grpcio 1.85 still asks for it): ``ring_hash_options`` sets it for this
process where it is unset. Without it every call fails INTERNAL, "hash attribute not
present".
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Sequence
from typing import Any

from .messages import AFFINITY_HEADER

RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"


def ring_hash_service_config(
    header: str = AFFINITY_HEADER, min_ring_size: int = 1024
) -> dict[str, Any]:
    """The service config that picks a replica by consistent hashing on `header`."""
    policy = {"requestHashHeader": header, "minRingSize": min_ring_size}
    return {"loadBalancingConfig": [{"ring_hash_experimental": policy}]}


def ring_hash_options(
    header: str = AFFINITY_HEADER, min_ring_size: int = 1024
) -> list[tuple[str, Any]]:
    """Channel options for ring_hash on `header` (sets RING_HASH_ENV where unset)."""
    os.environ.setdefault(RING_HASH_ENV, "true")
    config = ring_hash_service_config(header, min_ring_size)
    return [("grpc.service_config", json.dumps(config))]


def replicas_target(addresses: Sequence[str]) -> str:
    """A gRPC target naming every replica ("host:port" IP literals, all IPv4 or all
    IPv6): ``ipv4:a:p,b:q``. For host names, give one DNS name that resolves to every
    replica instead (``dns:///drafter.ns.svc.cluster.local:50051``)."""
    if not addresses:
        raise ValueError("replicas_target: no addresses")
    families = set()
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"replicas_target: {address!r} is not host:port")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(
                f"replicas_target: {host!r} is not an IP address; give one DNS name that "
                "resolves to every replica as the target instead"
            ) from None
        families.add(ip.version)
    if len(families) > 1:
        raise ValueError("replicas_target: IPv4 and IPv6 addresses mixed")
    return f"ipv{families.pop()}:" + ",".join(addresses)
