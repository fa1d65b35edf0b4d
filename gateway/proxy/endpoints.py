"""The one table of the OpenAI endpoints fairgate serves, each declared once.

An :class:`Endpoint` states its path and method, how fairgate handles it (``kind``:
queued fairly and forwarded, forwarded unqueued, or answered here), the field its prompt
is estimated from, the fields that bound its output tokens, whether and how it streams
(the relay's frame kinds), the names of its usage counts, whether the Batch API takes
it, what the simulator does for it, and its OpenAPI operation. Everything else derives
from it: the routes (``gateway/http/routes.py``, ``gateway/http/batch_routes.py``), body
validation (``gateway/proxy/completion_request.py``), admission's estimate and reservation
(``gateway/scheduling/admission.py``), the relay (``gateway/proxy/upstream.py``,
``gateway/proxy/relay.py``),
``/openapi.json`` (``gateway/http/openapi.py``) and the simulator's routes
(``loadtest/sim/server.py``).

A new endpoint is one entry here plus its tests (and, when its body is new to OpenAPI,
its schema in ``gateway/http/static/openapi.yaml``; when the simulator must serve it, its
behaviour in ``loadtest/sim/server.py``). An endpoint whose prompt has a shape of its own
(not ``messages``, ``prompt`` or ``input``) adds one function here too: its *prompt
reader*, registered under its ``prompt_field`` with :func:`prompt_shape`, which checks
the body's prompt fields (a :class:`BadRequest` naming the first wrong one) and returns
the :class:`~policies.request.Prompt` the estimate, the reservation and the prefix chain
read. Everything else of a body (model, stream, output-token fields, ``n``, user,
session) is read generically from the entry's fields
(``gateway/proxy/completion_request.parse_body``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import BadRequest
from policies.request import Prompt


class Kind(enum.Enum):
    QUEUED = "queued"  # scheduled through admission, then forwarded to a backend
    FORWARDED = "forwarded"  # cheap: straight to a healthy backend, not queued
    LOCAL = "local"  # answered by fairgate itself


class Frames(enum.Enum):
    """How a streamed answer is framed (what the relay reads)."""

    NONE = "none"  # never streamed
    CHOICES = "choices"  # chat/completions: choice deltas, a usage frame, ``[DONE]``
    EVENTS = "events"  # Responses API: typed events; the final one carries the usage


@dataclass(frozen=True, slots=True)
class Usage:
    """The names of a backend's usage counts in this endpoint's answers."""

    prompt: str = "prompt_tokens"
    output: str = "completion_tokens"
    # the object holding ``cached_tokens``: the prompt tokens vLLM found in its prefix
    # cache (reported with --enable-prompt-tokens-details)
    details: str = "prompt_tokens_details"


CHOICES_USAGE = Usage()
RESPONSES_USAGE = Usage("input_tokens", "output_tokens", "input_tokens_details")


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    method: str
    operation_id: str  # also the name its handler is registered under
    kind: Kind
    summary: str = ""
    request_schema: str | None = None  # components/schemas in the OpenAPI document
    response_schema: str | None = None
    # the body field its prompt is read from; its shape's reader is PROMPT_READERS[it]
    prompt_field: str | None = None  # messages | prompt | input | query | text_1
    # the fields the backend honours as output-token bounds: the smallest set is the
    # request's (``CompletionRequest.output``; every one of them says it when forwarded)
    output_token_fields: tuple[str, ...] = ()
    frames: Frames = Frames.NONE
    usage: Usage = CHOICES_USAGE
    batchable: bool = False  # a Batch API line may target it
    sim: str | None = None  # the simulator's behaviour; None: the simulator lacks it
    # the body field naming a conversation, a session key when X-Fairgate-Session is absent
    session_field: str | None = None

    @property
    def queued(self) -> bool:
        return self.kind is Kind.QUEUED

    @property
    def streams(self) -> bool:
        return self.frames is not Frames.NONE

    @property
    def stream_usage_option(self) -> bool:
        """A stream's usage comes only when asked (``stream_options.include_usage``)."""
        return self.frames is Frames.CHOICES

    def read_prompt(self, body: dict[str, Any]) -> Prompt | None:
        """The body's prompt, read by this endpoint's prompt reader (None: it has none)."""
        if self.prompt_field is None:
            return None
        return PROMPT_READERS[self.prompt_field](body)


# A prompt reader: checks a body's prompt fields (BadRequest naming the first wrong one)
# and returns its Prompt. One per body shape, registered under the prompt field that names
# the shape (an entry's ``prompt_field``).
PromptReader = Callable[[dict[str, Any]], Prompt]
PROMPT_READERS: dict[str, PromptReader] = {}


