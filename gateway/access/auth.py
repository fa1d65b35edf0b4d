"""API keys → identity, and admin keys → the operator's routes.

Keys come from the settings (swapped whole by a reload) and, created at runtime, from
Redis (``gateway/access/keyring.py``, HMAC under the server's pepper). Config keys are kept only
as keyed hashes (HMAC-SHA256 with a secret drawn at start), so a lookup never compares a
key in clear and takes the same time whatever the key; admin keys are compared in
constant time. A config key without an ``id`` gets a stable one derived from it
(``cfg-…``): what limits and usage records name it by.
Admin routes take ``Authorization: Bearer <admin key>``, or for the dashboard's read-only
GETs a session (``gateway/access/sessions.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gateway.core.connections import authenticated
from gateway.core.errors import AdminRequired, Unauthorized
from gateway.core.settings import ApiKey

if TYPE_CHECKING:
    from gateway.access.keyring import RuntimeKeys

MISSING_KEY = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
UNKNOWN_KEY = "Incorrect API key provided."
SESSION_COOKIE = "fairgate_admin"


def admin_key_id(admin_key: str) -> str:
    """A stable fingerprint of an admin key (the same on every replica): what a session
    records of the key that opened it."""
    return hmac.new(b"fairgate-admin-key", admin_key.encode(), hashlib.sha256).hexdigest()


class KeyRing:
    def __init__(self, keys: Iterable[ApiKey], admin_keys: Iterable[str] = (),
                 runtime: RuntimeKeys | None = None) -> None:
        # HMAC-SHA256 under a secret drawn at start, its keyed state built once: each
        # lookup copies it (OpenSSL's key setup per call costs more than the hash)
        self._keyed = hmac.new(secrets.token_bytes(32), digestmod=hashlib.sha256)
        self.runtime = runtime
        self._keys = {self._digest(k.key): _with_id(k) for k in keys}
        self._admin = {self._digest(k): admin_key_id(k) for k in admin_keys}
        self._admin_ids = set(self._admin.values())

    def _digest(self, key: str) -> bytes:
        mac = self._keyed.copy()  # hmac.new(secret, key, sha256), its key set up once
        mac.update(key.encode())
        return mac.digest()

    def config_keys(self) -> list[ApiKey]:
        return list(self._keys.values())

    async def find(self, key_id: str) -> ApiKey | None:
        """A key by its id (config file first, then runtime keys); None: no such key."""
        for key in self._keys.values():
            if key.id == key_id:
                return key
        return None if self.runtime is None else await self.runtime.api_key(key_id)

    async def identify(self, authorization: str | None) -> ApiKey:
        token = _bearer(authorization)
        found = self._keys.get(self._digest(token))
        if found is None and self.runtime is not None:
            found = await self.runtime.lookup(token)
        if found is None:
            raise Unauthorized(UNKNOWN_KEY)
        authenticated()
        return found

    def admin_id(self, authorization: str | None) -> str | None:
        """The admin key's fingerprint, or None when it is not an admin key."""
        digest = self._digest(_bearer(authorization))
        found = None
        for known, key_id in self._admin.items():  # all compared: constant time
            if hmac.compare_digest(digest, known):
                found = key_id
        if found is not None:
            authenticated()
        return found

    def is_admin(self, authorization: str | None) -> bool:
        return self.admin_id(authorization) is not None

    def owns(self, key_id: str) -> bool:
        """Is ``key_id`` the fingerprint of a current admin key?"""
        return key_id in self._admin_ids

    async def require_admin(self, authorization: str | None) -> None:
        """401 without a valid key, 403 for a user's key."""
        if self.is_admin(authorization):  # raises Unauthorized when missing
            return
        await self.identify(authorization)  # Unauthorized for an unknown key
        raise AdminRequired("this route needs an admin key")


def _with_id(key: ApiKey) -> ApiKey:
    """A config key with its stable id (the same on every replica; limits and usage name
    the key by it)."""
    if key.id is not None:
        return key
    digest = hmac.new(b"fairgate-key-id", key.key.encode(), hashlib.sha256).hexdigest()
    return key.model_copy(update={"id": "cfg-" + digest[:12]})


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized(MISSING_KEY)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(MISSING_KEY)
    return token.strip()
