"""Where the Redis boundary reports (``gateway/storage/redis_client.py``): each command's
round trip, its failures, and the commands sent (a Lua script by its name).

Every command passes here, so each label set's children are resolved once and kept by
the command's name as sent (``labels()`` costs several times what ``inc()`` does)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.metrics.base import Children, MetricGroup

REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)
SCRIPT_COMMANDS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"})
# Blocking reads wait on purpose: their duration is not Redis latency.
BLOCKING_COMMANDS = frozenset({"BLPOP", "BRPOP", "BLMOVE", "BZPOPMIN", "BZPOPMAX", "XREAD"})


class RedisMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children | None = None) -> None:
        super().__init__(child or Children())
        # the children, by the command as sent (a script's: with its SHA1)
        self._counters: dict[Any, Any] = {}
        self._latencies: dict[Any, Any] = {}  # None: a blocking command's
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
        first = args[0]
        key: Any = (first, args[1]) if first in SCRIPT_COMMANDS and len(args) > 1 else first
        counter = self._counters.get(key)
        if counter is None:
            command = str(first).upper()
            script = ""
            if command in SCRIPT_COMMANDS and len(args) > 1:
                script = scripts.get(str(args[1]), "?")
            counter = self.commands.labels(command, script)
            # kept unless the next call's label may differ: a script not registered (yet),
            # a script command not keyed with its SHA1 (a lower-case name)
            if script != "?" and not (command in SCRIPT_COMMANDS and key is first):
                self._counters[key] = counter
        counter.inc()

    def observe(self, command: Any, seconds: float) -> None:
        """A command's round trip (not a blocking read's); ``command`` as sent."""
        try:
            child = self._latencies[command]
        except KeyError:
            label = str(command).upper()
            child = self._latencies[command] = (
                None if label in BLOCKING_COMMANDS else self.latency.labels(label))
        if child is not None:
            child.observe(seconds)
