"""Every error fairgate answers with, each with its own OpenAI ``code``.

    FairgateError                      -> OpenAI-style JSON error, ``status``
    ├── BadRequest (400)               invalid JSON, missing or malformed fields
    │   └── PromptFitsNoBackend (400)  no backend of the model takes a prompt this long
    ├── Unauthorized (401)             missing or unknown API key
    ├── Forbidden (403)                class not allowed for this key
    │   └── AdminRequired (403)        an API key on an admin route
    │       └── CsrfRejected (403)     a dashboard action without its session's CSRF token
    ├── NotFound (404)                 unknown model, route, file, batch or request
    ├── Conflict (409)                 the state forbids it
    │   ├── RequestCancelled           an operator cancelled the queued request
    │   ├── NotQueued                  cancel of a request no longer queued
    │   ├── NoConfigFile               reload without a config file
    │   ├── KeyInConfig                revoke/rotate of a key the config file defines
    │   ├── BackendExists              a runtime backend's name or URL is taken
    │   ├── BackendNotRemovable        removing a backend the config file or a DNS
    │   │                              discovery defines through the admin API
    │   └── BackendLeaving             undrain of a backend being removed
    ├── RequestTimeout (408)           the body stopped arriving (client_idle_timeout_s)
    ├── PayloadTooLarge (413)
    ├── RateLimited (429)              per-user queue cap; carries Retry-After
    │   ├── DeadlineUnmeetable (429)   its first-token deadline cannot be met (or passed
    │   │                              while queued); Retry-After from the wait estimate
    │   ├── RateLimitExceeded (429)    a key's or tenant's rpm, tpm or max_concurrent
    │   ├── InsufficientQuota (429)    a key's or tenant's daily or monthly token budget
    │   └── LoginThrottled (429)       a client address failed too many dashboard logins
    ├── Unavailable (503)              no healthy backend (of the prompt's length range);
    │                                  carries Retry-After
    │   ├── StoreUnavailable (503)     Redis unreachable (mapped in gateway/storage/redis_client.py)
    │   ├── BackendRemoved (503)       its backend left the config after the dispatch
    │   ├── AdapterNotLoaded (503)     its runtime LoRA adapter found no slot within
    │   │   │                          adapter_load_wait_s
    │   │   └── AdapterGone (503)      the backend no longer had its LoRA adapter (unloaded
    │   │                              as the request reached it), twice
    │   └── TooManyConnections (503)   the gateway's client connection cap is reached
    ├── UpstreamError (502)            backend broken or failed mid-answer
    │   ├── UpstreamTimeout (502)      a whole answer cut by upstream_timeout_s or
    │   │                              max_request_s (charged its reservation)
    │   ├── BackendUnreachable (502)   no connection: nothing reached the backend
    │   └── AdapterLoadFailed (502)    the backend refused (or failed) to load the
    │                                  runtime LoRA adapter the request names
    └── QueueTimeout (504)             waited longer than the class's max_queue_wait_s

Errors are plain exceptions; the HTTP edge (``gateway/core/edge.py``) renders them, every way
they leave (JSON, an SSE frame, a raw answer), and gives a 429 or 503 that carries no
``retry_after_s`` the wait estimator's (``gateway/scheduling/waits.py``).
"""

from __future__ import annotations


class FairgateError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class BadRequest(FairgateError):
    status, type = 400, "invalid_request_error"


class PromptFitsNoBackend(BadRequest):
    """No backend's ``min_prompt_tokens``…``max_prompt_tokens`` holds the prompt's
    estimate (OpenAI's code for a prompt over the context length)."""

    code = "context_length_exceeded"


class Unauthorized(FairgateError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(FairgateError):
    status, type, code = 403, "permission_error", "class_not_allowed"


class AdminRequired(Forbidden):
    code = "admin_key_required"


class CsrfRejected(AdminRequired):
    code = "csrf_token_invalid"


class NotFound(FairgateError):
    status, type = 404, "invalid_request_error"
    code: str | None = "model_not_found"

    def __init__(self, message: str, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message, param, retry_after_s)
        if param != "model":  # an unknown route is not a missing model (OpenAI: code null)
            self.code = None


class Conflict(FairgateError):
    status, type = 409, "invalid_request_error"


class RequestCancelled(Conflict):
    """The client's answer when an operator cancels its queued request."""

    code = "request_cancelled"


class NotQueued(Conflict):
    code = "request_not_queued"


class NoConfigFile(Conflict):
    code = "no_config_file"


class KeyInConfig(Conflict):
    code = "key_in_config"


class BackendExists(Conflict):
    code = "backend_exists"


class BackendNotRemovable(Conflict):
    code = "backend_not_removable"


class BackendLeaving(Conflict):
    code = "backend_leaving"


class RequestTimeout(FairgateError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(FairgateError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RateLimited(FairgateError):
    status, type, code = 429, "rate_limit_error", "queue_full"


class DeadlineUnmeetable(RateLimited):
    code = "deadline_unmeetable"


class RateLimitExceeded(RateLimited):
    """Over a rate limit (policies/limits.py); carries the x-ratelimit-* headers."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int | None = None,
                 limit_headers: dict[str, str] | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit_headers = dict(limit_headers or {})


class InsufficientQuota(RateLimitExceeded):
    """Over a token budget: OpenAI's ``insufficient_quota`` (same status, other code)."""

    type = code = "insufficient_quota"


class LoginThrottled(RateLimited):
    """Too many failed dashboard logins from one address (``policies/login_throttle.py``)."""

    code = "too_many_login_failures"


class Unavailable(FairgateError):
    status, type, code = 503, "server_error", "no_healthy_backend"


class StoreUnavailable(Unavailable):
    code = "queue_store_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(f"queue store unavailable: {message}")


class BackendRemoved(Unavailable):
    code = "backend_removed"


class AdapterNotLoaded(Unavailable):
    code = "adapter_not_loaded"


class AdapterGone(AdapterNotLoaded):
    """The backend answered 404 for the LoRA adapter the request names: it was unloaded
    (to make room for another, by any replica, or by hand) while the request was on its
    way. Nothing reached the engine: admission queues the request again."""

    code = "adapter_unloaded"


class TooManyConnections(Unavailable):
    code = "too_many_connections"


class UpstreamError(FairgateError):
    status, type, code = 502, "server_error", "upstream_error"


class UpstreamTimeout(UpstreamError):
    """No status line within ``upstream_timeout_s`` of silence (or ``max_request_s``): a
    whole (non-streamed) answer, which vLLM sends at once when it is done, was cut while
    its backend may have been generating all along."""

    code = "upstream_timeout"


class BackendUnreachable(UpstreamError):
    """The connection to the backend failed before anything was sent: safe to retry."""

    code = "backend_unreachable"


class AdapterLoadFailed(UpstreamError):
    code = "adapter_load_failed"


class QueueTimeout(FairgateError):
    status, type, code = 504, "server_error", "queue_timeout"
