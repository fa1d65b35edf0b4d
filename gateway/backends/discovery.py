"""Backends from DNS names: a Kubernetes headless Service's A/AAAA records are its ready
pods, each a vLLM backend.

Every process resolves each ``discovery`` entry every ``refresh_s`` with the event
loop's resolver (``getaddrinfo``: the system's, no new dependency) and makes the runtime
entries of that name (``gateway/backends/registry.py``, origin ``dns``) match the answer:
a new address is added, one that left is drained (its running answers move at once) and
removed when nothing runs there. The entries live in Redis, so every replica serves the
same list; the processes that race to write one change write it once (each change is a
compare-and-swap). A name that does not exist or holds no address (every pod gone) means
no backend; a failed lookup (a timeout, a server failure) changes nothing.

A discovered backend is named ``<dns_name>@<address>:<port>`` and served at
``<scheme>://<address>:<port>`` with the discovery's pool fields.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import structlog

from gateway.backends.registry import DNS, BackendList, changes
from gateway.core.errors import BackendExists, Conflict, NotFound
from gateway.core.settings import Backend, Discovery, ReadsSettings, SettingsHolder

log = structlog.get_logger("fairgate.discovery")

# getaddrinfo's answers for a name without addresses: no backend (not a failure)
NO_ADDRESS = frozenset(getattr(socket, e) for e in ("EAI_NONAME", "EAI_NODATA")
                       if hasattr(socket, e))
IDLE_S = 1.0  # how often a process without discovery looks whether a reload added one

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (A and AAAA records), sorted; [] when the name
    does not exist or holds none. ``OSError`` for a lookup that failed."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_ADDRESS:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


def discovered(spec: Discovery, addresses: Iterable[str]) -> dict[str, Backend]:
    """The backends of a discovery's answer, by name."""
    out = {}
    for address in addresses:
        host = f"[{address}]" if ":" in address else address
        name = f"{spec.dns_name}@{host}:{spec.port}"
        out[name] = Backend(name=name, url=f"{spec.scheme}://{host}:{spec.port}",
                            model=spec.model, **spec.pool_fields())
    return out


class DnsDiscovery(ReadsSettings):
    def __init__(self, settings: SettingsHolder, backends: BackendList,
                 resolver: Resolver = resolve) -> None:
        self.holder = settings
        self.backends = backends
        self.resolver = resolver
        self._due: dict[str, float] = {}  # source -> monotonic s of its next lookup

    async def run(self) -> None:
        while True:
            await self.turn(time.monotonic())
            specs = self.settings.discovery
            await asyncio.sleep(min((s.refresh_s for s in specs), default=IDLE_S))

    async def turn(self, now: float) -> None:
        """Look up every discovery that is due, and retire what a reload dropped."""
        specs = {s.source: s for s in self.settings.discovery}
        due = [s for source, s in specs.items() if self._due.get(source, 0.0) <= now]
        orphans = {e.source for e in self.backends.entries().values()
                   if e.origin == DNS and e.source not in specs and e.leaving_since is None}
        if not due and not orphans:
            return
        await self.backends.refresh()
        for source in orphans:  # its discovery left the config: its backends leave
            await self.sync(source, {})
        for spec in due:
            self._due[spec.source] = now + spec.refresh_s
            try:
                addresses = await self.resolver(spec.dns_name, spec.port)
            except OSError as exc:
                log.warning("discovery_lookup_failed", dns_name=spec.dns_name, error=str(exc))
                continue
            await self.sync(spec.source, discovered(spec, addresses))
        for source in [s for s in self._due if s not in specs]:
            del self._due[source]

    async def sync(self, source: str | None, wanted: dict[str, Backend]) -> None:
        """Make the entries of ``source`` match ``wanted``."""
        found = {n: e for n, e in self.backends.entries().items()
                 if e.origin == DNS and e.source == source}
        todo = changes(wanted, found)
        for backend in todo.add:
            try:
                await self.backends.add(backend, DNS, source)
            except BackendExists as exc:  # another process's, or a name taken otherwise
                log.debug("discovered_backend_exists", backend=backend.name,
                          error=exc.message)
        for backend in todo.update:
            await self.backends.update(backend)
        for name in todo.retire:
            try:
                await self.backends.remove(name, 0.0, DNS)
            except (NotFound, Conflict) as exc:  # another process removed or changed it
                log.debug("discovered_backend_changed", backend=name, error=exc.message)
        if todo.retire or todo.update:
            log.info("discovery_changed", source=source, retired=todo.retire,
                     updated=[b.name for b in todo.update])
