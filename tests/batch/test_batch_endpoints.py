"""Batch API lines for ``/v1/embeddings`` and ``/v1/responses``: queued in the owner's
``batch`` class and charged like chat and completions lines, and every line's body checked
at upload as that endpoint's interactive body is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.http.server import GatewayServer
from tests.batch.test_batch_api import client, wait_status
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"


def lines(url: str, bodies: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                               "body": {"model": MODEL, **body}}) + "\n"
                   for i, body in enumerate(bodies)).encode()


def metric(gw: GatewayServer, name: str, **labels: str) -> float:
    return gw.services.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def gw(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> GatewayServer:
    backend = await sim(profile="instant")
    return await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05)


async def run(gw: GatewayServer, url: str, data: bytes) -> tuple[Any, list[dict[str, Any]]]:
    """The finished batch and its output lines, in input order."""
    async with client(gw) as c:
        f = await c.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint=url,  # type: ignore[arg-type]
                                       completion_window="24h")
        assert batch.endpoint == url, batch
        done = await wait_status(c, batch.id, {"completed", "failed", "expired"})
        assert done.status == "completed" and done.output_file_id, done
        assert done.error_file_id is None, done
        text = (await c.files.content(done.output_file_id)).text
    return done, [json.loads(x) for x in text.splitlines()]


async def test_embeddings_lines_run_in_the_batch_class_and_are_charged(
        gw: GatewayServer) -> None:
    inputs: list[Any] = ["x" * 40, ["a" * 8, "b" * 12], "hello world", [[1, 2, 3]]]
    done, out = await run(gw, EMBEDDINGS, lines(EMBEDDINGS, [
        {"input": value, "encoding_format": "float"} for value in inputs]))
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (4, 4, 0)
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(4)]
    prompt_tokens = 0
    for value, result in zip(inputs, out, strict=True):
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        assert body["object"] == "list", body
        want = len(value) if isinstance(value, list) else 1
        assert [d["index"] for d in body["data"]] == list(range(want)), body["data"]
        assert all(len(d["embedding"]) == 384 for d in body["data"])
        prompt_tokens += body["usage"]["prompt_tokens"]
    assert prompt_tokens == 10 + (2 + 3) + 3 + 3, out  # the simulator's counts
    # scheduled as the owner's batch traffic, charged the backend's input tokens
    queued = metric(gw, "fairgate_dispatches_total", model=MODEL, backend="b0",
                    priority_class="batch")
    assert queued == 4, queued
    charged = metric(gw, "fairgate_user_tokens_total", model=MODEL, user="bert", kind="prompt")
    assert charged == prompt_tokens, (charged, prompt_tokens)
    service = metric(gw, "fairgate_user_service_total", model=MODEL, user="bert")
    assert service == prompt_tokens, service  # VTC: input x 1, no output
    done_lines = metric(gw, "fairgate_batch_requests_total", outcome="completed")
    assert done_lines == 4, done_lines


async def test_responses_lines_run_in_the_batch_class_and_are_charged(
        gw: GatewayServer) -> None:
    bodies: list[dict[str, Any]] = [
        {"input": "hello there", "instructions": "be brief", "max_output_tokens": 5},
        {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3},
        {"input": "one more", "max_output_tokens": 4}]
    done, out = await run(gw, RESPONSES, lines(RESPONSES, bodies))
    counts = done.request_counts
    assert counts is not None and (counts.completed, counts.failed) == (3, 0), counts
    inputs = outputs = 0
    for body, result in zip(bodies, out, strict=True):
        assert result["response"]["status_code"] == 200, result
        answer = result["response"]["body"]
        assert answer["object"] == "response", answer
        assert answer["usage"]["output_tokens"] == body["max_output_tokens"], answer["usage"]
        inputs += answer["usage"]["input_tokens"]
        outputs += answer["usage"]["output_tokens"]
    assert outputs == 5 + 3 + 4
    queued = metric(gw, "fairgate_dispatches_total", model=MODEL, backend="b0",
                    priority_class="batch")
    assert queued == 3, queued
    got = (metric(gw, "fairgate_user_tokens_total", model=MODEL, user="bert", kind="prompt"),
           metric(gw, "fairgate_user_tokens_total", model=MODEL, user="bert",
                  kind="completion"))
    assert got == (inputs, outputs), got
    service = metric(gw, "fairgate_user_service_total", model=MODEL, user="bert")
    assert service == inputs + 2 * outputs, service  # VTC: input x 1 + output x 2


@pytest.mark.parametrize(("url", "body", "needle"), [
    (EMBEDDINGS, {}, "line 2: 'body': 'input' must be a string or an array"),
    (EMBEDDINGS, {"input": 7}, "line 2: 'body': 'input' must be a string or an array"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 0},
     "line 2: 'body': 'max_output_tokens' must be a positive integer"),
    (RESPONSES, {"input": "hi", "max_output_tokens": 10**9},
     "line 2: 'body': 'max_output_tokens' must be at most"),
    (RESPONSES, {"input": "hi", "stream": True}, "line 2: streaming is not supported"),
    ("/v1/chat/completions", {"messages": []},
     "line 2: 'body': 'messages' must be a non-empty array"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"},
     "line 2: 'body': 'max_tokens' must be a positive integer"),
])
async def test_upload_names_the_line_whose_body_its_endpoint_refuses(
        gw: GatewayServer, url: str, body: dict[str, Any], needle: str) -> None:
    good = {EMBEDDINGS: {"input": "fine"}, RESPONSES: {"input": "fine"},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "fine"}]},
            "/v1/completions": {"prompt": "fine"}}[url]
    async with client(gw) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.files.create(file=("bad.jsonl", lines(url, [good, body])), purpose="batch")
        assert needle in err.value.message, err.value.message
        assert err.value.status_code == 400
        assert (await c.files.list()).data == []  # nothing kept


async def test_a_batch_endpoint_must_match_its_lines(gw: GatewayServer) -> None:
    async with client(gw) as c:
        f = await c.files.create(file=("in.jsonl", lines(EMBEDDINGS, [{"input": "x"}])),
                                 purpose="batch")
        with pytest.raises(openai.BadRequestError) as err:
            await c.batches.create(input_file_id=f.id, endpoint=RESPONSES,  # type: ignore[arg-type]
                                   completion_window="24h")
    message = err.value.message
    assert "must match the batch endpoint /v1/responses: line 1 (/v1/embeddings)" in message, \
        message
