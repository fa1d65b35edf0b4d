"""Hostile but well-formed completion bodies (issue 10, items 2, 3 and 10): each is a 400
in OpenAI's format before it reaches the queue, Redis keys, metrics labels or vLLM.

- content lists nested hundreds deep (item 2) — never a 500, whatever the depth;
- end-user ids (``user``) of 1 MB, with control characters, or not a string (item 3);
  metrics labels stay short whatever a client names its end users;
- ``max_tokens`` of 10^12 (item 10): capped by the ``max_output_tokens`` setting.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from structlog.testing import capture_logs

from gateway.core.user_series import MAX_LABEL_CHARS, OTHER_USERS, UserLabels
from gateway.http.server import GatewayServer
from tests.gateway.conftest import (
    CHAT,
    HI,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    auth,
    call,
    store_is_idle,
    until,
)
from tests.ops.conftest import samples

COMPLETIONS = "/v1/completions"


def nested_content(depth: int) -> bytes:
    """A chat body whose message content is a list nested ``depth`` deep (the body object
    is level 1, ``messages`` 2, the message 3, the content's lists 4 to ``depth + 3``, its
    text part ``depth + 4``). Built as text: ``json`` cannot encode it."""
    content = "[" * (depth - 1) + '[{"type": "text", "text": "hi"}]' + "]" * (depth - 1)
    head = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "@"}]})
    return head.replace('"@"', content).encode()


async def raw_post(gw: GatewayServer, path: str, data: bytes, key: str = "sk-alice"
                   ) -> tuple[int, dict[str, Any]]:
    headers = {**auth(key), "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http, http.post(gw.url + path, data=data,
                                                          headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def sdk(gw: GatewayServer, key: str = "sk-app") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
async def gw(sim: SimFactory, gateway: GatewayFactory) -> GatewayServer:
    return await gateway([await sim(profile="instant")])


def dispatched(gw: GatewayServer) -> float:
    return sum(s.value for metric in gw.services.metrics.registry.collect()
               if metric.name == "fairgate_dispatches" for s in metric.samples
               if s.name == "fairgate_dispatches_total")


# --------------------------------------------------------------------------- item 2


@pytest.mark.parametrize("depth", [62, 100, 900, 930, 950, 970, 990, 5000])
async def test_deeply_nested_content_is_a_400(gw: GatewayServer, depth: int) -> None:
    status, got = await raw_post(gw, CHAT, nested_content(depth))
    assert status == 400, got
    message = assert_error(got, type_="invalid_request_error",
                           param=got["error"]["param"])
    assert got["error"]["param"] in ("messages", None), got
    assert "nested too deeply" in message
    assert dispatched(gw) == 0  # refused before the queue
    await store_is_idle(gw)


async def test_nesting_within_the_limit_is_served(gw: GatewayServer) -> None:
    status, got = await raw_post(gw, CHAT, nested_content(1))
    assert status == 200, got
    deep_prompt = ("[" * 50 + '"p"' + "]" * 50).encode()
    status, got = await raw_post(gw, COMPLETIONS, b'{"model": "%s", "max_tokens": 2, '
                                 b'"prompt": %s}' % (MODEL.encode(), deep_prompt))
    assert status != 500, got  # the backend judges the odd prompt, not a crash
    await store_is_idle(gw)


async def test_deep_prompt_names_its_field(gw: GatewayServer) -> None:
    deep = ("[" * 500 + "1" + "]" * 500).encode()
    status, got = await raw_post(gw, COMPLETIONS, b'{"model": "%s", "prompt": %s}'
                                 % (MODEL.encode(), deep))
    assert status == 400, got
    assert "64 levels" in assert_error(got, type_="invalid_request_error", param="prompt")


async def test_depth_limit_is_a_setting(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")], max_json_depth=6)
    status, got = await raw_post(gw, CHAT, nested_content(2))  # text part at level 6
    assert status == 200, got
    status, got = await raw_post(gw, CHAT, nested_content(3))
    assert status == 400, got
    assert "6 levels" in assert_error(got, type_="invalid_request_error", param="messages")
    await store_is_idle(gw)


# --------------------------------------------------------------------------- item 3


@pytest.mark.parametrize(("user", "needle"), [
    ("x" * 1_000_000, "at most 256 characters"),
    ("x" * 257, "at most 256 characters"),
    ("line\nbreak", "printable"),
    ("nul\x00byte", "printable"),
    ("\x1b[31mred", "printable"),
    ("zero\u200bwidth", "printable"),
])
async def test_end_user_ids_are_bounded(gw: GatewayServer, user: str, needle: str) -> None:
    for key in ("sk-app", "sk-alice"):  # trusted (fairness per end user) or not
        client = sdk(gw, key)
        try:
            with pytest.raises(openai.BadRequestError) as exc:
                await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                     user=user)
        finally:
            await client.close()
        assert exc.value.status_code == 400 and exc.value.param == "user"
        assert needle in exc.value.message
    assert dispatched(gw) == 0
    keys = [k async for k in gw.services.store.client.scan_iter("*")]
    assert not [k for k in keys if "xxxxxxxx" in k or "\n" in k or "\x00" in k], keys
    await store_is_idle(gw)


@pytest.mark.parametrize("raw", [b'"\\ud800"', b"5", b'{"id": "u1"}', b'["u1"]'])
async def test_end_user_must_be_text(gw: GatewayServer, raw: bytes) -> None:
    body = b'{"model": "%s", "max_tokens": 2, "messages": %s, "user": %s}' % (
        MODEL.encode(), json.dumps(HI).encode(), raw)
    status, got = await raw_post(gw, CHAT, body, key="sk-app")
    assert status == 400, got
    assert_error(got, type_="invalid_request_error", param="user")
    await store_is_idle(gw)


async def test_valid_end_users_are_served(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")], max_end_user_chars=12)
    client = sdk(gw)
    try:
        for user in ("u" * 12, "Zoë 日本 ü", "a/b@c.d"):
            reply = await client.chat.completions.create(model=MODEL, messages=HI,
                                                         max_tokens=2, user=user)
            assert reply.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                 user="u" * 13)
        assert exc.value.param == "user" and "at most 12 characters" in exc.value.message
    finally:
        await client.close()
    await store_is_idle(gw)


def test_label_values_are_short_and_distinct() -> None:
    labels = UserLabels(top_n=10, idle_s=60.0)
    a, b = "app/" + "a" * 5000, "app/" + "a" * 4999 + "b"
    la, _ = labels.label(a, 0.0)
    lb, _ = labels.label(b, 0.0)
    assert len(la) <= MAX_LABEL_CHARS and len(lb) <= MAX_LABEL_CHARS
    assert la != lb and la.startswith("app/aaaa")
    assert labels.label(a, 1.0) == (la, [])  # stable: the same user, the same series
    assert labels.label("app/short", 1.0)[0] == "app/short"


async def test_metrics_stay_bounded_whatever_users_are_called(sim: SimFactory,
                                                              gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")], max_end_user_chars=4000,
                       metrics_top_users=3)
    client = sdk(gw)
    try:
        for i in range(8):
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                 user=f"{i}" + "u" * 3999)
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    users = {dict(labels)["user"] for (_, labels) in samples(text) if "user" in dict(labels)}
    assert OTHER_USERS in users and len(users) == 4, users
    assert all(len(u) <= MAX_LABEL_CHARS for u in users), [len(u) for u in users]
    assert len(text) < 200_000
    await store_is_idle(gw)


# --------------------------------------------------------------------------- item 10


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_absurd_max_tokens_is_a_400(gw: GatewayServer, field: str) -> None:
    client = sdk(gw, "sk-alice")
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI,
                                                 **{field: 10**12})  # type: ignore[call-overload]
    finally:
        await client.close()
    assert exc.value.param == field and exc.value.type == "invalid_request_error"
    assert "at most 131072" in exc.value.message
    assert dispatched(gw) == 0
    await store_is_idle(gw)


async def test_output_token_cap_is_a_setting(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")], max_output_tokens=40)
    client = sdk(gw, "sk-alice")
    try:
        reply = await client.completions.create(model=MODEL, prompt="p", max_tokens=40,
                                                extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 40
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model=MODEL, prompt="p", max_tokens=41)
        assert exc.value.param == "max_tokens" and "at most 40" in exc.value.message
    finally:
        await client.close()
    await store_is_idle(gw)


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/chat/completions", "max_tokens"), ("/v1/completions", "max_tokens"),
    ("/v1/responses", "max_output_tokens")])
async def test_output_beyond_the_models_context_is_refused_before_the_queue(
        sim: SimFactory, gateway: GatewayFactory, path: str, field: str) -> None:
    backend = await sim(profile="instant", max_model_len=1024)
    gw = await gateway([backend])
    handle = gw.services.pool.handles["b0"]
    await until(lambda: handle.card.read, "the model card read")
    assert gw.services.pool.max_model_len(MODEL) == 1024
    body: dict[str, object] = {"model": MODEL, field: 1025}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["input"] = "hi"
    async with aiohttp.ClientSession() as http:
        status, data, _ = await call(http, "POST", gw.url + path, json=body)
        assert status == 400 and data["error"]["param"] == field, data
        assert "context length (1024 tokens)" in data["error"]["message"]
        body[field] = 1024  # at the limit: accepted and served
        status, data, _ = await call(http, "POST", gw.url + path, json=body)
        assert status == 200, data
    assert len(backend.engine.records) == 1  # the refused one never reached the backend


LONE = {  # a lone surrogate escape, where a client may put one (raw JSON: json.dumps escapes)
    "messages[0].content": (CHAT, b'{"model": "%s", "max_tokens": 2, "messages": '
                                  b'[{"role": "user", "content": "hi \\ud800"}]}'),
    "prompt[1]": (COMPLETIONS, b'{"model": "%s", "max_tokens": 2, "prompt": ["a", "\\udfff b"]}'),
    "messages[0].content[0].text": (CHAT, b'{"model": "%s", "max_tokens": 2, "messages": '
                                          b'[{"role": "user", "content": [{"type": "text", '
                                          b'"text": "\\ud83d"}]}]}'),
    "/tokenize prompt": ("/tokenize", b'{"model": "%s", "prompt": "\\udbff"}'),
}


@pytest.mark.parametrize("where", list(LONE))
async def test_a_lone_surrogate_is_a_400_naming_the_field(
        where: str, sim: SimFactory, gateway: GatewayFactory) -> None:
    """vLLM answers a lone surrogate 500 (its tokenizer cannot encode it), and each such
    request went round every backend: refused where the body is read, naming the field."""
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    path, template = LONE[where]
    status, body = await raw_post(gw, path, template % MODEL.encode())
    assert status == 400, f"{where}: {status} {body}"
    message = assert_error(body, type_="invalid_request_error",
                           param=where.split()[-1].split("[")[0])
    assert "lone surrogate" in message and where.split()[-1] in message, message
    assert backend.engine.records == {}, "the request reached the backend"
    status, _ = await raw_post(gw, CHAT, (b'{"model": "%s", "max_tokens": 2, "messages": '
                                          b'[{"role": "user", "content": "\\ud83d\\ude00"}]}')
                               % MODEL.encode())  # a whole pair is text
    assert status == 200, status


async def test_a_backend_500_caused_by_the_request_marks_no_backend_unhealthy(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Three backends that answer 500 to one prompt (as vLLM answers one its tokenizer
    fails on): each such request is sent again once, then its 500 reaches the client;
    no backend is taken for failing, and the others' requests are served meanwhile."""
    backends = [await sim(profile="instant", fail_on="poison") for _ in range(3)]
    gw = await gateway(backends)
    pool = gw.services.pool
    with capture_logs() as logs:
        for _ in range(20):
            status, body = await raw_post(gw, CHAT, json.dumps(
                {"model": MODEL, "max_tokens": 2,
                 "messages": [{"role": "user", "content": "poison"}]}).encode())
            assert status == 500, body
            assert "error" in body, body
            closed = [h.name for h in pool.handles.values() if not h.healthy or h.failures]
            assert closed == [], f"taken for failing: {closed}"
        status, body = await raw_post(gw, CHAT, json.dumps(
            {"model": MODEL, "max_tokens": 2, "messages": HI}).encode())
        assert status == 200, body
    unhealthy = [e for e in logs if e["event"] == "backend_unhealthy"]
    assert unhealthy == [], unhealthy
    tries = sum(b.failed for b in backends)
    assert tries == 40, f"{tries} tries for 20 requests: each is sent again at most once"
    retried = gw.services.metrics.moves.continuations.labels("retry", "continued")._value.get()
    assert retried == 20, retried
