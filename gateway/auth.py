"""API keys → identity. Keys come from the settings; lookups are constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from gateway.errors import Unauthorized
from gateway.settings import ApiKey

MISSING_KEY = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
UNKNOWN_KEY = "Incorrect API key provided."


class KeyRing:
    def __init__(self, keys: Iterable[ApiKey], admin_keys: Iterable[str] = ()) -> None:
        self._keys = {k.key: k for k in keys}
        self._admin = list(admin_keys)

    def identify(self, authorization: str | None) -> ApiKey:
        token = _bearer(authorization)
        found = self._keys.get(token)
        if found is None:
            raise Unauthorized(UNKNOWN_KEY)
        return found

    def is_admin(self, authorization: str | None) -> bool:
        token = _bearer(authorization)
        return any(hmac.compare_digest(token, k) for k in self._admin)


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized(MISSING_KEY)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(MISSING_KEY)
    return token.strip()
