"""Every method of the official ``openai`` SDK's ``models``, ``chat.completions``,
``completions``, ``embeddings``, ``responses``, ``files`` and ``batches`` resources that
fairgate claims, called once through the gateway to the simulator.

Claimed (``CLAIMED``): ``models.list/retrieve``; ``chat.completions.create/stream/parse``;
``completions.create``; ``embeddings.create``; ``responses.create/stream/parse``; every
method of ``files`` (``create``, ``list``, ``retrieve``, ``content``, ``retrieve_content``,
``wait_for_processing``, ``delete``) and of ``batches`` (``create``, ``list``,
``retrieve``, ``cancel``).

Not claimed (``UNCLAIMED``; OpenAI's hosted state that vLLM does not keep, each answered
with an OpenAI-format 404 or 405): ``models.delete`` (fine-tuned models);
``chat.completions.retrieve/update/list/delete`` and ``chat.completions.messages``
(stored completions, ``store: true``); ``responses.retrieve/delete/cancel/compact`` and
``responses.input_items`` (stored and background responses), ``responses.input_tokens``
(token counting: ``POST /tokenize`` serves it), ``responses.connect`` (the Realtime
WebSocket). ``docs/openai-surface.md`` lists the same.

A method the SDK adds later is in neither set: ``test_every_sdk_method_is_classified``
fails and names it.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.http.server import GatewayServer
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

RESOURCES = ("models", "chat.completions", "completions", "embeddings", "responses",
             "files", "batches")
CLAIMED: dict[str, set[str]] = {
    "models": {"list", "retrieve"},
    "chat.completions": {"create", "stream", "parse"},
    "completions": {"create"},
    "embeddings": {"create"},
    "responses": {"create", "stream", "parse"},
    "files": {"create", "list", "retrieve", "content", "retrieve_content",
              "wait_for_processing", "delete"},
    "batches": {"create", "list", "retrieve", "cancel"},
}
UNCLAIMED: dict[str, set[str]] = {
    "models": {"delete"},
    "chat.completions": {"retrieve", "update", "list", "delete", "messages"},
    "completions": set(),
    "embeddings": set(),
    "responses": {"retrieve", "delete", "cancel", "compact", "input_items", "input_tokens",
                  "connect"},
    "files": set(),
    "batches": set(),
}
HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def resource(client: openai.AsyncOpenAI, name: str) -> Any:
    return functools.reduce(getattr, name.split("."), client)


def sdk_methods(client: openai.AsyncOpenAI, name: str) -> set[str]:
    """The resource's public methods and sub-resources (not its raw/streaming views)."""
    kind = type(resource(client, name))
    return {m for m in dir(kind) if not m.startswith("_") and not m.startswith("with_")
            and (callable(getattr(kind, m)) or
                 isinstance(getattr(kind, m), functools.cached_property))}


