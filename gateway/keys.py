"""Every Redis key fairgate uses, built in one place.

All keys of one model share the hash tag ``{model}`` so a pool's keys live on one Redis
Cluster slot and the multi-key Lua scripts stay legal. Scripts derive per-user queue and
per-request keys from the prefixes passed in ARGV; those carry the same tag.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "fg"


@dataclass(frozen=True, slots=True)
class ModelKeys:
    model: str

    @property
    def prefix(self) -> str:
        return f"{ROOT}:{{{self.model}}}:"

    def queue_prefix(self, klass: str) -> str:
        return f"{self.prefix}q:{klass}:"

    def queue(self, klass: str, user: str) -> str:
        return self.queue_prefix(klass) + user

    def active(self, klass: str) -> str:
        """zset user → fairness score, users with queued requests."""
        return f"{self.prefix}active:{klass}"

    def saved(self, klass: str) -> str:
        """hash user → score kept while the user is idle."""
        return f"{self.prefix}saved:{klass}"

    @property
    def request_prefix(self) -> str:
        return f"{self.prefix}req:"

    def request(self, request_id: str) -> str:
        return self.request_prefix + request_id

    @property
    def depth(self) -> str:
        """hash class → queued request count."""
        return f"{self.prefix}depth"

    @property
    def backlogged_since(self) -> str:
        """hash class → when its queue last went from empty to non-empty."""
        return f"{self.prefix}since"

    @property
    def recent(self) -> str:
        """list of the classes of the latest dispatches, newest first."""
        return f"{self.prefix}recent"

    @property
    def drained(self) -> str:
        """set of backend names no replica may dispatch to (operators' drain)."""
        return f"{self.prefix}drained"

    @property
    def user_inflight(self) -> str:
        """hash user → dispatched, not yet settled requests (for the vLLM priority rank)."""
        return f"{self.prefix}inflight"

    @property
    def replicas(self) -> str:
        """zset replica id → last heartbeat (unix seconds)."""
        return f"{self.prefix}replicas"

    @property
    def grants_prefix(self) -> str:
        return f"{self.prefix}grants:"

    def grants(self, replica: str) -> str:
        """list of grants for requests whose client is held by ``replica``."""
        return self.grants_prefix + replica

    def running(self, replica: str) -> str:
        """set of dispatched, unsettled request ids whose client ``replica`` holds."""
        return f"{self.prefix}running:{replica}"

    def backend_sent(self, backend: str) -> str:
        """zset request id → dispatch time, dispatches not yet seen by a snapshot."""
        return f"{self.prefix}bk:{backend}:sent"

    def backend_snapshot(self, backend: str) -> str:
        return f"{self.prefix}bk:{backend}:snap"

    def backend_inflight(self, backend: str) -> str:
        return f"{self.prefix}bk:{backend}:inflight"
