"""``POST /v1/embeddings`` as vLLM 0.32 serves it (``pooling/embed``), simulated.

Request: ``input`` is a string, an array of strings, an array of token ids or an array of
such arrays; each is one prompt (one engine request, prefill only: the engine computes
the prompt and the request finishes, no token is generated). ``encoding_format`` is
``float`` (default) or ``base64`` (little-endian float32, what the official SDK asks for
and decodes), ``dimensions`` (matryoshka: at most the model's) truncates the vector, and
``normalize`` (default true) makes it unit length.

Vectors are deterministic: seeded from the prompt's token ids (``loadtest/sim/tokenizer``),
so a text and its token ids embed alike. Usage counts the prompt tokens
(``completion_tokens`` 0), like vLLM's ``UsageInfo``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

from loadtest.sim import tokenizer
from loadtest.sim.protocol import (
    Prompt,
    SimError,
    _check_context,
    _int_field,
    body_error,
    validation_error,
)

DEFAULT_DIMENSIONS = 384
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """What the simulator acts on: the prompts' token ids and the output format."""

    prompts: tuple[tuple[int, ...], ...]
    encoding_format: str
    dimensions: int
    normalize: bool
    priority: int

    @property
    def prompt_tokens(self) -> int:
        """Tokens of all prompts (the usage)."""
        return sum(len(p) for p in self.prompts)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(value: Any) -> list[tuple[list[int], int | None]]:
    """Each prompt's token ids, and its characters when it came as text."""
    if isinstance(value, str):
        return [(tokenizer.encode(value), len(value))]
    if _is_ids(value) and value:
        return [(list(value), None)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(tokenizer.encode(v), len(v)) for v in value]
        if all(_is_ids(v) for v in value):
            return [(list(v), None) for v in value]
    raise body_error(
        "input", "union_tag_invalid",
        "Input should be a string, an array of strings, an array of token ids or an array "
        "of token id arrays", value,
    )  # fmt: skip


def parse_embedding(
    body: dict[str, Any], *, headers_priority: str | None, model_len: int, dimensions: int
) -> EmbeddingRequest:
    """Validate an embeddings body; raise ``SimError`` on bad input."""
    if "input" not in body:
        raise body_error("input", "missing", "Field required", body)
    prompts = _prompts(body["input"])
    for ids, chars in prompts:
        if not ids:  # the empty string: nothing to pool
            raise validation_error("input", "The prompt must not be empty.")
        _check_context(Prompt(b"", len(ids), chars), model_len)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise body_error(
            "encoding_format", "literal_error", "Input should be 'float' or 'base64'", encoding
        )
    wanted = _int_field(body, "dimensions")
    if wanted is not None and not 1 <= wanted <= dimensions:
        raise validation_error(
            "dimensions",
            f"Dimensions must be between 1 and {dimensions} for this model.",
            wanted,
        )
    priority = _int_field(body, "priority") or 0
    if headers_priority is not None:
        try:
            priority = int(headers_priority)
        except ValueError as exc:
            raise SimError(400, "X-Vllm-Priority must be an integer") from exc
    normalize = body.get("normalize")
    return EmbeddingRequest(
        prompts=tuple(tuple(ids) for ids, _ in prompts),
        encoding_format=encoding,
        dimensions=wanted or dimensions,
        normalize=normalize is None or bool(normalize),
        priority=priority,
    )


def vector(ids: tuple[int, ...], dimensions: int, seed: int, normalize: bool) -> list[float]:
    """A deterministic vector for a prompt: Gaussian, seeded by the token ids."""
    salt = seed.to_bytes(8, "big", signed=True)
    digest = hashlib.blake2b(json.dumps(ids).encode(), digest_size=8, key=salt).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    if normalize:
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        values = [v / norm for v in values]
    return values


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the numbers; ``base64``: little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def embedding_body(req: EmbeddingRequest, request_id: str, model: str, seed: int) -> dict[str, Any]:
    """vLLM's ``EmbeddingResponse``."""
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": encode_vector(
                vector(ids, req.dimensions, seed, req.normalize), req.encoding_format
            ),
        }
        for i, ids in enumerate(req.prompts)
    ]
    tokens = req.prompt_tokens
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