class Walk:
    """The SDK client, recording every claimed method called through :meth:`on`."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self.client = client
        self.called: set[tuple[str, str]] = set()

    def on(self, name: str, method: str) -> Any:
        self.called.add((name, method))
        return getattr(resource(self.client, name), method)


def test_every_sdk_method_is_classified() -> None:
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    for name in RESOURCES:
        assert CLAIMED[name].isdisjoint(UNCLAIMED[name]), name
        methods = sdk_methods(client, name)
        assert methods == CLAIMED[name] | UNCLAIMED[name], (
            f"{name}: the SDK has {sorted(methods)}; unclassified "
            f"{sorted(methods - CLAIMED[name] - UNCLAIMED[name])}, gone "
            f"{sorted(CLAIMED[name] | UNCLAIMED[name] - methods)}")


@pytest.fixture
async def walk(sim: SimFactory, gateway: GatewayFactory,
               tmp_path: Path) -> AsyncIterator[tuple[Walk, GatewayServer]]:
    backend = await sim(max_num_seqs=2)  # slow enough that a long batch can be cancelled
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                       batch_max_in_flight=2)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-batch",
                                  max_retries=0) as client:
        yield Walk(client), gw


async def walk_models(w: Walk) -> None:
    listed = [m.id async for m in w.on("models", "list")()]
    assert listed == [MODEL], listed
    model = await w.on("models", "retrieve")(MODEL)
    assert (model.id, model.object) == (MODEL, "model"), model
    with pytest.raises(openai.NotFoundError) as missing:
        await w.on("models", "retrieve")("gpt-9")
    assert missing.value.code == "model_not_found", missing.value.body


async def walk_chat(w: Walk) -> None:
    extra = {"ignore_eos": True}
    chat = await w.on("chat.completions", "create")(model=MODEL, messages=HI, max_tokens=4,
                                                     extra_body=extra)
    assert chat.usage.completion_tokens == 4, chat.usage
    assert chat.choices[0].message.content, chat
    stream = await w.on("chat.completions", "create")(
        model=MODEL, messages=HI, max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 3, chunks[-1]
    # stream and parse refuse an answer cut at max_tokens: the simulator's draw (16-512
    # tokens) ends first
    async with w.on("chat.completions", "stream")(model=MODEL, messages=HI,
                                                  max_tokens=600) as events:
        deltas = [e.delta async for e in events if e.type == "content.delta"]
        final = await events.get_final_completion()
    assert final.choices[0].finish_reason == "stop", final
    assert 16 <= len(deltas) <= 512 and final.choices[0].message.content == "".join(deltas), \
        (deltas, final)
    # parse without a response_format: the plain answer (a structured one needs the
    # backend's guided decoding: fairgate passes response_format through untouched)
    parsed = await w.on("chat.completions", "parse")(model=MODEL, messages=HI, max_tokens=600)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and choice.message.parsed is None, parsed
    assert parsed.usage.completion_tokens == len(choice.message.content.split()), parsed


async def walk_completions_and_embeddings(w: Walk) -> None:
    comp = await w.on("completions", "create")(model=MODEL, prompt="hello", max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 3 and comp.choices[0].text, comp
    streamed = await w.on("completions", "create")(model=MODEL, prompt="hello", max_tokens=2,
                                                   stream=True, extra_body={"ignore_eos": True})
    texts = [c.choices[0].text async for c in streamed if c.choices]
    assert len(texts) == 2, texts
    emb = await w.on("embeddings", "create")(model=MODEL, input=["a" * 40, "b"])
    assert [len(d.embedding) for d in emb.data] == [384, 384], emb.usage
    assert emb.usage.prompt_tokens == 11, emb.usage


async def walk_responses(w: Walk) -> None:
    whole = await w.on("responses", "create")(model=MODEL, input="hello",
                                              max_output_tokens=4)
    assert whole.usage.output_tokens == 4 and whole.output_text, whole
    async with w.on("responses", "stream")(model=MODEL, input="hello",
                                           max_output_tokens=3) as events:
        kinds = [e.type async for e in events]
        final = await events.get_final_response()
    assert kinds.count("response.output_text.delta") == 3, kinds
    assert final.usage is not None and final.usage.output_tokens == 3, final
    parsed = await w.on("responses", "parse")(model=MODEL, input="hello",
                                              max_output_tokens=2)
    assert parsed.output_parsed is None and parsed.usage.output_tokens == 2, parsed


def batch_file(n: int, max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "messages": HI, "max_tokens": max_tokens, "ignore_eos": True}}) + "\n"
        for i in range(n)).encode()


async def walk_files_and_batches(w: Walk) -> None:
    data = batch_file(3, 2)
    f = await w.on("files", "create")(file=("in.jsonl", data), purpose="batch")
    ready = await w.on("files", "wait_for_processing")(f.id, poll_interval=0.05)
    assert ready.status == "processed", ready
    assert (await w.on("files", "retrieve")(f.id)).bytes == len(data)
    assert (await w.on("files", "content")(f.id)).content == data
    with pytest.warns(DeprecationWarning):  # the SDK's older name for content()
        assert (await w.on("files", "retrieve_content")(f.id)).encode() == data
    batch = await w.on("batches", "create")(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
    for _ in range(1200):  # bounded: 60 s of polling, as an SDK user polls
        batch = await w.on("batches", "retrieve")(batch.id)
        if batch.status in {"completed", "failed", "expired", "cancelled"}:
            break
        await asyncio.sleep(0.05)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    out = (await w.on("files", "content")(batch.output_file_id)).text.splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == ["r0", "r1", "r2"], out

    long = await w.on("files", "create")(file=("long.jsonl", batch_file(40, 300)),
                                         purpose="batch")
    slow = await w.on("batches", "create")(input_file_id=long.id, endpoint=CHAT,
                                           completion_window="24h")
    cancelled = await w.on("batches", "cancel")(slow.id)
    assert cancelled.status in {"cancelling", "cancelled"}, cancelled
    listed = [b.id async for b in w.on("batches", "list")(limit=1)]
    assert listed == [slow.id, batch.id], listed
    files = {x.id for x in (await w.on("files", "list")()).data}
    assert {f.id, long.id, batch.output_file_id} <= files, files
    deleted = await w.on("files", "delete")(f.id)
    assert deleted.deleted, deleted


async def test_every_claimed_method_works(walk: tuple[Walk, GatewayServer]) -> None:
    w, _ = walk
    await walk_models(w)
    await walk_chat(w)
    await walk_completions_and_embeddings(w)
    await walk_responses(w)
    await walk_files_and_batches(w)
    called = {name: {m for n, m in w.called if n == name} for name in RESOURCES}
    assert called == CLAIMED, called


UNCLAIMED_CALLS: list[tuple[str, str, dict[str, Any]]] = [
    ("models", "delete", {"model": MODEL}),
    ("chat.completions", "retrieve", {"completion_id": "chatcmpl-1"}),
    ("chat.completions", "update", {"completion_id": "chatcmpl-1", "metadata": {}}),
    ("chat.completions", "list", {}),
    ("chat.completions", "delete", {"completion_id": "chatcmpl-1"}),
    ("responses", "retrieve", {"response_id": "resp_1"}),
    ("responses", "delete", {"response_id": "resp_1"}),
    ("responses", "cancel", {"response_id": "resp_1"}),
]


@pytest.mark.parametrize(("name", "method", "kwargs"), UNCLAIMED_CALLS,
                         ids=[f"{n}.{m}" for n, m, _ in UNCLAIMED_CALLS])
async def test_an_unclaimed_method_gets_an_openai_error(
        walk: tuple[Walk, GatewayServer], name: str, method: str,
        kwargs: dict[str, Any]) -> None:
    w, _ = walk
    call = getattr(resource(w.client, name), method)(**kwargs)
    if hasattr(call, "__aiter__"):  # a paginated list: its first page is the request
        call = call.__aiter__().__anext__()
    with pytest.raises(openai.APIStatusError) as caught:
        await call
    error = caught.value
    assert error.status_code in {404, 405}, (error.status_code, error.body)
    assert isinstance(error.body, dict) and error.body.get("message"), error.body
