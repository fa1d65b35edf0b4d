"""Where a LoRA adapter's requests go: prefer the open backends where it is resident.

vLLM runs at most ``--max-loras`` distinct adapters in one batch; a request whose adapter
would need one more slot waits in vLLM's queue until one frees (``docs/adapters.md``). So
of the open backends that have an adapter, its requests go first where it already runs
(it holds a slot there: no slot to wait for), else where a slot is free, else to any of
them. Only open backends count, so the preference never holds a request while another
backend that has its adapter could take it: an adapter busy nowhere goes anywhere it is
available, and one whose resident backends are all closed goes to the others.

``takes`` turns that into the adapters each backend takes in one dispatch pass: the
dispatch script then passes over a request whose adapter is not in its backend's set.

``plan_load`` decides a runtime load: where an adapter resident nowhere is loaded, and
which adapter makes room for it there (``docs/adapters.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AdapterHost:
    """One open backend of a model, as placement sees it."""

    name: str
    available: frozenset[str]  # adapters it has (its /v1/models, or the config)
    active: frozenset[str] = frozenset()  # adapters with requests there (vLLM's gauge)
    slots: int | None = None  # adapters one batch runs (max_lora); None: unknown

    @property
    def free_slot(self) -> bool:
        """A batch slot for one more adapter (unknown slots: assumed free)."""
        return self.slots is None or len(self.active) < self.slots

    def resident(self, adapter: str) -> bool:
        """``adapter`` holds a slot here. vLLM's gauge names the adapters with waiting
        or running requests alike, so only while they all fit the slots is each of them
        sure to run."""
        return adapter in self.active and (self.slots is None or len(self.active) <= self.slots)


def preferred(adapter: str, hosts: Sequence[AdapterHost]) -> list[str]:
    """The open backends ``adapter``'s requests go to: where it is resident; else those
    with a free slot; else every one that has it (none: nowhere open has it)."""
    having = [h for h in hosts if adapter in h.available]
    for tier in ([h for h in having if h.resident(adapter)],
                 [h for h in having if h.free_slot]):
        if tier:
            return [h.name for h in tier]
    return [h.name for h in having]


def takes(hosts: Sequence[AdapterHost]) -> Mapping[str, frozenset[str]]:
    """For each open backend, the adapters it takes in this pass (each a subset of what
    it has; together they cover every adapter some open backend has)."""
    chosen: dict[str, set[str]] = {h.name: set() for h in hosts}
    for adapter in sorted({a for h in hosts for a in h.available}):
        for name in preferred(adapter, hosts):
            chosen[name].add(adapter)
    return {name: frozenset(adapters) for name, adapters in chosen.items()}


# --------------------------------------------------------------------------- runtime loads
# Where vLLM allows runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING), an adapter the
# gateway may load (one configured with ``runtime: true`` and a path) that is resident
# nowhere is loaded on one backend: one with a free slot, the least loaded; else one
# whose least recently used adapter it may unload first. An adapter the gateway loaded
# stays at least ``min_residency_s`` (no thrash); an idle one goes before a busy one, so
# a cold adapter is never held behind popular ones for longer than that (no starvation).


@dataclass(frozen=True, slots=True)
class LoadHost:
    """One backend a runtime load may go to, as the load decision sees it."""

    name: str
    loaded: frozenset[str]  # adapters resident there (its /v1/models, the config)
    slots: int | None  # adapters it keeps (max_lora); None: unknown, taken as free
    load: int = 0  # requests waiting, running and sent there
    active: frozenset[str] = frozenset()  # adapters with live requests (vLLM's gauge)
    # the adapters the gateway may unload there (it can load them back: runtime ones)
    unloadable: frozenset[str] = frozenset()
    loaded_at: Mapping[str, float] = field(default_factory=dict)  # by the gateway (unix s)
    last_used: Mapping[str, float] = field(default_factory=dict)  # last dispatch (unix s)

    @property
    def free(self) -> bool:
        return self.slots is None or len(self.loaded) < self.slots

    def victim(self, now: float, min_residency_s: float) -> str | None:
        """The adapter to unload for a new one: of those the gateway may unload and that
        were loaded at least ``min_residency_s`` ago (an adapter loaded before the
        gateway saw it counts as old), an idle one before a busy one, then the least
        recently used (name breaks ties); None: none may go yet."""
        may = [a for a in self.loaded & self.unloadable
               if now - self.loaded_at.get(a, float("-inf")) >= min_residency_s]
        if not may:
            return None
        return min(may, key=lambda a: (a in self.active, self.last_used.get(a, 0.0), a))


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load the adapter on ``backend``, unloading ``unload`` there first (None: a slot
    is free)."""

    backend: str
    unload: str | None = None


def plan_load(adapter: str, hosts: Sequence[LoadHost], now: float,
              min_residency_s: float) -> LoadPlan | None:
    """Where to load ``adapter``; None when there is nothing to do (it is resident on
    one of ``hosts``) or nothing may be done yet (no slot free and no adapter past its
    minimum residency: ask again later). A free slot first, the least loaded backend;
    else the backend whose victim is idle, then the least loaded."""
    if any(adapter in h.loaded for h in hosts):
        return None
    free = [h for h in hosts if h.free]
    if free:
        return LoadPlan(min(free, key=lambda h: (h.load, h.name)).name)
    options = [(h, v) for h in hosts if (v := h.victim(now, min_residency_s)) is not None]
    if not options:
        return None
    host, victim = min(options, key=lambda o: (o[1] in o[0].active, o[0].load, o[0].name))
    return LoadPlan(host.name, victim)
