"""API keys → identity, and admin keys → the operator's routes.

Keys come from the settings (swapped whole by a reload); lookups are constant time.
Admin routes take ``Authorization: Bearer <admin key>`` or, for the dashboard's read-only
GETs, a session cookie derived from an admin key (so the key itself is never stored).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from gateway.errors import AdminRequired, Unauthorized
from gateway.settings import ApiKey

MISSING_KEY = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
UNKNOWN_KEY = "Incorrect API key provided."
SESSION_COOKIE = "fairgate_admin"


def session_token(admin_key: str) -> str:
    """The dashboard cookie for an admin key."""
    return hmac.new(admin_key.encode(), b"fairgate-dashboard", hashlib.sha256).hexdigest()


class KeyRing:
    def __init__(self, keys: Iterable[ApiKey], admin_keys: Iterable[str] = ()) -> None:
        self._keys = {k.key: k for k in keys}
        self._admin = list(admin_keys)
        self._sessions = [session_token(k) for k in self._admin]

    def identify(self, authorization: str | None) -> ApiKey:
        token = _bearer(authorization)
        found = self._keys.get(token)
        if found is None:
            raise Unauthorized(UNKNOWN_KEY)
        return found

    def is_admin(self, authorization: str | None) -> bool:
        token = _bearer(authorization)
        return any(hmac.compare_digest(token, k) for k in self._admin)

    def valid_session(self, token: str | None) -> bool:
        return bool(token) and any(hmac.compare_digest(str(token), s) for s in self._sessions)

    def require_admin(self, authorization: str | None, session: str | None = None) -> None:
        """401 without a valid key, 403 for a user's key; ``session`` is a dashboard
        cookie, accepted only when no Authorization header was sent."""
        if authorization is None and self.valid_session(session):
            return
        if self.is_admin(authorization):  # raises Unauthorized when missing
            return
        self.identify(authorization)  # Unauthorized for an unknown key
        raise AdminRequired("this route needs an admin key")


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized(MISSING_KEY)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(MISSING_KEY)
    return token.strip()
