"""vLLM's prefix-cache block hashes, computed outside vLLM (vLLM 0.32; see
``docs/vllm-pd-and-kv-events.md`` for the source lines).

A prompt's token ids are cut into full blocks of ``block_size`` tokens (a partial tail has
no hash). Block ``i``'s hash is ``H((hash of block i-1, tuple of its token ids,
extra keys))`` where ``H`` is the server's ``--prefix-caching-hash-algo`` (default
``sha256``: SHA-256 of the tuple pickled with the highest protocol) and the first
block's parent is ``NONE_HASH = H(seed)``. The seed is ``PYTHONHASHSEED`` when the
server has it set, else the fixed ``"vllm-none-hash"`` for the cryptographic algorithms
(the ``xxhash`` ones draw a random seed per process: not reproducible from outside).

KV events publish each hash as an "external" hash: by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the low 64 bits of the digest as an unsigned
integer, otherwise the digest's bytes. :func:`external_hashes` gives that form, which is
what the prefix index (``policies/kv_index.py``) stores.

Extra keys (``generate_block_hash_extra_keys``): a LoRA adapter adds
``("lora", name, path)`` to every block, a ``cache_salt`` adds ``("cache_salt", salt)``
to the first block; multimodal inputs and prompt embeddings add digests fairgate cannot
compute (it does not run the processor), so such prompts cannot be hashed here.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs; the CPU build's attention uses 128
HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
EXTERNAL_MASK = (1 << 64) - 1


def sha256(value: Any) -> bytes:
    """vLLM's ``sha256`` algorithm: SHA-256 of ``value`` pickled (highest protocol)."""
    return hashlib.sha256(pickle.dumps(value, protocol=HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent hash of every prompt's first block."""
    return sha256(seed)


def block_extra_keys(
    index: int, *, cache_salt: str | None = None, lora: tuple[str, str] | None = None
) -> tuple[Any, ...] | None:
    """The extra keys of block ``index`` of a text-only prompt (vLLM's order: LoRA, then
    the cache salt on the first block); None when there are none."""
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt and index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """The chained digests of the full blocks of ``token_ids``, as vLLM computes them."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    parent = none_hash(seed)
    hashes: list[bytes] = []
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        block = tuple(token_ids[start : start + block_size])
        extra = block_extra_keys(index, cache_salt=cache_salt, lora=lora)
        parent = sha256((parent, block, extra))
        hashes.append(parent)
    return hashes


def external(digest: bytes) -> int:
    """A digest as KV events publish it by default: its low 64 bits, unsigned."""
    return int.from_bytes(digest, "big") & EXTERNAL_MASK


def external_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """:func:`block_hashes` in the form KV events carry them."""
    digests = block_hashes(token_ids, block_size, seed=seed, cache_salt=cache_salt, lora=lora)
    return [external(digest) for digest in digests]
