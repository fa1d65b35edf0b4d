"""LoRA adapters: the names the gateway serves, the base model of each, and the backends
where each is available (``docs/adapters.md``).

An adapter comes from the config (``adapters: [{name, base_model, path, backends}]``:
available on the named backends of its base model, or on all of them) or from a
backend's ``/v1/models`` (a card whose ``parent`` is the backend's model: an adapter
that vLLM has loaded, read by the backend's scraper and published with its snapshot). A
request naming an adapter is scheduled on its base model, and its body's ``model`` (the
adapter's name) goes to the backend unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from gateway.core.settings import Backend, Settings


def adapters_in_cards(cards: Iterable[Any], model: str) -> tuple[str, ...]:
    """The adapters a vLLM ``/v1/models`` answer lists on ``model`` (cards whose
    ``parent`` is it)."""
    return tuple(sorted(
        str(card["id"]) for card in cards
        if isinstance(card, dict) and card.get("parent") == model
        and isinstance(card.get("id"), str) and card["id"]))


def configured_on(settings: Settings, backend: Backend) -> frozenset[str]:
    """The configured adapters available on ``backend`` (a runtime one only where the
    backend lists it)."""
    return frozenset(a.name for a in settings.adapters
                     if a.base_model == backend.model and not a.runtime
                     and (a.backends is None or backend.name in a.backends))


class Resolved(NamedTuple):
    """What a request's ``model`` names: the base model it is scheduled on, and the
    adapter (None: the base model itself)."""

    model: str
    adapter: str | None


class Listed(NamedTuple):
    """An adapter as ``/v1/models`` lists it."""

    name: str
    base_model: str
    path: str | None


def listing(settings: Settings, discovered: Mapping[str, Iterable[str]]) -> list[Listed]:
    """Every adapter served, by name: the configured ones, then those only the backends
    list (``discovered``: base model -> adapter names). A name that is a base model's, or
    found on two base models, names the first (base models win)."""
    models = set(settings.models())
    found: dict[str, Listed] = {}
    for a in settings.adapters:
        found.setdefault(a.name, Listed(a.name, a.base_model, a.path))
    for base in sorted(discovered):
        for name in sorted(discovered[base]):
            found.setdefault(name, Listed(name, base, None))
    return [found[n] for n in sorted(found) if n not in models]


def resolve(name: str, settings: Settings,
            discovered: Mapping[str, Iterable[str]]) -> Resolved | None:
    """The base model and adapter ``name`` stands for; None: no model or adapter has it."""
    if name in settings.models():
        return Resolved(name, None)
    for entry in listing(settings, discovered):
        if entry.name == name:
            return Resolved(entry.base_model, name)
    return None


def runtime_on(settings: Settings, backend: Backend) -> dict[str, str]:
    """The runtime adapters (``runtime: true``) the gateway may load on ``backend``:
    name -> path."""
    return {a.name: str(a.path) for a in settings.adapters
            if a.runtime and a.base_model == backend.model
            and (a.backends is None or backend.name in a.backends)}


def runtime_adapter(settings: Settings, name: str) -> bool:
    """Whether the gateway loads ``name`` at runtime."""
    return any(a.runtime and a.name == name for a in settings.adapters)


def loaded_nowhere(settings: Settings, model: str, adapter: str) -> str:
    """The 503's text for an adapter no backend of ``model`` has loaded, with the ways to
    have it there (a runtime adapter is loaded by the gateway instead: not this one)."""
    declared = next((a for a in settings.adapters if a.name == adapter), None)
    if declared is not None and declared.runtime:  # unloaded again since its load
        return f"the adapter {adapter!r} is loaded on no backend of {model!r} now; retry"
    path = declared.path if declared is not None and declared.path else "PATH"
    where = ("its backends " + ", ".join(declared.backends)
             if declared is not None and declared.backends else f"the backends of {model!r}")
    return (f"the adapter {adapter!r} is loaded on no backend of {model!r}: declare it with "
            f"`runtime: true` (and its `path`) in `adapters` so fairgate loads it, or start "
            f"{where} with `--lora-modules {adapter}={path}`")
