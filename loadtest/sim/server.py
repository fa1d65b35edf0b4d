"""``SimServer``: vLLM's OpenAI-compatible HTTP surface over a ``SimEngine`` (aiohttp).

Routes: every entry of fairgate's endpoint table (``gateway/proxy/endpoints.py``) that names a
simulator behaviour, served by that behaviour — ``GET /v1/models``, ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (JSON or SSE),
``POST /v1/embeddings`` (prefill-only engine requests, ``loadtest/sim/embeddings.py``),
``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``, ``/score`` and ``/v1/score`` (a prefill-only
engine request per pair, ``loadtest/sim/scoring.py``),
``POST /tokenize``, ``POST /detokenize`` (``loadtest/sim/tokenizer.py``, no engine) —
and vLLM's own ``GET /health``, ``GET /metrics``, with LoRA and
``allow_runtime_lora_updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) ``POST
/v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (``loadtest/sim/lora.py``),
``GET /debug/requests``, ``GET /debug/state``, ``GET /debug/steps``. Handlers are
cancelled when the client disconnects, and the request is then aborted in the engine
(its KV blocks freed).

What goes on the wire, and when, follows vLLM 0.32 (``loadtest/sim/conformance.py``
checks it against recordings of a real server): a stream's status and headers go out when
the request is accepted, its first frame (for chat, the role frame followed by the first
token) only when the engine produced the first token; errors are ``{"error": {...}}``
with ``application/json``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.proxy.endpoints import ENDPOINTS
from loadtest.sim import scoring, tokenizer
from loadtest.sim.embeddings import DEFAULT_DIMENSIONS, embedding_body, parse_embedding
from loadtest.sim.engine import EngineConfig, SimEngine
from loadtest.sim.lora import LoraRegistry
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.protocol import (
    PRIORITY_HEADER,
    SimError,
    SimRequest,
    body_error,
    parse_json,
    parse_request,
    validation_error,
)
from loadtest.sim.records import RequestStream
from loadtest.sim.responses import StreamFramer, full_body
from loadtest.sim.responses_api import ResponseBuilder, parse_responses
from loadtest.sim.scoring import parse_rerank, parse_score

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SHUTDOWN_TIMEOUT_S = 2.0
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def json_response(data: Any, status: int = 200) -> web.Response:
    """JSON as vLLM (Starlette's JSONResponse) sends it: ``application/json``, compact."""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return web.Response(body=body, status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ``SimError`` into vLLM's JSON error response."""
    try:
        return await handler(request)
    except SimError as exc:
        return json_response(exc.body(), status=exc.status)


class SimServer:
    """A simulated vLLM server; ``port=0`` picks a free port (see ``url`` after start)."""

    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        reject_priority: bool = False,
        embedding_dimensions: int = DEFAULT_DIMENSIONS,
        allow_runtime_lora_updating: bool = False,
        metrics_only: frozenset[str] | None = None,
        fail_on: str | None = None,
    ) -> None:
        self.config = config
        # a request whose body holds this text is answered 500, as vLLM answers one its
        # tokenizer or engine fails on (the request's fault, not the server's)
        self.fail_on = fail_on
        self.failed = 0  # requests answered 500 for it
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.loras = LoraRegistry(config.model, config.lora_modules, config.lora_load_s)
        self.host = host
        self.port = port
        self.reject_priority = reject_priority
        self.embedding_dimensions = embedding_dimensions
        self.metrics = SimMetrics(
            config.model, config.model_len, CollectorRegistry(),
            max_lora=config.max_loras if config.enable_lora else None, only=metrics_only,
        )  # fmt: skip
        self._engine = SimEngine(config, observer=self.metrics)
        self._runner: web.AppRunner | None = None
        self.scrapes = 0  # GET /metrics answered (how often the gateways scrape it)
        # while set and not yet fired, GET /metrics waits for it: a real vLLM's API server
        # answers /metrics late while its engine is busy (seconds on 2 CPU cores)
        self.metrics_hold: asyncio.Event | None = None
        self.scrapes_held = 0  # GET /metrics that waited on ``metrics_hold``

    @property
    def engine(self) -> SimEngine:
        """The engine behind the HTTP surface."""
        return self._engine

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8100`` (no ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    def make_app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[error_middleware])
        for endpoint in ENDPOINTS:
            if endpoint.sim is not None:
                app.router.add_route(endpoint.method, endpoint.path,
                                     self.behaviours()[endpoint.sim])
        if self.config.enable_lora and self.allow_runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self._load_lora)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug/requests", self._debug_requests)
        app.router.add_get("/debug/state", self._debug_state)
        app.router.add_get("/debug/steps", self._debug_steps)
        return app

    def behaviours(self) -> dict[str, Handler]:
        """What the simulator does for an endpoint, by the name its table entry gives."""
        return {"models": self._models, "completion": self._completions, "chat": self._chat,
                "responses": self._responses, "embeddings": self._embeddings,
                "tokenize": self._tokenize, "detokenize": self._detokenize,
                "rerank": self._rerank, "score": self._score}

    async def start(self) -> None:
        """Start the engine loop and listen."""
        self._engine.start()
        self._runner = web.AppRunner(
            self.make_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Abort everything in flight, stop the engine and close the listener."""
        await self._engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        permission = {
            "id": "modelperm-" + uuid.uuid4().hex[:16],
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": self.config.model,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.model_len,
            "permission": [permission],
        }
        cards = [card, *self.loras.cards(now, permission)]
        return json_response({"object": "list", "data": cards})

    async def _load_lora(self, request: web.Request) -> web.Response:
        return web.Response(text=await self.loras.load(parse_json(await request.read())))

    async def _unload_lora(self, request: web.Request) -> web.Response:
        return web.Response(text=await self.loras.unload(parse_json(await request.read())))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_hold is not None:
            self.scrapes_held += 1
            await self.metrics_hold.wait()
        self.scrapes += 1
        body = self.metrics.render(self._engine)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _debug_requests(self, request: web.Request) -> web.Response:
        records = [r.to_json() for r in self._engine.records.values()]
        return web.json_response(records)

    async def _debug_state(self, request: web.Request) -> web.Response:
        engine = self._engine
        return web.json_response(
            {
                "num_waiting": engine.num_waiting,
                "num_running": engine.num_running,
                "kv_usage": engine.kv_usage,
                "prefix_cache_queries": engine.prefix_cache_queries,
                "prefix_cache_hits": engine.prefix_cache_hits,
                "scrapes": self.scrapes,
                "lora_loads": self.loras.loads,
                "lora_unloads": self.loras.unloads,
            }
        )

    async def _debug_steps(self, request: web.Request) -> web.Response:
        return web.json_response(self._engine.step_stats().to_json())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON body, its ``model`` (if given) the one served here or a loaded adapter."""
        raw = await request.read()
        if self.fail_on is not None and self.fail_on.encode() in raw:
            self.failed += 1
            raise SimError(500, "Internal Server Error")
        body = parse_json(raw)
        model = body.get("model")
        if model and model != self.config.model and model not in self.loras:
            raise SimError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                param="model",
            )
        return body

    def _check_priority(self, priority: int) -> None:
        if self.reject_priority and priority != 0:
            raise SimError(
                400, "Priority scheduling is not enabled on this server.", param="priority"
            )

    def _lora(self, body: dict[str, Any]) -> str | None:
        """The adapter a checked body names (None: the base model)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.loras else None

    def _add(
        self, request_id: str, req: SimRequest, lora: str | None, remote_tokens: int = 0
    ) -> RequestStream:
        try:
            return self._engine.add_request(
                request_id,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.max_tokens,
                output_tokens=req.output_tokens,
                priority=req.priority,
                prompt_ids=req.prompt_ids() if self.config.enable_prefix_caching else None,
                lora=lora,
                remote_tokens=remote_tokens,
            )
        except ValueError as exc:
            raise SimError(400, str(exc)) from exc

    def _cached(self, stream: RequestStream) -> int | None:
        """The prompt tokens found in the prefix cache, when usage reports them."""
        return stream.record.cached_tokens if self.config.enable_prompt_tokens_details else None

    async def _collect(self, req: SimRequest, stream: RequestStream) -> tuple[list[int], list[str]]:
        """Token counts and finish reasons per choice of a request answered whole."""
        counts = [0] * req.n
        reasons = ["stop"] * req.n
        while batch := await stream.next_batch():
            for token in batch:
                counts[token.choice] += 1
                if token.finish_reason is not None:
                    reasons[token.choice] = token.finish_reason
        if stream.aborted:
            raise SimError(500, "The request was aborted: the engine is shutting down.")
        return counts, reasons

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        lora = self._lora(body)
        model = lora or self.config.model  # vLLM answers with the adapter's name
        req = parse_request(
            body,
            chat=chat,
            headers_priority=request.headers.get(PRIORITY_HEADER),
            model_len=self.config.model_len,
            seed=self.config.seed,
        )
        self._check_priority(req.priority)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        remote = 0
        if (kv := self.config.kv_transfer).pulls(body):
            await asyncio.sleep(kv.transfer_s(req.prompt_tokens))  # waiting for remote KV
            remote = req.prompt_tokens - 1
        stream = self._add(request_id, req, lora, remote)
        try:
            if req.stream:
                return await self._stream(request, req, request_id, stream, model)
            counts, reasons = await self._collect(req, stream)
            answer = full_body(req, request_id, model, counts, reasons, self._cached(stream))
            if kv.serves_remote_decode(body):
                answer["kv_transfer_params"] = kv.answer_params(
                    request_id, self.host, req.prompt_tokens, self.config.block_size
                )
            return json_response(answer)
        finally:
            if not stream.finished:
                self._engine.abort_stream(stream)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        req = parse_responses(
            body,
            headers_priority=request.headers.get(PRIORITY_HEADER),
            model_len=self.config.model_len,
            seed=self.config.seed,
        )
        self._check_priority(req.priority)
        given = body.get("request_id")
        response_id = given if isinstance(given, str) and given else "resp_" + uuid.uuid4().hex
        lora = self._lora(body)
        builder = ResponseBuilder(req, body, response_id, lora or self.config.model)
        stream = self._add(response_id, req, lora)
        try:
            if req.stream:
                return await self._responses_stream(request, builder, stream)
            counts, reasons = await self._collect(req, stream)
            return json_response(builder.final(counts[0], reasons[0]))
        finally:
            if not stream.finished:
                self._engine.abort_stream(stream)

    async def _responses_stream(
        self, request: web.Request, builder: ResponseBuilder, stream: RequestStream
    ) -> web.StreamResponse:
        # vLLM yields response.created and response.in_progress before it awaits the
        # engine: they go out at accept, the message item with the first output.
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await response.prepare(request)
        finish_reason = "stop"
        try:
            await response.write(builder.opening())
            first = True
            while batch := await stream.next_batch():
                frames = [builder.first_output()] if first else []
                first = False
                frames += [builder.token(t) for t in batch]
                finish_reason = batch[-1].finish_reason or finish_reason
                await response.write(b"".join(frames))
            if not stream.aborted:
                await response.write(builder.closing(finish_reason))
            await response.write_eof()
        except ConnectionError:
            self._engine.abort_stream(stream)
        return response

    async def _embeddings(self, request: web.Request) -> web.Response:
        req = parse_embedding(
            await self._body(request),
            headers_priority=request.headers.get(PRIORITY_HEADER),
            model_len=self.config.model_len,
            dimensions=self.embedding_dimensions,
        )
        self._check_priority(req.priority)
        request_id = "embd-" + uuid.uuid4().hex
        await self._pool(request_id, [len(ids) for ids in req.prompts], req.priority)
        return json_response(
            embedding_body(req, request_id, self.config.model, self.config.seed)
        )

    async def _rerank(self, request: web.Request) -> web.Response:
        req = parse_rerank(await self._body(request),
                           headers_priority=request.headers.get(PRIORITY_HEADER),
                           model_len=self.config.model_len)
        self._check_priority(req.priority)
        rid = scoring.request_id()
        await self._pool(rid, [p.tokens for p in req.pairs], req.priority)
        return json_response(scoring.rerank_body(req, rid, self.config.model,
                                                 self.config.seed))

    async def _score(self, request: web.Request) -> web.Response:
        req = parse_score(await self._body(request),
                          headers_priority=request.headers.get(PRIORITY_HEADER),
                          model_len=self.config.model_len)
        self._check_priority(req.priority)
        rid = scoring.request_id()
        await self._pool(rid, [p.tokens for p in req.pairs], req.priority)
        return json_response(scoring.score_body(req, rid, self.config.model,
                                                self.config.seed))

    async def _pool(self, request_id: str, prompts: list[int], priority: int) -> None:
        """Run one pooling engine request (prefill only) per prompt of ``prompts`` tokens
        and wait for all of them; each is aborted if the handler is cancelled."""
        streams: list[RequestStream] = []
        try:
            for i, tokens in enumerate(prompts):
                try:
                    streams.append(self._engine.add_request(
                        f"{request_id}-{i}", prompt_tokens=tokens, max_tokens=1,
                        priority=priority, pooling=True,
                    ))  # fmt: skip
                except ValueError as exc:
                    raise SimError(400, str(exc)) from exc
            for stream in streams:
                while await stream.next_batch():
                    pass
            if any(s.aborted for s in streams):
                raise SimError(500, "The request was aborted: the engine is shutting down.")
        finally:
            for stream in streams:
                if not stream.finished:
                    self._engine.abort_stream(stream)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise body_error("messages", "list_type", "Input should be a valid list", messages)
            add_prompt = body.get("add_generation_prompt")
            tokens = tokenizer.encode_chat(messages, add_prompt is None or bool(add_prompt))
        elif isinstance(body.get("prompt"), str):
            tokens = tokenizer.encode(body["prompt"])
        else:
            raise body_error("prompt", "string_type", "Input should be a valid string",
                             body.get("prompt"))  # fmt: skip
        strs = [tokenizer.token_str(t) for t in tokens] if body.get("return_token_strs") else None
        return json_response({
            "count": len(tokens), "max_model_len": self.config.model_len, "tokens": tokens,
            "token_strs": strs,
        })  # fmt: skip

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise body_error("tokens", "list_type", "Input should be a valid list of integers",
                             tokens)  # fmt: skip
        try:
            text = tokenizer.decode(tokens)
        except ValueError as exc:
            raise validation_error("tokens", str(exc)) from exc
        return json_response({"prompt": text})

    async def _stream(
        self, request: web.Request, req: SimRequest, request_id: str, stream: RequestStream,
        model: str,
    ) -> web.StreamResponse:
        # Like vLLM (a Starlette StreamingResponse): status and headers go out at once,
        # the first frame only when the engine returns the request's first output.
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await response.prepare(request)
        framer = StreamFramer(req, request_id, model)
        first = True
        try:
            while batch := await stream.next_batch():
                frames = [framer.token(t) for t in batch]
                if first:
                    # The chat role frame goes out with the first output, not at accept.
                    frames.insert(0, framer.opening())
                    first = False
                await response.write(b"".join(frames))
            if not stream.aborted:
                await response.write(framer.closing(self._cached(stream)))
            await response.write_eof()
        except ConnectionError:
            self._engine.abort_stream(stream)
        return response