def prompt_shape(field: str) -> Callable[[PromptReader], PromptReader]:
    """Registers a prompt reader for the entries whose ``prompt_field`` is ``field``."""
    def register(reader: PromptReader) -> PromptReader:
        PROMPT_READERS[field] = reader
        return reader
    return register


def _present(body: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(body[name] for name in names if name in body)


@prompt_shape("messages")
def chat_prompt(body: dict[str, Any]) -> Prompt:
    """Chat: ``messages``, each an object with a role; the template also renders the
    ``tools`` and ``documents``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    contents, roles = [], []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise BadRequest("each message must be an object with a 'role'",
                             param="messages")
        contents.append(message.get("content", ""))
        roles.append(message["role"])
    return Prompt("messages", contents, roles=tuple(roles), least=0,
                  rendered=_present(body, ("messages", "tools", "documents")),
                  template_items=len(messages))


def _text_or_array(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    if not isinstance(value, str | list):
        raise BadRequest(f"'{name}' must be a string or an array", param=name)
    return value


@prompt_shape("prompt")
def completion_prompt(body: dict[str, Any]) -> Prompt:
    """A completion's ``prompt``: a text, token ids, or several of either (each its own
    prompt); not templated."""
    prompt = _text_or_array(body, "prompt")
    several = isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt)
    return Prompt("prompt", prompt, rendered=(prompt,),
                  prompts=len(prompt) if several else 1)


@prompt_shape("input")
def input_prompt(body: dict[str, Any]) -> Prompt:
    """Embeddings' and the Responses API's ``input``: a text, token ids or input items,
    read after the ``instructions``; the template also renders the ``tools``."""
    value = _text_or_array(body, "input")
    instructions = body.get("instructions")
    items = sum(1 for i in value if isinstance(i, dict)) if isinstance(value, list) else 0
    return Prompt("input", value,
                  preamble=instructions if isinstance(instructions, str) else None,
                  items=items, rendered=_present(body, ("input", "instructions", "tools")),
                  template_items=len(value) if isinstance(value, list) else 1)



def _score_inputs(body: dict[str, Any], name: str, many: bool) -> list[Any]:
    """One side of a rerank or score body: a text or an object with a ``content`` array
    (vLLM's ``ScoreInput``), or (``many``) a non-empty array of them."""
    value = body.get(name)
    values = value if many and isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) or (isinstance(v, dict) and isinstance(
            v.get("content"), list)) for v in values):
        raise BadRequest(f"'{name}' must be a string or an object with a 'content' array"
                         + (", or a non-empty array of them" if many else ""), param=name)
    return values


def _pairs(body: dict[str, Any], first: str, second: str) -> Prompt:
    """A cross-encoder's prompt: each (query, document) pair is one sequence the model
    reads, the one query read once per document (1:N) or the queries paired by position
    (N:N); the score template renders ``instruction`` and ``chat_template_kwargs`` into
    each pair."""
    queries = _score_inputs(body, first, many=True)
    documents = _score_inputs(body, second, many=True)
    if len(queries) > 1 and len(queries) != len(documents):
        raise BadRequest(f"'{first}' must be one or as many as '{second}' (pairs 1:1, 1:N "
                         f"or N:N; got {len(queries)} and {len(documents)})", param=first)
    pairs = zip(queries * len(documents) if len(queries) == 1 else queries, documents,
                strict=True)
    text = [side for pair in pairs for side in pair]
    extra = _present(body, ("instruction", "chat_template_kwargs"))
    return Prompt(first, text, items=len(documents),
                  rendered=(text, *extra * len(documents)), template_items=len(documents))


@prompt_shape("query")
def rerank_prompt(body: dict[str, Any]) -> Prompt:
    """vLLM's rerank: one ``query`` and its ``documents``."""
    _score_inputs(body, "query", many=False)
    return _pairs(body, "query", "documents")


# the sides of vLLM's score body, in the order its request union reads them
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))


@prompt_shape("text_1")
def score_prompt(body: dict[str, Any]) -> Prompt:
    """vLLM's score: two sides, ``text_1`` and ``text_2`` or another of its spellings
    (:data:`SCORE_SIDES`: the first the body sets both of)."""
    first, second = next(((a, b) for a, b in SCORE_SIDES if a in body and b in body),
                         SCORE_SIDES[-1])
    return _pairs(body, first, second)



