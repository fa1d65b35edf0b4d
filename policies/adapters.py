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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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
