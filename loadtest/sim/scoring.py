"""``/rerank`` and ``/score`` as vLLM 0.32 serves them (``pooling/scoring``), simulated.

vLLM serves the rerank API (Jina's and Cohere's shape) at ``/rerank``, ``/v1/rerank`` and
``/v2/rerank``, and the score API at ``/score`` and ``/v1/score``; a cross-encoder
scores each (query, document) pair as one engine request (prefill only, like an
embedding).

Requests (``RerankRequest``, ``ScoreRequest``): a rerank names one ``query`` and its
``documents`` (a string or an array of them), ``top_n`` (0: all) keeps the best; a score
names two sides, as ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``
or ``text_1``/``text_2``, each a string or an array of them, paired 1:1, 1:N (the one
query with every document) or N:N (by position). Multimodal inputs (``{"content": [...]}``)
are refused, as vLLM refuses them for a text-only model.

Answers (``RerankResponse``, ``ScoreResponse``, as ``model_dump()`` writes them): a
rerank's ``results`` sorted by ``relevance_score``, best first, each with its ``index``
and ``document`` (``{"text", "multi_modal"}``), its ``usage`` ``{prompt_tokens,
total_tokens}``; a score's ``data`` (``{index, object: "score", score}``) in pair order,
its ``usage`` vLLM's ``UsageInfo``. Both ids are ``score-`` and 16 hex digits. Usage
counts every pair's tokens: the query is read once per document.

Scores are deterministic: the share of the query's words the document holds, plus a
little seeded noise, so a document that repeats the query ranks above one that does not.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from loadtest.sim import tokenizer
from loadtest.sim.protocol import (
    Prompt,
    SimError,
    _check_context,
    _int_field,
    body_error,
)

# a cross-encoder's pair: [CLS] query [SEP] document [SEP]
PAIR_SPECIAL_TOKENS = 3
# the score request's side names, in the order vLLM's union tries them
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))
ARCHITECTURE = "SimForSequenceClassification"


@dataclass(frozen=True)
class Pair:
    """One (query, document) pair: one engine request."""

    query: str
    document: str
    tokens: int  # both sides' and the cross-encoder's special tokens


@dataclass(frozen=True)
class ScoringRequest:
    """What the simulator acts on: the pairs, the documents as sent, ``top_n``."""

    pairs: tuple[Pair, ...]
    documents: tuple[str, ...]
    top_n: int  # rerank: the results kept (0: all); score: 0
    priority: int

    @property
    def prompt_tokens(self) -> int:
        """Tokens of all pairs (the usage)."""
        return sum(p.tokens for p in self.pairs)


def _texts(body: dict[str, Any], name: str, many: bool) -> list[str]:
    """A side of the request: a string, or (``many``) an array of strings."""
    if name not in body:
        raise body_error(name, "missing", "Field required", body)
    value = body[name]
    values = value if many and isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, dict) and "content" in item:
            raise SimError(400, f"MultiModalParam is not supported for {ARCHITECTURE}")
        if not isinstance(item, str):
            raise body_error(name, "string_type", "Input should be a valid string", item)
    return list(values)


def _pairs(queries: list[str], documents: list[str], model_len: int) -> tuple[Pair, ...]:
    """vLLM's checks on the two sides (``_validate_score_input_lens``) and on each pair's
    length, and the pairs: 1:N repeats the query for every document."""
    if len(queries) > 1 and len(queries) != len(documents):
        raise SimError(400, "Input lengths must be either 1:1, 1:N or N:N")
    if not queries:
        raise SimError(400, "At least one text element must be given")
    if not documents:
        raise SimError(400, "At least one text_pair element must be given")
    if len(queries) == 1:
        queries = queries * len(documents)
    pairs = []
    for query, document in zip(queries, documents, strict=True):
        tokens = (len(tokenizer.encode(query)) + len(tokenizer.encode(document))
                  + PAIR_SPECIAL_TOKENS)
        pair = Pair(query, document, tokens)
        _check_context(Prompt(b"", pair.tokens, len(query) + len(document)), model_len)
        pairs.append(pair)
    return tuple(pairs)


def _priority(body: dict[str, Any], header: str | None) -> int:
    priority = _int_field(body, "priority") or 0
    if header is not None:
        try:
            priority = int(header)
        except ValueError as exc:
            raise SimError(400, "X-Vllm-Priority must be an integer") from exc
    return priority


def parse_rerank(body: dict[str, Any], *, headers_priority: str | None, model_len: int
                 ) -> ScoringRequest:
    """Validate a rerank body (``RerankRequest``); raise ``SimError`` on bad input."""
    query = _texts(body, "query", many=False)
    documents = _texts(body, "documents", many=True)
    top_n = _int_field(body, "top_n") or 0
    if top_n < 0:
        raise body_error("top_n", "greater_than_equal",
                         "Input should be greater than or equal to 0", top_n)
    return ScoringRequest(_pairs(query, documents, model_len), tuple(documents), top_n,
                          _priority(body, headers_priority))


def parse_score(body: dict[str, Any], *, headers_priority: str | None, model_len: int
                ) -> ScoringRequest:
    """Validate a score body (``ScoreRequest``: the first pair of side names it sets);
    raise ``SimError`` on bad input."""
    first, second = next(((a, b) for a, b in SCORE_SIDES if a in body and b in body),
                         SCORE_SIDES[-1])
    queries = _texts(body, first, many=True)
    documents = _texts(body, second, many=True)
    return ScoringRequest(_pairs(queries, documents, model_len), tuple(documents), 0,
                          _priority(body, headers_priority))


def relevance(pair: Pair, seed: int) -> float:
    """A pair's score in [0, 1): the share of the query's words found in the document
    (0.9 of it) and seeded noise (0.1)."""
    wanted = set(pair.query.lower().split())
    found = set(pair.document.lower().split())
    overlap = len(wanted & found) / len(wanted) if wanted else 0.0
    salt = seed.to_bytes(8, "big", signed=True)
    key = repr((pair.query, pair.document)).encode()
    digest = hashlib.blake2b(key, digest_size=8, key=salt).digest()
    return 0.9 * overlap + 0.1 * (int.from_bytes(digest, "big") / 2**64)


def request_id() -> str:
    """vLLM's ``score-`` id (its ``random_uuid``: 16 hex digits)."""
    return f"score-{uuid.uuid4().int & (2**64 - 1):016x}"


def rerank_body(req: ScoringRequest, rid: str, model: str, seed: int) -> dict[str, Any]:
    """vLLM's ``RerankResponse``."""
    scored = sorted(((relevance(pair, seed), i) for i, pair in enumerate(req.pairs)),
                    key=lambda s: s[0], reverse=True)  # stable: ties keep their order
    if 0 < req.top_n < len(scored):
        scored = scored[:req.top_n]
    results = [{"index": i, "document": {"text": req.documents[i], "multi_modal": None},
                "relevance_score": score} for score, i in scored]
    tokens = req.prompt_tokens
    return {"id": rid, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results}


def score_body(req: ScoringRequest, rid: str, model: str, seed: int) -> dict[str, Any]:
    """vLLM's ``ScoreResponse``."""
    tokens = req.prompt_tokens
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": relevance(pair, seed)}
                     for i, pair in enumerate(req.pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None,
                      "completion_tokens_details": None}}
