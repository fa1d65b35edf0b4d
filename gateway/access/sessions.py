"""Dashboard sessions: random tokens kept in Redis, so they expire and can be revoked.

A session names the admin key that opened it by a fingerprint, never the key. It is valid
while it exists (``session_ttl_s``; logout deletes it) and while that key is still an
admin key (a reload that removes the key ends its sessions on every replica).

Writes from the page (drain, undrain, cancel) also need the session's CSRF token in the
``X-CSRF-Token`` header: an HMAC of the session token, so every replica derives the same
one without storing it, and a page that can read it (``GET /admin/state`` gives it to the
session's own page) cannot recover the HttpOnly cookie from it. Another site can neither
read it nor, with the SameSite=Strict cookie, send the cookie at all: two locks.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable
from typing import cast

import redis.asyncio as aioredis

from gateway.access.auth import KeyRing
from gateway.core.connections import authenticated
from gateway.storage.keys import session

CSRF_HEADER = "X-CSRF-Token"
_CSRF_LABEL = b"fairgate-dashboard-csrf"


def _hashed(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def csrf_token(token: str) -> str:
    """The CSRF token of the session whose (secret) token is ``token``."""
    return hmac.new(_CSRF_LABEL, token.encode(), hashlib.sha256).hexdigest()


def csrf_valid(token: str, presented: str | None) -> bool:
    return bool(presented) and hmac.compare_digest(csrf_token(token).encode(),
                                                   str(presented).encode())


class SessionStore:
    def __init__(self, client: aioredis.Redis, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = ttl_s

    async def open(self, owner: str) -> str:
        """A new session for the admin key with fingerprint ``owner``; returns its token."""
        token = secrets.token_urlsafe(32)
        await self.client.set(session(_hashed(token)), owner, ex=int(self.ttl_s))
        return token

    async def valid(self, token: str | None, keys: KeyRing) -> bool:
        if not token:
            return False
        owner = await cast("Awaitable[str | None]",
                           self.client.get(session(_hashed(token))))
        if owner is None or not keys.owns(owner):
            return False
        authenticated()
        return True

    async def close(self, token: str | None) -> None:
        if token:
            await self.client.delete(session(_hashed(token)))
