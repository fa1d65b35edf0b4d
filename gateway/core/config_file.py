"""Reading the config file as settings, whole or not at all.

``fairgate serve`` at start and a reload (``POST /admin/reload``, SIGHUP) read the file
through :func:`read_config_file`: whatever is wrong with it (unreadable, not UTF-8, not
YAML, nested deeper than the parser can go, empty or comments only, not a mapping of
setting names, a string that is not text, invalid settings) is one
:class:`ConfigFileInvalid` naming the problem, never another exception.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.core.settings import FLAT, Settings, leaves, load_settings

MAX_VALUES = 1_000_000  # values of a config, aliases expanded: far above any real one


class ConfigFileInvalid(ValueError):
    """What is wrong with the config file, as the end of "config file '<path>' …"."""


def read_config_file(path: Path) -> Settings:
    """The settings of the file at ``path`` (and of the environment), validated."""
    try:
        parsed = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigFileInvalid(
            f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigFileInvalid(f"cannot be read: {exc.strerror or exc}") from None
    except RecursionError:
        raise ConfigFileInvalid("is nested too deeply to parse") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise _invalid(exc) from None
    _check_shape(parsed)
    try:
        return load_settings(path)
    except (ValidationError, yaml.YAMLError, ValueError, OSError) as exc:
        raise _invalid(exc) from None


def _invalid(exc: Exception) -> ConfigFileInvalid:
    """The parser's or validator's words on one line."""
    if isinstance(exc, ValidationError):
        return ConfigFileInvalid("is invalid: " + describe(exc, Settings))
    return ConfigFileInvalid("is invalid: " + " ".join(str(exc).split()))


def describe(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """Each problem of a validation on one line, as "<where>: <what>" with where the
    setting's path (``backends.1.url``): ``backends.0.max_promt_tokens: unknown key (did
    you mean max_prompt_tokens?)``. ``model`` (the validated one) names the known keys."""
    return "; ".join(_problem(error, model) for error in exc.errors(include_url=False))


def _problem(error: Any, model: type[BaseModel] | None) -> str:
    where = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden":
        what = "unknown key" + _did_you_mean(model, error["loc"])
    elif error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        what = str(error["ctx"]["error"])  # a validator's own words, without "Value error, "
    else:
        what = error["msg"]
    return " ".join(f"{where}: {what}".split()) if where else " ".join(what.split())


def _did_you_mean(model: type[BaseModel] | None, loc: Sequence[int | str]) -> str:
    """" (did you mean <known key>?)" for a key close to one ``model`` knows at ``loc``."""
    known = _keys_at(model, loc[:-1]) if model is not None else []
    if model is Settings and len(loc) == 1:  # a top-level key: a group's field by its path
        known += [p for p in leaves() if "." in p]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if not close and model is Settings and len(loc) == 1:
        flat = difflib.get_close_matches(str(loc[-1]), list(FLAT), n=1)
        close = [FLAT[flat[0]]] if flat else []
    return f" (did you mean {close[0]}?)" if close else ""


def _keys_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The keys of the model at ``loc`` inside ``model`` (through lists, dicts and
    optional values), or [] where none is found."""
    kind: Any = model
    for part in loc:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = kind.model_fields.get(str(part))
            if field is None:
                return []
            kind = _unwrap(field.annotation)
        else:
            args = typing.get_args(kind)
            if typing.get_origin(kind) not in (list, dict) or not args:
                return []
            kind = _unwrap(args[-1])  # a list's items, a dict's values
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return list(kind.model_fields)
    return []


def _unwrap(kind: Any) -> Any:
    """``X`` of ``X | None`` and of ``Annotated[X, …]``."""
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        present = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(present) == 1:
            return _unwrap(present[0])
    return kind


def _check_shape(parsed: object) -> None:
    if parsed is None:
        raise ConfigFileInvalid("is empty (or holds only comments)")
    if not isinstance(parsed, dict):
        raise ConfigFileInvalid(
            f"must hold a mapping of settings, not a {type(parsed).__name__}")
    for name in parsed:
        if not isinstance(name, str):
            raise ConfigFileInvalid(
                f"names a setting {name!r} ({type(name).__name__}): setting names are text")
    values = _expanded_size(parsed)
    if values > MAX_VALUES:
        raise ConfigFileInvalid(f"expands to {values:,} values (YAML aliases), more than "
                                f"{MAX_VALUES:,}")
    for where, text in _strings(parsed):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a "\ud800" escape: no key or name can be made of it
            raise ConfigFileInvalid(
                f"holds a string that is not text (a lone surrogate escape) at "
                f"{where or 'its root'}: {text!r}") from None


def _strings(root: object) -> Iterator[tuple[str, str]]:
    """Every string of a parsed YAML document, keys too, with where it is: walked without
    recursion, each container once (an alias repeats a node, it is not walked again)."""
    stack: list[tuple[str, Any]] = [("", root)]
    seen: set[int] = set()
    while stack:
        where, node = stack.pop()
        if isinstance(node, str):
            yield where, node
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            for key, value in node.items():
                inner = f"{where}.{key}" if where else str(key)
                stack.extend([(inner, key), (inner, value)])
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend((f"{where}.{i}", item) for i, item in enumerate(node))


def _children(node: object) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, list | tuple | set | frozenset):
        return list(node)
    return []


def _expanded_size(root: object) -> int:
    """How many values the document holds once every alias is expanded (each container's
    size computed once: a YAML "billion laughs" is counted, not walked)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = _children(node)
        if not children:
            sizes[id(node)] = 1
        elif done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
        elif id(node) not in sizes:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]
