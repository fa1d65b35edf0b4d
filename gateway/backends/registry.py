"""The backend list in force, its one owner: configured, added at runtime, discovered.

Each backend has an origin:
- ``config``: ``backends`` in the config file; a config reload changes them;
- ``admin``: ``POST /admin/backends``, removed by ``DELETE /admin/backends/{name}``;
- ``dns``: found by a DNS name (``discovery``, ``gateway/backends/discovery.py``).

Runtime backends (admin, dns) are entries of one hash in Redis (``fg:{backends}:runtime``),
so every process of every replica, workers too, applies them without a restart: each
reads the hash every ``backends_refresh_s`` (the process that changed it at once) and
hands the merged list to :meth:`BackendPool.reconcile` — the path a config reload takes
too (``gateway/http/admin/reload.py`` calls :meth:`BackendList.apply`). A process that
gets a grant for a backend it does not know yet (another process added it and dispatched
to it first) reads the hash at once (:meth:`BackendList.learn`) and serves the request.

The merge (:func:`in_force`): the configured backends, then each runtime one whose name
the config does not hold and whose model the config serves. A reload that names a
runtime backend's name shadows that entry (the file's backend is in force; the entry
comes back if the file drops the name again); a runtime backend of a model the config no
longer serves waits, unused, until it serves it again. Names are unique across all
origins: adding a name or a URL already in the list is refused.

Removal drains first. The entry is marked leaving (when, and the grace), its backend is
drained in Redis with its running answers moving at leaving time + grace (the drain every
replica honours; ``gateway/scheduling/migrate.py`` moves each process's answers, which
continue on another backend); once no request of any replica is in flight there, any
process forgets the entry, and every process drops the backend at its next read. A
leaving backend still holding requests after ``max_request_s`` past its grace is
forgotten anyway. Every change is one compare-and-swap of one entry
(``lua/backend_swap.lua``): processes that race change nothing twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from pydantic import ValidationError

from gateway.backends.scrape import BackendPool
from gateway.core.errors import (
    BackendExists,
    BackendNotRemovable,
    Conflict,
    NotFound,
    StoreUnavailable,
)
from gateway.core.settings import Backend, ReadsSettings, SettingsHolder
from gateway.storage.fleet_store import FleetStore
from gateway.storage.keys import RUNTIME_BACKENDS
from gateway.storage.redis_client import BoundaryRedis
from gateway.storage.scripts import load_script

log = structlog.get_logger("fairgate.backends")

ADMIN, DNS = "admin", "dns"
SWAP_ATTEMPTS = 3  # a removal that lost its compare-and-swap to another change reads again
REDRAIN_AFTER_REFRESHES = 5  # a leaving backend not drained here by then is drained again


@dataclass(frozen=True, slots=True)
class Entry:
    """A runtime backend as Redis holds it."""

    backend: Backend
    origin: str  # ADMIN or DNS
    added_at: float  # unix s
    source: str | None = None  # the discovery that found it ("dns_name:port")
    leaving_since: float | None = None  # unix s: drained, removed once nothing runs there
    grace_s: float = 0.0  # after leaving_since, its running answers move

    @property
    def migrate_at(self) -> float | None:
        return None if self.leaving_since is None else self.leaving_since + self.grace_s

    def encode(self) -> str:
        return json.dumps({"backend": self.backend.model_dump(), "origin": self.origin,
                           "added_at": self.added_at, "source": self.source,
                           "leaving_since": self.leaving_since, "grace_s": self.grace_s},
                          sort_keys=True)

    @classmethod
    def decode(cls, raw: str) -> Entry:
        """ValueError when ``raw`` is not an entry."""
        try:
            data = json.loads(raw)
            return cls(Backend.model_validate(data["backend"]), str(data["origin"]),
                       float(data["added_at"]), data.get("source"),
                       data.get("leaving_since"), float(data.get("grace_s") or 0.0))
        except (KeyError, TypeError, ValidationError) as exc:
            raise ValueError(f"not a runtime backend entry: {exc}") from None


def in_force(configured: Sequence[Backend], models: Collection[str],
             runtime: Mapping[str, Entry]) -> tuple[list[Backend], dict[str, str]]:
    """The backends in force and each one's origin: the configured ones, then the runtime
    ones (by name) whose name is not configured and whose model is served."""
    listed = list(configured)
    origins = dict.fromkeys((b.name for b in configured), "config")
    for name, entry in sorted(runtime.items()):
        if name not in origins and entry.backend.model in models:
            listed.append(entry.backend)
            origins[name] = entry.origin
    return listed, origins


@dataclass(frozen=True, slots=True)
class Changes:
    """What makes a discovery's entries match its latest answer."""

    add: list[Backend] = field(default_factory=list)
    retire: list[str] = field(default_factory=list)  # present, no longer in the answer
    update: list[Backend] = field(default_factory=list)  # same name, other settings


