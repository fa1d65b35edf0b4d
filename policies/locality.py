"""Prefix locality: a prompt's chain of block hashes, and which queued head a backend
takes when fairness leaves a choice (``routing: locality``).

**The chain.** A prompt's text (chat messages in order, each its role and content; a
completion prompt; an embeddings/Responses input after its instructions) is cut into
chunks of :data:`BLOCK_CHARS` characters (≈ 64 tokens, four of vLLM's 16-token blocks);
each chunk's hash covers its bytes and the previous hash, so two prompts share the first
``n`` hashes exactly when their first ``n`` chunks are equal, as vLLM's chained block
hashes do. Only full chunks count (vLLM caches only full blocks), and only the first
:data:`MAX_BLOCKS` (≈ 2k tokens: enough to tell sessions' system prompts and early turns
apart, bounded in Redis). These hashes are consistent only with themselves: they are not
vLLM's hashes (fairgate does not tokenize), they only predict where an equal prefix went.

**The choice** (:func:`choose`, mirrored by ``gateway/lua/dispatch.lua``): when a backend
can take a request of a class, the users whose fairness score is within ``slack`` of the
smallest (at most ``candidates`` of them, in fairness order) are considered, each with the
first few requests of its queue (``lookahead``, 4: a user's own requests may pass each
other, users may not); the request whose chain has the longest prefix in the backend's
index is served, ties to the fairness order (then to the user's oldest). A request with
nothing cached here whose first block another backend holds is left to that backend
unless it is busier than this one by more than ``locality_max_imbalance`` in-flight
requests (bounded-load affinity); when every request within the slack is left so, the
backend takes none of that class now. ``slack`` 0 is the strict fairness order (each
user's oldest request first). A user more than ``slack`` above the smallest score is never
served before the least-served user, so the fairness bound of the policy grows by
``slack`` at most (``policies/fairness.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, TypeVar

BLOCK_CHARS = 256
DISPATCH_REASONS = ("cache_hit", "load", "fairness_order")
"""Why a dispatched request went to its backend (``gateway/lua/dispatch.lua``): its prefix
index held the prompt's first blocks; placed by load (``routing: least_loaded``, or the
backend holding its prefix was busier than ``locality_max_imbalance`` allows); nothing
cached anywhere, so the fairness order's next request to a backend with room."""
MAX_BLOCKS = 32
HASH_BYTES = 8  # 16 hex characters per block hash


def _pieces(value: Any) -> Iterator[str]:
    """Text of a prompt, message content or input, in order (content parts, nesting)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.append(item.get("content", ""))
            stack.append(item.get("text", ""))
        elif isinstance(item, int):
            yield f"{item} "  # token ids: equal ids, equal text


def _prompt_pieces(body: dict[str, Any]) -> Iterator[str]:
    if isinstance(messages := body.get("messages"), list):
        for message in messages:
            if isinstance(message, dict):
                yield f"\x1e{message.get('role', '')}\x1f"
                yield from _pieces(message.get("content", ""))
        return
    if "input" in body:
        if isinstance(instructions := body.get("instructions"), str):
            yield instructions
        yield from _pieces(body["input"])
        return
    yield from _pieces(body.get("prompt", ""))


def prompt_text(body: dict[str, Any], limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str:
    """The first ``limit`` characters of the prompt a request body carries."""
    out: list[str] = []
    size = 0
    for piece in _prompt_pieces(body):
        out.append(piece[: limit - size])
        size += len(out[-1])
        if size >= limit:
            break
    return "".join(out)


def chain(text: str, max_blocks: int = MAX_BLOCKS) -> tuple[str, ...]:
    """Chained hashes of the text's full :data:`BLOCK_CHARS`-character chunks (at most
    ``max_blocks``), each a hex string; a stable function of the text alone."""
    hashes: list[str] = []
    previous = b""
    # chunks by characters, not bytes: equal text prefixes give equal chunks
    for i in range(min(len(text) // BLOCK_CHARS, max_blocks)):
        chunk = text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=HASH_BYTES).digest()
        hashes.append(previous.hex())
    return tuple(hashes)


def prefix_chain(body: dict[str, Any]) -> tuple[str, ...]:
    """The block-hash chain of a request body's prompt (computed once, at admission)."""
    return chain(prompt_text(body))


def matched(hashes: Sequence[str], cached: Container[str]) -> int:
    """How many leading hashes of a chain a backend's index holds."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


def held_elsewhere(hashes: Sequence[str], others: Sequence[tuple[Container[str], int]],
                   load: int, max_imbalance: int) -> bool:
    """Whether another backend holds the chain's first block and is not busier than this
    one (``load``: its dispatched, unsettled requests) by more than ``max_imbalance``:
    then the request is left for it (bounded-load affinity, as SGLang's router does)."""
    return bool(hashes) and any(hashes[0] in index and other_load <= load + max_imbalance
                                for index, other_load in others)


def choose(users: Sequence[tuple[float, Sequence[Sequence[str]]]], cached: Container[str],
           slack: float, candidates: int,
           elsewhere: Callable[[Sequence[str]], bool] = lambda _: False
           ) -> tuple[int, int] | None:
    """(user, request) to serve among ``users`` — each (score, the chains of the first
    requests of its queue, oldest first) in fairness order, smallest score first — or
    None when every request within the slack is better left to another backend
    (``elsewhere``: see :func:`held_elsewhere`). (0, 0) is the strict fairness choice."""
    if not users or slack <= 0:
        return (0, 0) if users else None
    floor = users[0][0]
    best, best_len = None, -1
    for i, (score, chains) in enumerate(users[:candidates]):
        if score > floor + slack:
            break
        for j, hashes in enumerate(chains):
            length = matched(hashes, cached)
            if length == 0 and elsewhere(hashes):
                continue
            if length > best_len:
                best, best_len = (i, j), length
    return best

T = TypeVar("T")


def within_slack(tenants: Sequence[tuple[float, Sequence[tuple[float, T]]]], slack: float,
                 candidates: int) -> list[T]:
    """The users locality compares under tenants (``gateway/lua/dispatch.lua`` pick()):
    ``tenants`` in fairness order, each (its score, its users in fairness order, each
    (score, user)). The tenants within ``slack`` of the least-served one, and in each the
    users within ``slack`` of its least-served user, at most ``candidates`` users in all,
    in that order; :func:`choose` then picks among them (with no tenants configured each
    tenant has one user and these are the users within the slack, as before)."""
    if not tenants:
        return []
    floor = tenants[0][0]
    found: list[T] = []
    for score, users in tenants[:candidates]:
        if score > floor + slack:
            break
        if not users:
            continue
        least = users[0][0]
        found += [user for s, user in users[:candidates - len(found)] if s <= least + slack]
        if len(found) >= candidates:
            break
    return found
