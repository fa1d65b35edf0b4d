"""vLLM V1's automatic prefix caching (APC) as a plain data structure: the KV block pool.

No clock, no I/O; the step planner (``loadtest/sim/scheduler.py``) drives it. As in
``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``:

- A prompt is split into blocks of ``block_size`` tokens; only full blocks are hashed,
  as a chain: ``hash(block i) = H(hash(block i-1), token ids of block i)`` (the first
  block's parent is a fixed ``NONE_HASH``), so equal hashes mean equal prefixes. ``H`` is
  vLLM's own default (``policies/kv_blocks.py``: SHA-256 of the pickled tuple, seed
  ``"vllm-none-hash"``), so the KV events the simulator publishes carry the hashes a
  real server would.
- Every physical block has a reference count. Blocks with no reference sit in one free
  queue, least recently freed first; never used blocks come before all of them. A request
  that finishes (or is preempted or aborted) frees its blocks in reverse order, so its
  tail is evicted before its head. A freed block keeps its hash and stays findable until
  it is taken from the head of the free queue for new work: that is the LRU eviction.
- Admission looks up the longest run of cached blocks from the start of the prompt,
  capped at ``(num_tokens - 1) // block_size`` blocks: when the whole prompt is cached,
  vLLM still computes its last token for the logits, and since a hit ends on a block
  boundary the whole last block is recomputed. The hit blocks are pinned (reference +1,
  out of the free queue); blocks of tokens scheduled for computation are registered
  under their hash when allocated, as vLLM's ``cache_blocks`` does (a duplicate of an
  already cached hash is kept too, the lookup returns the first).
- With ``enable_kv_cache_events`` the pool records, as vLLM's block pool does, one
  ``stored`` event per run of newly registered full blocks (their hashes, the parent
  hash, their token ids) and one ``removed`` event per evicted block; the engine takes
  them after each step (:meth:`BlockPool.take_events`).
- ``queries`` and ``hits`` count prompt tokens looked up and tokens found cached, for
  requests admitted for the first time (``PrefixCacheStats.record``: a preempted
  request's re-admission is not counted); they back ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits``.

Only prompt blocks are hashed; generated tokens' blocks are never cached (the simulator
has no output token ids), so a follow-up turn hits its previous prompt, not the answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.kv_blocks import none_hash, sha256

NONE_HASH = none_hash()


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Full blocks newly registered for one request: their digests (a chain whose first
    parent is ``parent``, None for a prompt's first block) and their token ids."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemovedBlock:
    """One evicted block's digest."""

    block_hash: bytes


PoolEvent = StoredBlocks | RemovedBlock


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block (vLLM's, without extra keys)."""
    return sha256((parent, tuple(token_ids), None))


def hash_blocks(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain of hashes of the full blocks of ``token_ids`` (a partial tail has none)."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockTable:
    """One request's blocks: the block ids it holds, its prompt's block hashes, and how
    many of its leading blocks are registered in the cache."""

    hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    token_ids: Sequence[int] = ()  # the prompt's ids (for KV events' token_ids)


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens, with or without prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.queries = 0
        self.hits = 0
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._never_used = num_blocks  # ids num_blocks - _never_used .. num_blocks - 1
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, LRU first
        self._cached: dict[bytes, dict[int, None]] = {}
        self._events: list[PoolEvent] | None = [] if enable_kv_cache_events else None

    def take_events(self) -> list[PoolEvent]:
        """The events recorded since the last call (none when events are off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (never used, or freed and possibly still cached)."""
        return self._never_used + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their hash (held or free)."""
        return sum(len(blocks) for blocks in self._cached.values())

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); cached free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_cached(self, block_hash: bytes) -> bool:
        """True if a block with this hash can be found."""
        return block_hash in self._cached

    def free_queue(self) -> list[int]:
        """Freed block ids in eviction order (for tests and debugging)."""
        return list(self._free)

    def find_hit(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (no side effects), capped
        so that at least the last of ``num_tokens`` tokens is computed."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for block_hash in hashes[: max(0, num_tokens - 1) // self.block_size]:
            blocks = self._cached.get(block_hash)
            if not blocks:
                break
            hit.append(next(iter(blocks)))
        return hit

    def record(self, num_tokens: int, num_hits: int) -> None:
        """Count one first-time admission's lookup: ``num_tokens`` queried, ``num_hits``
        found cached."""
        if self.enable_caching:
            self.queries += num_tokens
            self.hits += num_hits

    def allocate(self, table: BlockTable, num_tokens: int, hit: Sequence[int] = ()) -> bool:
        """Make ``table`` hold blocks for ``num_tokens`` tokens, the first ones being the
        cached blocks ``hit`` (only for a table that holds nothing yet). Returns False, and
        changes nothing, if there are not enough free blocks; evicts LRU cached blocks as
        needed. Full blocks of the prompt within ``num_tokens`` are registered."""
        need = -(-num_tokens // self.block_size) - len(table.blocks) - len(hit)
        evictable_hits = sum(1 for b in hit if self._refs[b] == 0)
        if max(need, 0) + evictable_hits > self.num_free_blocks:
            return False
        for block in hit:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        table.blocks.extend(hit)
        table.num_cached = max(table.num_cached, len(hit))
        for _ in range(need):
            table.blocks.append(self._take())
        if self.enable_caching:
            self._register(table, num_tokens)
        return True

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table`` (in reverse order: its tail is evicted first);
        cached blocks stay findable until evicted."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        table.blocks.clear()
        table.num_cached = 0

    def _take(self) -> int:
        if self._never_used:
            block = self.num_blocks - self._never_used
            self._never_used -= 1
        else:
            block, _ = self._free.popitem(last=False)
            self._evict(block)
        self._refs[block] = 1
        return block

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is None:
            return
        self._hash[block] = None
        holders = self._cached[block_hash]
        del holders[block]
        if not holders:
            del self._cached[block_hash]
        if self._events is not None:
            self._events.append(RemovedBlock(block_hash))

    def _register(self, table: BlockTable, num_tokens: int) -> None:
        full = min(num_tokens // self.block_size, len(table.hashes), len(table.blocks))
        start = table.num_cached
        for index in range(start, full):
            block, block_hash = table.blocks[index], table.hashes[index]
            if self._hash[block] is None:
                self._hash[block] = block_hash
                self._cached.setdefault(block_hash, {})[block] = None
        if self._events is not None and full > start:
            size = self.block_size
            self._events.append(StoredBlocks(
                tuple(table.hashes[start:full]),
                table.hashes[start - 1] if start else None,
                tuple(table.token_ids[start * size : full * size]),
            ))  # fmt: skip
        table.num_cached = max(table.num_cached, full)
