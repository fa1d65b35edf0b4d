"""Priority classes and their order. Lower index = served first."""

from __future__ import annotations

CLASS_ORDER: tuple[str, ...] = ("interactive", "default", "batch")


def class_rank(name: str) -> int:
    """Position of a class in the service order; unknown names raise ValueError."""
    return CLASS_ORDER.index(name)


def effective_class(granted: str, requested: str | None) -> str | None:
    """The class a request runs in: the key's class, or a *lower* one it asks for.

    Returns None when the request asks to be raised above its key's class (forbidden).
    """
    if requested is None or requested == granted:
        return granted
    if requested not in CLASS_ORDER:
        return None
    return requested if class_rank(requested) > class_rank(granted) else None
