"""What a backend's name and URL may be: one check for the config file and the admin API.

A name is shown in admin URLs (``/admin/backends/{name}/drain``), Redis key names and
metric labels, so it keeps to a safe charset: a client that normalises paths must reach
``DELETE /admin/backends/{name}`` for every name (``..`` it would not). A URL is where
fairgate sends requests (``url + "/v1/…"``): http or https to a host, nothing a header
or a log line could be split on. Backends found by DNS discovery are named by the
gateway itself (``dns_name@address:port``) and take only the URL check.
"""

from __future__ import annotations

import re
from typing import Annotated

import yarl
from pydantic import AfterValidator

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_URL_CHARS = 2048
NAME_RULE = "1-64 letters, digits and '._-', starting with a letter or digit"


def check_backend_name(value: str) -> str:
    """``value`` when it is a backend name the config or the admin API may give, else
    ValueError (``.`` and ``..`` never are: they start with a dot)."""
    if not NAME.fullmatch(value):
        raise ValueError(f"{value[:80]!r} is not a backend name: {NAME_RULE}")
    return value


def check_backend_url(value: str) -> str:
    """``value`` without its trailing '/' when it is an http:// or https:// URL with a
    host, without whitespace, control characters, credentials, a query or a fragment;
    else ValueError (never quoting the URL: it may hold a password)."""
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"is longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError("must not hold a space or a control character")
    try:
        url = yarl.URL(value)
    except (ValueError, TypeError):
        raise ValueError("must be an http:// or https:// URL") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    if url.query_string or url.fragment or url.user is not None:
        raise ValueError("must not carry credentials, a query or a fragment")
    try:
        url.port  # noqa: B018 -- an out-of-range port raises here
    except ValueError:
        raise ValueError("has an invalid port") from None
    return value.rstrip("/")


BackendName = Annotated[str, AfterValidator(check_backend_name)]
BackendUrl = Annotated[str, AfterValidator(check_backend_url)]