def changes(wanted: Mapping[str, Backend], found: Mapping[str, Entry]) -> Changes:
    """From a discovery's entries (``found``) to its answer (``wanted``). A leaving entry
    finishes leaving before its name can come back."""
    out = Changes()
    for name, backend in sorted(wanted.items()):
        entry = found.get(name)
        if entry is None:
            out.add.append(backend)
        elif entry.leaving_since is None and entry.backend != backend:
            out.update.append(backend)
    out.retire.extend(n for n, e in sorted(found.items())
                      if n not in wanted and e.leaving_since is None)
    return out


class BackendList(ReadsSettings):
    """The backend list in force for this process, and the runtime entries' changes."""

    def __init__(self, client: BoundaryRedis, settings: SettingsHolder, pool: BackendPool,
                 store: FleetStore) -> None:
        self.client: Any = client  # redis-py's sync/async union types: untyped here
        self.holder = settings
        self.pool = pool
        self.store = store
        self._swap = client.register_script(load_script("backend_swap"))
        self.runtime: dict[str, tuple[Entry, str]] = {}  # name -> (entry, its raw JSON)
        self._reading: asyncio.Future[None] | None = None  # a read for learn(), shared

    def entries(self) -> dict[str, Entry]:
        return {name: entry for name, (entry, _) in self.runtime.items()}

    def apply(self) -> dict[str, list[str]]:
        """Hand the merged list to the pool (after a read, a change or a reload); what
        was added, removed or changed."""
        entries = self.entries()
        listed, origins = in_force(self.settings.backends, self.settings.models(), entries)
        report = self.pool.reconcile(listed, origins)
        for name, handle in self.pool.handles.items():
            entry = entries.get(name) if handle.origin != "config" else None
            handle.leaving_since = None if entry is None else entry.leaving_since
        if any(report.values()):
            log.info("backends_changed", **report)
        return report

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except StoreUnavailable as exc:  # an outage: the list in force stays as it is
                log.warning("backends_refresh_failed", error=exc.message)
            await asyncio.sleep(self.settings.backends_refresh_s)

    async def refresh(self, now: float | None = None) -> None:
        """Read the runtime entries, apply the list, finish the removals that may end."""
        raw: dict[str, str] = await self.client.hgetall(RUNTIME_BACKENDS)
        runtime = {}
        for name, text in raw.items():
            try:
                runtime[name] = (Entry.decode(text), text)
            except ValueError as exc:
                log.warning("runtime_backend_unreadable", backend=name, error=str(exc))
        self.runtime = runtime
        self.apply()
        await self._finish_leaving(time.time() if now is None else now)

    async def learn(self, name: str) -> bool:
        """Whether the backend ``name`` is in force here, after reading the runtime
        entries again if it was not: a grant for a backend another process just added
        can come before this process's next :meth:`refresh` (the calls of a flood
        share one read)."""
        if name in self.pool.handles:
            return True
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self.refresh())
        try:
            await asyncio.shield(self._reading)
        except StoreUnavailable as exc:
            log.warning("backends_refresh_failed", error=exc.message)
        return name in self.pool.handles

    async def _swapped(self, name: str, expected: str, wanted: str) -> tuple[bool, str | None]:
        done, found = await self._swap(keys=[RUNTIME_BACKENDS], args=[name, expected, wanted])
        return bool(done), (found or None)

    def _configured(self, name: str) -> bool:
        return any(b.name == name for b in self.settings.backends)

    async def add(self, backend: Backend, origin: str, source: str | None = None) -> Entry:
        """A new runtime backend, in force here at once and everywhere within
        ``backends_refresh_s``. :class:`BackendExists` when its name or URL is taken."""
        if self._configured(backend.name):
            raise BackendExists(f"backend {backend.name!r} is in the config file", param="name")
        for other in [*self.pool.handles.values()]:
            if other.config.url == backend.url and other.config.model == backend.model:
                raise BackendExists(f"backend {other.name!r} already serves {backend.url} "
                                    f"for {backend.model}", param="url")
        entry = Entry(backend, origin, time.time(), source)
        done, _ = await self._swapped(backend.name, "", entry.encode())
        if not done:
            raise BackendExists(f"a backend named {backend.name!r} exists already",
                                param="name")
        # a former backend of that name may have left its drain flag behind
        await self.store.set_drained(backend.model, backend.name, False)
        log.info("backend_added", backend=backend.name, url=backend.url, model=backend.model,
                 origin=origin, source=source)
        await self.refresh()
        return entry

    async def update(self, backend: Backend) -> bool:
        """A discovered backend's settings changed (a reload of its discovery): its entry
        re-pointed, unless it changed meanwhile."""
        held = self.runtime.get(backend.name)
        if held is None:
            return False
        entry, raw = held
        done, _ = await self._swapped(backend.name, raw, replace(entry, backend=backend).encode())
        return done

    async def remove(self, name: str, grace_s: float, origin: str) -> Entry | None:
        """Drain the runtime backend ``name`` (its running answers move ``grace_s`` from
        now) and remove it once nothing runs there. The entry as it is now, or None when
        it is gone already (nothing ran there). :class:`NotFound` for no such backend,
        :class:`BackendNotRemovable` for one of another origin (the config file's, or a
        discovery's for the admin API)."""
        if self._configured(name):
            raise BackendNotRemovable(f"backend {name!r} is in the config file: remove it "
                                      "there and reload", param="name")
        for _ in range(SWAP_ATTEMPTS):
            raw = await self.client.hget(RUNTIME_BACKENDS, name)
            if raw is None:
                raise NotFound(f"no backend named {name!r}", param="name")
            entry = Entry.decode(raw)
            if entry.origin != origin:
                raise BackendNotRemovable(
                    f"backend {name!r} was found by the DNS name {entry.source}: it leaves "
                    "when its address leaves the DNS answer", param="name")
            if entry.leaving_since is not None:
                break  # already leaving: one removal at a time
            entry = replace(entry, leaving_since=time.time(), grace_s=grace_s)
            if (await self._swapped(name, raw, entry.encode()))[0]:
                await self._drain(entry)
                log.info("backend_leaving", backend=name, origin=origin,
                         migrate_at=entry.migrate_at)
                break
        else:
            raise Conflict(f"backend {name!r} changed while it was being removed; try again")
        await self.refresh()
        held = self.runtime.get(name)
        return None if held is None else held[0]

    async def _drain(self, entry: Entry) -> None:
        b = entry.backend
        await self.store.set_drained(b.model, b.name, True, entry.migrate_at)
        handle = self.pool.handles.get(b.name)
        if handle is not None:
            self.pool.set_drained(handle, True)

    async def _finish_leaving(self, now: float) -> None:
        """Forget each leaving entry once nothing is in flight at its backend (read only
        when this process sees it drained, so no dispatch can come after the read)."""
        by_model: dict[str, list[str]] = {}
        for name, (entry, _) in self.runtime.items():
            handle = self.pool.handles.get(name)
            if entry.leaving_since is None or handle is None:
                continue
            if handle.drained:
                by_model.setdefault(entry.backend.model, []).append(name)
            elif (now - entry.leaving_since
                  > REDRAIN_AFTER_REFRESHES * self.settings.backends_refresh_s):
                await self._drain(entry)  # its remover died between its two writes
        for model, names in by_model.items():
            states = await self.store.backend_states(model, names)
            for name in names:
                found = self.runtime.get(name)
                if found is None:  # another refresh (the loop's, a remover's) read the
                    continue  # list meanwhile and finished or dropped this removal
                entry, raw = found
                overdue = now > (entry.migrate_at or now) + self.settings.max_request_s
                if states[name].inflight > 0 and not overdue:
                    continue
                if (await self._swapped(name, raw, ""))[0]:
                    log.info("backend_removed", backend=name, origin=entry.origin,
                             left_in_flight=states[name].inflight)
                self.runtime.pop(name, None)
        if by_model:
            self.apply()
