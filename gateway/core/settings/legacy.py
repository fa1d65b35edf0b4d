"""The flat setting names of fairgate before the groups, still accepted.

Every field of a group (``gateway/core/settings/groups.py``) was once a top-level setting
of its own name (``redis_url``), except the three a group took the name of
(``fairness`` → ``fairness.policy``, ``pacing`` → ``pacing.mode``, ``routing`` →
``routing.mode``) and ``listen``'s own two. :data:`FLAT` maps each old name to its path;
a YAML key, a ``FAIRGATE_<OLD>`` env var (``FAIRGATE_REDIS_SENTINEL__NODES`` too), a CLI
override or a keyword of ``load_settings`` under the old name is moved to its path, with
one deprecation line in the log per name and process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

from gateway.core.settings.groups import GROUPS, RENAMED

log = structlog.get_logger("fairgate.config")

FLAT: dict[str, str] = {
    RENAMED.get(path, leaf): path
    for group, model in GROUPS.items() if group != "listen"
    for leaf in model.model_fields for path in [f"{group}.{leaf}"]}
FLAT.update({name: f"listen.{name}" for name in GROUPS["listen"].model_fields
             if name not in ("host", "port")})

_said: set[str] = set()
_held: list[tuple[str, str, str]] | None = None  # lines held back by held_lines()


def _deprecated(name: str, path: str, where: str) -> None:
    if name in _said:
        return
    _said.add(name)
    if _held is not None:
        _held.append((name, path, where))
    else:
        say([(name, path, where)])


def say(lines: list[tuple[str, str, str]]) -> None:
    for name, path, where in lines:
        log.warning("setting_deprecated", setting=name, use=path, given_in=where,
                    note=f"{name!r} is now {path!r}; the old name still works")


@contextlib.contextmanager
def held_lines() -> Iterator[list[tuple[str, str, str]]]:
    """The deprecation lines of the settings read in the block, held back (a process
    reads its settings before it sets up its logs: :func:`say` them after)."""
    global _held
    held: list[tuple[str, str, str]] = []
    _held = held
    try:
        yield held
    finally:
        _held = None


def _is_flat(name: str, value: Any) -> bool:
    """Whether the key ``name`` holding ``value`` is an old flat setting: a group's name
    that was a setting itself (``fairness: vtc``) is old unless it holds a mapping."""
    return name in FLAT and not (name in GROUPS and isinstance(value, Mapping))


def nest(values: Mapping[str, Any], where: str = "the config") -> dict[str, Any]:
    """``values`` with each old flat name moved to its group (a value given under the new
    path as well wins)."""
    if not isinstance(values, Mapping):
        return values  # the validator names the problem
    out: dict[str, Any] = {}
    moved: list[tuple[str, str, Any]] = []
    for name, value in values.items():
        if isinstance(name, str) and _is_flat(name, value):
            moved.append((name, FLAT[name], value))
        else:
            out[name] = value
    for name, path, value in moved:
        _deprecated(name, path, where)
        group, leaf = path.split(".")
        given = out.get(group)
        if given is None or isinstance(given, Mapping):
            out[group] = {leaf: value, **(given or {})}
        elif isinstance(given, GROUPS[group]):
            out[group] = {leaf: value, **given.model_dump(exclude_unset=True)}
    return out


def nest_env(env: Mapping[str, str | None], prefix: str) -> dict[str, str | None]:
    """The environment (names lowercased, as pydantic-settings reads them) with each
    ``<prefix><old>`` (and ``<prefix><old>__…``) also under its group's name."""
    out = dict(env)
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        name, sep, rest = key[len(prefix):].partition("__")
        if name not in FLAT or (name in GROUPS and (sep or _json_object(value))):
            continue
        path = FLAT[name].replace(".", "__")
        new = f"{prefix}{path}{sep}{rest}"
        _deprecated(name, FLAT[name], f"the environment ({key.upper()})")
        out.setdefault(new, value)
        del out[key]
    return out


def _json_object(value: str | None) -> bool:
    return value is not None and value.lstrip().startswith("{")
