"""Which replicas are alive, by what the store holds of them (``replica_alive`` and
``reap_dead`` in ``gateway/storage/lua/lib/replicas.lua`` apply this rule;
``tests/store/test_lua_replicas_spec.py`` holds the Lua to it).

A replica is alive while its heartbeat is fresher than ``ttl_s`` and it picks up the
grants other replicas push to it: its grant listener waits on its grant list all the
time, so a grant left unread for ``pickup_s`` means it died or its listener is wedged,
whatever its last heartbeat says, unless the listener made a turn within ``ttl_s`` (an
overloaded replica working through its grants, late, is alive: taking it for dead would
drop its queued requests). A dead replica's queued requests are dropped when a dispatch
reaches them; the reap releases what it held and forgets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaSeen:
    """What the store holds of one replica (unix s; None: nothing held)."""

    beat: float | None  # its last heartbeat
    oldest_grant: float | None = None  # when the grant at the head of its list was pushed
    listened: float | None = None  # its grant listener's last turn, as it reported it


def alive(seen: ReplicaSeen, now: float, ttl_s: float, pickup_s: float) -> bool:
    """Whether the replica counts as alive at ``now``."""
    if seen.beat is None or seen.beat < now - ttl_s:
        return False
    if seen.oldest_grant is not None and seen.oldest_grant < now - pickup_s:
        return seen.listened is not None and seen.listened >= now - ttl_s
    return True


def dead(replicas: Mapping[str, ReplicaSeen], now: float, ttl_s: float,
         pickup_s: float) -> list[str]:
    """The registered replicas (those with a heartbeat) a reap at ``now`` forgets, by
    name."""
    return sorted(name for name, seen in replicas.items()
                  if seen.beat is not None and not alive(seen, now, ttl_s, pickup_s))
