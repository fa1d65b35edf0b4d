"""The values fairgate keeps in Redis, declared once (``gateway/storage/keys.py`` owns the key
names): the fields of a request's hash, and the packed entries: a grant (in a replica's
grant list), a pending prefill (in a backend's prefill hash), a preemption order and an
end user in the last-seen zset.

Python reads and writes them here; :func:`lua_values` generates the Lua each script gets
(a builder ``<record>_entry(...)`` and one reader ``<record>_<field>(entry)`` per field,
and ``request_get(key, field, ...)``, the request hash's fields by name),
as :func:`gateway.storage.keys.lua_prelude` does for the keys. ``docs/redis-schema.md`` lists them,
and ``tests/store/test_values.py`` checks that the scripts name no request field this
module does not declare.
"""

from __future__ import annotations

from dataclasses import dataclass

# A request's hash (``req:{request_id}``): field -> what it holds, and who writes it.
REQUEST_FIELDS: dict[str, str] = {
    "user": "the user (enqueue)",
    "class": "its priority class (enqueue)",
    "tenant": "its tenant (enqueue)",
    "owner": "the replica that holds its client (enqueue)",
    "cost": "user-level dispatch cost (enqueue)",
    "tcost": "tenant-level dispatch cost (enqueue)",
    "hit": "taken off cost per prompt token a backend's index predicts cached (enqueue, "
           "locality only)",
    "thit": "taken off tcost likewise (enqueue, locality only)",
    "enqueued_at": "unix s (enqueue)",
    "state": "queued, then dispatched (enqueue, dispatch)",
    "ptok": "estimated prompt tokens (enqueue)",
    "prefix": "its prompt's block-hash chain, space-separated (enqueue, locality only)",
    "deadline": "first-token deadline, unix s (enqueue, when given)",
    "whole": "1 for a whole answer, never streamed: it runs once dispatched (enqueue)",
    "session": "its session key, \"\" the user's default session (enqueue, sessions on)",
    "adapter": "the LoRA adapter it names: only a backend having it takes it (enqueue)",
    "held_at": "when the prefill-token gate first held it, unix s (dispatch)",
    "backend": "where it was dispatched (dispatch)",
    "rank": "its user's requests already in flight: the vLLM priority rank (dispatch)",
    "dispatched_at": "unix s (dispatch)",
    "ctok": "the prompt tokens its dispatch cost charged: those predicted uncached there "
            "(dispatch)",
    "started": "1 once its first token streamed and its start reached Redis",
    "preempted": "how often the stream was preempted (preempt.lua, on the original's hash)",
    "unmovable": "1 once its replica refused to preempt it (PreemptStore.preempt_refused)",
    "left": "1 once the segment left its backend: its answer continues elsewhere "
            "(enqueue of the continuation; its settle then only forgets it)",
}


@dataclass(frozen=True, slots=True)
class Record:
    """A value packed into one string: ``fields`` joined by ``sep``."""

    name: str
    fields: tuple[str, ...]
    sep: str

    def encode(self, *values: object) -> str:
        if len(values) != len(self.fields):
            raise ValueError(f"{self.name} takes {self.fields}, got {values!r}")
        return self.sep.join(str(v) for v in values)

    def decode(self, text: str) -> dict[str, str]:
        parts = text.split(self.sep)
        if len(parts) != len(self.fields):
            raise ValueError(f"not a {self.name} entry: {text!r}")
        return dict(zip(self.fields, parts, strict=True))

    def lua(self) -> str:
        sep = "\\t" if self.sep == "\t" else self.sep
        joined = (" .. '" + sep + "' .. ").join(self.fields)
        out = [f"local function {self.name}_entry({', '.join(self.fields)})\n"
               f"  return {joined}\nend\n"]
        other = f"[^{sep}]"
        for i, name in enumerate(self.fields):
            pattern = "^" + (other + "*" + sep) * i + "(" + other + "*)"
            out.append(f"local function {self.name}_{name}(entry)\n"
                       f"  return string.match(entry, '{pattern}')\nend\n")
        return "".join(out)


# A grant pushed to the replica that holds the client (``grants:{replica}``).
# ``charged``: the prompt tokens its dispatch cost charged (predicted uncached there).
GRANT = Record("grant", ("request_id", "backend", "rank", "pushed_at", "charged"), "\t")
# A request's uncached prompt tokens, maybe not yet scheduled (``bk:{backend}:prefill``).
PREFILL = Record("prefill", ("tokens", "dispatched_at"), " ")
# A preemption order pushed to the replica that holds the stream (``preempts:{replica}``):
# the running segment's id, the original request's id and the backend it runs on.
PREEMPT = Record("preempt", ("request_id", "original", "backend"), "\t")
# A trusted key's end user in the model's last-seen zset (``seen``): its tenant (its own
# name when the key names none) and its name; neither holds a TAB (an end user's name is
# printable text, a key's tenant a configured name).
SEEN = Record("seen", ("tenant", "user"), "\t")
RECORDS = (GRANT, PREFILL, PREEMPT, SEEN)


# The request hash's reader in Lua: ``request_get(key, 'owner', 'cost')`` is
# ``{owner = ..., cost = ...}`` (one HMGET; a field the hash lacks reads false), and a name
# :data:`REQUEST_FIELDS` does not declare is an error, so no script reads a field by place.
REQUEST_READER = """local REQUEST_FIELD = {%s}
local function request_get(key, ...)
  local names = {...}
  local values = redis.call('HMGET', key, ...)
  local out = {}
  for i = 1, #names do
    if not REQUEST_FIELD[names[i]] then error('no request field ' .. names[i]) end
    out[names[i]] = values[i]
  end
  return out
end
"""


def lua_values() -> str:
    """Lua builders and readers of every packed entry, and the request hash's reader."""
    declared = ", ".join(f"['{name}'] = true" for name in REQUEST_FIELDS)
    return "".join(r.lua() for r in RECORDS) + REQUEST_READER % declared


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """One request's additions to its day's usage hash: row field -> amount."""

    key: str
    counts: dict[str, int]
    ttl_s: int


# A continuation's request id: the original's, then the continuation's number, so that
# whoever reads a replica's running set knows which answer a segment continues.
CONTINUED_SEP = "~"


def continuation_id(original: str, number: int) -> str:
    return f"{original}{CONTINUED_SEP}{number}"


def original_id(request_id: str) -> tuple[str, int]:
    """(the original request's id, the segment's number: 0 for the original)."""
    original, _, number = request_id.partition(CONTINUED_SEP)
    return original, int(number) if number.isdigit() else 0
