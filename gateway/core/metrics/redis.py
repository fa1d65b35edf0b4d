"""Where the Redis boundary reports (``gateway/storage/redis_client.py``): each command's
round trip, its failures, and the commands sent (a Lua script by its name)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.metrics.base import Children, MetricGroup

REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)
SCRIPT_COMMANDS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"})


class RedisMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children | None = None) -> None:
        super().__init__(child or Children())
        self._counters: dict[tuple[str, str], Any] = {}
        self.latency = Histogram(
            "fairgate_redis_command_duration_seconds", "Redis command round trips (non-blocking)",
            ["command"], buckets=REDIS_BUCKETS, registry=r)
        self.errors = Counter(
            "fairgate_redis_errors_total", "Redis commands that failed", ["command"], registry=r)
        self.commands = Counter(
            "fairgate_redis_commands_total",
            "Redis commands sent (pipelined ones too); a Lua script by its name",
            ["command", "script"], registry=r)

    def count(self, args: tuple[Any, ...], scripts: dict[str, str]) -> None:
        if not args:
            return
        command = str(args[0]).upper()
        script = ""
        if command in SCRIPT_COMMANDS and len(args) > 1:
            script = scripts.get(str(args[1]), "?")
        key = (command, script)
        counter = self._counters.get(key)
        if counter is None:  # labels() costs more than inc(): resolve each pair once
            counter = self._counters[key] = self.commands.labels(command, script)
        counter.inc()
