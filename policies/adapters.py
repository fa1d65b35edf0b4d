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
which adapter makes room for it there; ``load_order`` which waiting adapter goes first,
``residency_s`` how long a loaded one stays (``docs/adapters.md``).
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
# whose adapter with the least demand it may unload first. An adapter the gateway loaded
# stays at least its minimum residency (``residency_s``: nine times its measured load, so
# loading takes at most a tenth of a slot's time: no thrash). When several adapters wait,
# the slot goes to the one with the most requests waiting, or to the longest-waiting once
# it has waited ``starve_s`` (``load_order``: no starvation).

LOAD_SHARE = 0.1
"""At most this share of a slot's time goes to loading adapters into it."""
RESIDENCY_FLOOR_S = 1.0
"""The least minimum residency, however fast a load: a loaded adapter's queued requests
are dispatched and reach vLLM within it."""


def residency_s(load_s: float | None, override_s: float | None = None) -> float:
    """How long an adapter the gateway loaded (in ``load_s``; None: not measured) is
    kept before another may take its slot: ``override_s`` when set
    (``adapter_min_residency_s``), else ``(1 - LOAD_SHARE) / LOAD_SHARE`` times its load
    (nine times), at least ``RESIDENCY_FLOOR_S``. A slot then loads at most once per
    load + residency, so loading is at most ``LOAD_SHARE`` of its time."""
    if override_s is not None:
        return override_s
    if load_s is None:
        return RESIDENCY_FLOOR_S
    return max(load_s * (1 - LOAD_SHARE) / LOAD_SHARE, RESIDENCY_FLOOR_S)


@dataclass(frozen=True, slots=True)
class Demand:
    """An adapter's requests waiting in the gateway (for its load, or queued), summed
    over every replica."""

    requests: int
    since: float  # when the oldest of them was admitted (unix s)


def load_order(waiting: Mapping[str, Demand], now: float, starve_s: float) -> list[str]:
    """The order in which adapters resident nowhere get a slot: those whose oldest
    request has waited ``starve_s`` or more first, the longest-waiting first (a cold
    adapter is not held behind popular ones); then the most requests waiting, then the
    longest wait (name breaks ties)."""
    def key(a: str) -> tuple[int, float, float, str]:
        d = waiting[a]
        if now - d.since >= starve_s:
            return (0, d.since, 0.0, a)
        return (1, -d.requests, d.since, a)
    return sorted(waiting, key=key)


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
    load_s: Mapping[str, float] = field(default_factory=dict)  # its measured load (s)

    @property
    def free(self) -> bool:
        return self.slots is None or len(self.loaded) < self.slots

    def victim(self, now: float, min_residency_s: float | None,
               queued: Mapping[str, int] | None = None, bid: int | None = None) -> str | None:
        """The adapter to unload for a new one: of those the gateway may unload and that
        have stayed their minimum residency (``residency_s``; ``min_residency_s``
        overrides it; an adapter loaded before the gateway saw it counts as old) and
        have fewer requests ``queued`` than ``bid`` (the new one's; None: any), the one
        with no demand (none queued, none live by the gauge) first, then the fewest
        queued, then the least recently used (name breaks ties); None: none may go yet."""
        queued = queued or {}
        may = [a for a in self.loaded & self.unloadable
               if now - self.loaded_at.get(a, float("-inf"))
               >= residency_s(self.load_s.get(a), min_residency_s)
               and (bid is None or queued.get(a, 0) == 0 or queued[a] < bid)]
        if not may:
            return None
        return min(may, key=lambda a: self.pressure(a, queued))

    def pressure(self, adapter: str, queued: Mapping[str, int]) -> tuple[bool, int, float, str]:
        """How much ``adapter`` is wanted here (lower goes first as a victim)."""
        n = queued.get(adapter, 0)
        return (n > 0 or adapter in self.active, n, self.last_used.get(adapter, 0.0), adapter)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load the adapter on ``backend``, unloading ``unload`` there first (None: a slot
    is free)."""

    backend: str
    unload: str | None = None


def plan_load(adapter: str, hosts: Sequence[LoadHost], now: float,
              min_residency_s: float | None, demand: Mapping[str, Demand] | None = None,
              starve_s: float = float("inf")) -> LoadPlan | None:
    """Where to load ``adapter``; None when there is nothing to do (it is resident on
    one of ``hosts``) or nothing may be done yet (no slot free and no adapter it may
    displace: ask again later). A free slot first, the least loaded backend; else the
    backend whose victim has the least demand, then the least loaded. ``demand``: the
    requests waiting for each adapter; one with requests queued is displaced only by an
    adapter with more, or by one that has waited ``starve_s``."""
    if any(adapter in h.loaded for h in hosts):
        return None
    free = [h for h in hosts if h.free]
    if free:
        return LoadPlan(min(free, key=lambda h: (h.load, h.name)).name)
    demand = demand or {}
    queued = {a: d.requests for a, d in demand.items()}
    own = demand.get(adapter)
    bid = None if own is None or now - own.since >= starve_s else own.requests
    options = [(h, v) for h in hosts if (v := h.victim(now, min_residency_s, queued, bid))
               is not None]
    if not options:
        return None
    host, victim = min(options, key=lambda o: (o[0].pressure(o[1], queued)[:2], o[0].load,
                                               o[0].name))
    return LoadPlan(host.name, victim)
