"""The Redis store, by concern: one small class per concept over one client (the queue,
fleet state, the replica protocol, adapters, service shares, preemption orders, reads).
:class:`Store` only bundles them for a part that needs several (the dispatcher); a part
that needs one is given that one (``gateway/services.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.storage.adapter_store import AdapterStore
from gateway.storage.fleet_store import FleetStore
from gateway.storage.preempt_store import PreemptStore
from gateway.storage.queue_store import QueueStore
from gateway.storage.read_store import ReadStore
from gateway.storage.replica_store import ReplicaStore
from gateway.storage.share_store import ShareStore


@dataclass(frozen=True, slots=True)
class Store:
    """The store's concern classes over one client."""

    client: aioredis.Redis
    queue: QueueStore
    fleet: FleetStore
    replicas: ReplicaStore
    adapters: AdapterStore
    shares: ShareStore
    preempts: PreemptStore
    reads: ReadStore

    @classmethod
    def over(cls, client: aioredis.Redis, request_ttl_s: float | Callable[[], float],
             fleet: Sequence[str] = ()) -> Store:
        """Every concern over ``client``; ``request_ttl_s`` (seconds, or what reads them
        from the settings in force) and ``fleet``: the queue's (:class:`QueueStore`)."""
        ttl = request_ttl_s if callable(request_ttl_s) else _fixed(float(request_ttl_s))
        return cls(client, QueueStore(client, ttl, fleet), FleetStore(client),
                   ReplicaStore(client), AdapterStore(client), ShareStore(client),
                   PreemptStore(client), ReadStore(client))


def _fixed(seconds: float) -> Callable[[], float]:
    return lambda: seconds