CHAT = Endpoint(
    "/v1/chat/completions", "POST", "createChatCompletion", Kind.QUEUED,
    "A chat completion, queued fairly and forwarded to a vLLM backend",
    "CreateChatCompletionRequest", "ChatCompletion", "messages",
    ("max_tokens", "max_completion_tokens"), Frames.CHOICES,
    batchable=True, sim="chat")
COMPLETIONS = Endpoint(
    "/v1/completions", "POST", "createCompletion", Kind.QUEUED,
    "A text completion, queued fairly and forwarded to a vLLM backend",
    "CreateCompletionRequest", "Completion", "prompt", ("max_tokens",), Frames.CHOICES,
    batchable=True, sim="completion")
EMBEDDINGS = Endpoint(
    "/v1/embeddings", "POST", "createEmbedding", Kind.QUEUED,
    "Embeddings, queued fairly in the key's class (cost = input tokens)",
    "CreateEmbeddingRequest", "EmbeddingList", "input", batchable=True, sim="embeddings")
RESPONSES = Endpoint(
    "/v1/responses", "POST", "createResponse", Kind.QUEUED,
    "The Responses API, queued fairly like chat; stream events relayed as they come",
    "CreateResponseRequest", "Response", "input", ("max_output_tokens",), Frames.EVENTS,
    RESPONSES_USAGE, batchable=True, sim="responses", session_field="conversation")
TOKENIZE = Endpoint(
    "/tokenize", "POST", "tokenize", Kind.FORWARDED,
    "vLLM's tokenizer (any API key; cheap, so not queued)",
    "TokenizeRequest", sim="tokenize")
DETOKENIZE = Endpoint(
    "/detokenize", "POST", "detokenize", Kind.FORWARDED,
    "vLLM's detokenizer (any API key; cheap, so not queued)",
    "DetokenizeRequest", sim="detokenize")
# vLLM's pooling scorers (a cross-encoder's pairs; no output tokens, never streamed): the
# rerank API at each path vLLM serves it, the score API at both of its paths
_RERANK = ("Rerank documents against a query (vLLM's pooling API), queued fairly in the "
           "key's class (cost = input tokens: the query once per document)")
_SCORE = ("Score pairs of texts (vLLM's pooling API), queued fairly in the key's class "
          "(cost = input tokens: each pair's)")
RERANKS = tuple(
    Endpoint(path, "POST", op, Kind.QUEUED, _RERANK, "RerankRequest", "RerankResponse",
             "query", batchable=True, sim="rerank")
    for path, op in (("/v1/rerank", "createRerank"), ("/rerank", "rerank"),
                     ("/v2/rerank", "createRerankV2")))
SCORES = tuple(
    Endpoint(path, "POST", op, Kind.QUEUED, _SCORE, "ScoreRequest", "ScoreResponse",
             "text_1", batchable=True, sim="score")
    for path, op in (("/v1/score", "createScore"), ("/score", "score")))
LIST_MODELS = Endpoint("/v1/models", "GET", "listModels", Kind.LOCAL, sim="models")
RETRIEVE_MODEL = Endpoint("/v1/models/{model}", "GET", "retrieveModel", Kind.LOCAL)
# the Files and Batches API (gateway/http/batch_routes.py)
FILES = (
    Endpoint("/v1/files", "POST", "createFile", Kind.LOCAL),
    Endpoint("/v1/files", "GET", "listFiles", Kind.LOCAL),
    Endpoint("/v1/files/{file_id}", "GET", "retrieveFile", Kind.LOCAL),
    Endpoint("/v1/files/{file_id}", "DELETE", "deleteFile", Kind.LOCAL),
    Endpoint("/v1/files/{file_id}/content", "GET", "downloadFile", Kind.LOCAL),
)
BATCHES = (
    Endpoint("/v1/batches", "POST", "createBatch", Kind.LOCAL),
    Endpoint("/v1/batches", "GET", "listBatches", Kind.LOCAL),
    Endpoint("/v1/batches/{batch_id}", "GET", "retrieveBatch", Kind.LOCAL),
    Endpoint("/v1/batches/{batch_id}/cancel", "POST", "cancelBatch", Kind.LOCAL),
)

ENDPOINTS: tuple[Endpoint, ...] = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, *RERANKS,
                                   *SCORES, TOKENIZE, DETOKENIZE, LIST_MODELS,
                                   RETRIEVE_MODEL, *FILES, *BATCHES)
# the endpoints whose body fairgate reads (queued or forwarded), by path
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS if e.kind is not Kind.LOCAL}
BATCHABLE: tuple[str, ...] = tuple(e.path for e in ENDPOINTS if e.batchable)
