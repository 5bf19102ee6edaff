"""Where a state lives among replicas, and bringing it to the replica its key reaches now.

Behind a proxy a state lives on the replica its affinity key reached when the state was
made, and its id names that replica's instance (the epoch, bits 43..62 of the id; each
replica's GetInfo.instance_epoch). When the ring sends the key elsewhere (a replica came
back on its address and takes its keys back, one was added, removed or skipped), calls for
the state answer STATE_LOST on the key's new replica, yet the state may still live where it
was: there it holds KV that no call through the proxy reaches, not even its FreeState.

``Replicas`` holds the replicas' own addresses (on Kubernetes each pod's Service, locally
the addresses deploy/local.py prints) and finds the one that issued a state id.
``recover_state`` brings a lost state to the key's replica: moved (``move_state``: no
re-prefill, the old copy freed) while the replica that holds it lives, re-prefilled from
the verifier's committed rows otherwise, and the old copy freed whatever happens:

    replicas = Replicas(["drafter-0:50051", "drafter-1:50051", "drafter-2:50051"])
    try:
        p = client.propose(state, token, hidden, position, k, previous=verdict)
    except StateLost:
        state = recover_state(client, state, tokens[1:position], hiddens[: position - 1],
                              replicas=replicas, verdict=verdict).state
        p = client.propose(state, token, hidden, position, k)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any, NamedTuple

from .errors import DrafterError
from .messages import DEFAULT, Timeout
from .recovery import move_state, reprefill
from .sync_client import DrafterClient
from .types import Verdict
from .wire import Array

# A replica's direct channel keeps its connection state to itself (gRPC shares one per
# address in a process otherwise) and tries a refused address again within a second: a
# replica that restarts on its address answers the next look.
CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
EPOCH_SHIFT = 43  # an id's bits 43..62 are the epoch of the instance that issued it
EPOCH_MASK = (1 << 20) - 1


def epoch_of(state_id: int) -> int:
    """The instance epoch of the replica that issued ``state_id``."""
    return (state_id >> EPOCH_SHIFT) & EPOCH_MASK


class Replicas:
    """The replicas' own addresses, each reached directly (not through the proxy);
    ``options`` are DrafterClient's (timeout, tls, token...). ``probe_timeout`` bounds the
    GetInfo that asks each replica its epoch: a stopped replica is passed over."""

    def __init__(self, addresses: Sequence[str], *, probe_timeout: float = 2.0, **options: Any):
        self.addresses = list(addresses)
        self.probe_timeout = probe_timeout
        options.setdefault("options", CHANNEL_OPTIONS)
        self._clients = {a: DrafterClient(a, **options) for a in self.addresses}

    def epochs(self) -> dict[int, str]:
        """Each answering replica's address by its instance epoch, asked now (an instance
        that restarted answers with a new epoch)."""
        found = {}
        for address, client in self._clients.items():
            with suppress(DrafterError):
                found[client.info(timeout=self.probe_timeout).instance_epoch] = address
        return found

    def holder(self, state_id: int) -> DrafterClient | None:
        """A direct client of the live replica that issued ``state_id``, or None (its
        instance is gone: the state with it)."""
        address = self.epochs().get(epoch_of(state_id))
        return None if address is None else self._clients[address]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Recovered(NamedTuple):
    state: int  # the state on the replica the key reaches now
    moved: bool  # its KV moved from the replica that held it (else re-prefilled)


def recover_state(
    client: DrafterClient,
    state: int,
    tokens: Sequence[int] | Array,
    hiddens: Array | None,
    *,
    replicas: Replicas | None = None,
    verdict: Verdict | int | None = None,
    start_position: int = 1,
    timeout: Timeout = DEFAULT,
) -> Recovered:
    """A state that answered STATE_LOST, on the replica ``client`` (keyed) reaches now.

    If a replica among ``replicas`` still holds it, its pending ``verdict`` is applied there
    (AfterVerify) and its KV moved (``move_state``), the old copy freed; else, or if the move
    fails, it is re-prefilled from the committed rows (``tokens``, ``hiddens`` from
    ``start_position``: ``reprefill``) and the old copy, if any, freed. Either way the next
    Propose carries no verdict, at the position after the committed rows."""
    holder = None if replicas is None else replicas.holder(state)
    if holder is not None:
        try:
            if isinstance(verdict, int):
                holder.after_verify(state, verdict)
            elif verdict is not None:
                refeed = verdict.refeed_hiddens
                holder.after_verify(state, verdict.num_accepted, refeed_hiddens=refeed)
            return Recovered(move_state(holder, client, state, timeout=timeout), True)
        except DrafterError:
            with suppress(DrafterError):  # rebuilt below: the copy left there goes
                holder.free_state(state, timeout=timeout)
    new = reprefill(client, tokens, hiddens, start_position=start_position, timeout=timeout)
    return Recovered(new, False)
