"""A Valkey Cluster on loopback: real ``valkey-server`` processes in cluster mode, for
the tests and the benchmarks (``fairgate bench shards``).

``ValkeyCluster(masters=3, replicas_each=1)`` starts the nodes (children that die with
this process, as :class:`~gateway.storage.embedded_redis.EmbeddedRedis`), gives each
master an equal range of the 16384 slots, joins them (CLUSTER MEET), makes the replicas
(CLUSTER REPLICATE) and waits until every node reports ``cluster_state:ok``. A short
``cluster-node-timeout`` makes a killed master's replica take over within seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.crc import key_slot

from gateway.storage.embedded_redis import EmbeddedRedis, free_port

SLOTS = 16384


@dataclass
class Node:
    server: EmbeddedRedis
    bus_port: int
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.server.host, port=self.server.port, socket_timeout=2,
                           decode_responses=True)

    def call(self, *args: Any) -> Any:
        with self.client() as c:
            return c.execute_command(*args)


class ValkeyCluster:
    def __init__(self, data_dir: Path, masters: int = 3, replicas_each: int = 1,
                 node_timeout_ms: int = 1000, start_timeout_s: float = 30.0) -> None:
        self.data_dir = data_dir
        self.masters_count = masters
        self.replicas_each = replicas_each
        self.node_timeout_ms = node_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.nodes: list[Node] = []

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes if n.server.process is not None]

    def start(self) -> ValkeyCluster:
        total = self.masters_count * (1 + self.replicas_each)
        try:
            for i in range(total):
                bus_port = free_port()
                server = EmbeddedRedis(data_dir=self.data_dir / f"node{i}", extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    # the bus port: not port + 10000 (an ephemeral port may be too high)
                    "--cluster-port", str(bus_port),
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    # the other shards answer while one has no master (Valkey's default
                    # stops every shard until its failover ends): what fairgate's
                    # deployments set, and what lets the other shards' models not notice
                    "--cluster-require-full-coverage", "no",
                    # a replica takes over however long it was cut off (a test kills)
                    "--cluster-replica-validity-factor", "0"))
                self.nodes.append(Node(server.start(), bus_port))
            for node in self.nodes:
                node.node_id = node.call("CLUSTER", "MYID")
            self._assign_slots()
            first = self.nodes[0]
            for node in self.nodes[1:]:
                first.call("CLUSTER", "MEET", node.server.host, node.server.port,
                           node.bus_port)
            self._until(lambda: all(len(self._known(n)) == total for n in self.nodes),
                        "every node knows every other")
            masters = self.nodes[:self.masters_count]
            for i, node in enumerate(self.nodes[self.masters_count:]):
                node.call("CLUSTER", "REPLICATE", masters[i % self.masters_count].node_id)
            self._until(self._healthy, "cluster_state:ok and every replica in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def _assign_slots(self) -> None:
        per = SLOTS // self.masters_count
        for i, node in enumerate(self.nodes[:self.masters_count]):
            first = i * per
            last = SLOTS - 1 if i == self.masters_count - 1 else first + per - 1
            node.call("CLUSTER", "ADDSLOTSRANGE", first, last)

    @staticmethod
    def _known(node: Node) -> list[str]:
        return [line for line in str(node.call("CLUSTER", "NODES")).splitlines()
                if line.strip() and "handshake" not in line and "noaddr" not in line]

    def _healthy(self) -> bool:
        for node in self.live():
            info = str(node.call("CLUSTER", "INFO"))
            if "cluster_state:ok" not in info:
                return False
            role = node.call("ROLE")
            if role[0] == "slave" and role[3] != "connected":
                return False
        return True

    def _until(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"valkey cluster: not {what} within {self.start_timeout_s}s")

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.server.process is not None]

    def master_of(self, key: str) -> Node:
        """The live node serving ``key``'s slot as a master now."""
        slot = key_slot(key.encode())
        for node in self.live():
            try:
                if node.call("ROLE")[0] != "master":
                    continue
                for start, end, *_ in node.call("CLUSTER", "SLOTS"):
                    if int(start) <= slot <= int(end):
                        owner = _owner(node.call("CLUSTER", "SHARDS"), slot)
                        if owner == node.node_id:
                            return node
            except redis.RedisError:
                continue
        raise LookupError(f"no live master serves slot {slot} ({key})")

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Until every live node says ``cluster_state:ok`` (after a failover)."""
        saved = self.start_timeout_s
        self.start_timeout_s = timeout_s or saved
        try:
            self._until(self._healthy, "cluster_state:ok again")
        finally:
            self.start_timeout_s = saved

    def stop(self) -> None:
        for node in self.nodes:
            node.server.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _owner(shards: Any, slot: int) -> str | None:
    """The master node id of ``slot`` in a CLUSTER SHARDS reply."""
    for shard in shards:
        fields = dict(zip(shard[::2], shard[1::2], strict=True))
        ranges = fields["slots"]
        if any(int(a) <= slot <= int(b) for a, b in zip(ranges[::2], ranges[1::2], strict=True)):
            for node in fields["nodes"]:
                info = dict(zip(node[::2], node[1::2], strict=True))
                if info.get("role") == "master" and info.get("health") == "online":
                    return str(info["id"])
    return None


def spread_models(masters: int, count: int, prefix: str = "model") -> list[str]:
    """``count`` model names whose hash tags land on the masters of a cluster made by
    :class:`ValkeyCluster` in turn (its equal slot ranges): model i on master i % masters."""
    per = SLOTS // masters
    by_shard: dict[int, list[str]] = {s: [] for s in range(masters)}
    want = -(-count // masters)  # per shard, rounded up
    i = 0
    while any(len(names) < want for names in by_shard.values()):
        name = f"{prefix}-{i}"
        shard = min(key_slot(f"{{{name}}}".encode()) // per, masters - 1)
        if len(by_shard[shard]) < want:
            by_shard[shard].append(name)
        i += 1
    return [by_shard[i % masters][i // masters] for i in range(count)]
