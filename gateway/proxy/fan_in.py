"""The continuations of a several-choice stream (``gateway/proxy/choices.py``: one
``/v1/completions`` stream per unfinished choice, on one backend) read as one stream.

:class:`FanIn` looks to the relay like a backend's response: an event stream whose
frames are the parts' frames, each choice's ``index`` set to the original choice's, the
parts' ``[DONE]`` frames and usage-only frames held back, and once every part ended one
usage frame and one ``[DONE]`` (the relay re-frames the usage as the whole answer's).
A part that fails (a reset, an end without its ``[DONE]``) fails the whole stream: the
relay continues the choices still unfinished, each from its own token ids. Closing it
(a move) closes every part: vLLM aborts each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp

DONE = b"data: [DONE]"
_END = None  # a part's stream ended


class FanIn:
    """Several continuation responses (``(choice index, response)``) read as one."""

    content_type = "text/event-stream"

    def __init__(self, parts: list[tuple[int, aiohttp.ClientResponse]]) -> None:
        self.parts = parts
        self.content = _Merged(parts)

    def close(self) -> None:
        self.content.stop()
        for _, resp in self.parts:
            resp.close()

    def release(self) -> None:
        self.content.stop()
        for _, resp in self.parts:
            resp.release()


class _Merged:
    """The parts' frames as they come, re-indexed (``iter_any``, ``is_eof``,
    ``set_exception``: what the relay and a move use of a response's content)."""

    def __init__(self, parts: list[tuple[int, aiohttp.ClientResponse]]) -> None:
        self._parts = parts
        # bounded: a part waits while the client reads slower than it generates
        self._queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = (
            asyncio.Queue(maxsize=4 * len(parts)))
        self._tasks: list[asyncio.Task[None]] = []
        self._eof = False

    def is_eof(self) -> bool:
        return self._eof

    def set_exception(self, exc: BaseException) -> None:
        """Fail the stream now (a move): the reader raises ``exc``."""
        self.stop()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait((-1, exc))

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _read(self, index: int, resp: aiohttp.ClientResponse) -> None:
        try:
            if resp.content_type != "text/event-stream":
                raise aiohttp.ClientPayloadError(
                    f"choice {index}'s continuation answered {resp.content_type}")
            async for chunk in resp.content.iter_any():
                await self._queue.put((index, chunk))
            await self._queue.put((index, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._queue.put((index, exc))

    async def iter_any(self) -> AsyncIterator[bytes]:
        self._tasks = [asyncio.ensure_future(self._read(i, r)) for i, r in self._parts]
        splitters = {i: _Frames(i) for i, _ in self._parts}
        usage = b""
        try:
            while splitters:
                index, item = await self._queue.get()
                if isinstance(item, aiohttp.ClientError | TimeoutError):
                    raise item
                if isinstance(item, BaseException):
                    raise aiohttp.ClientPayloadError(f"choice {index}: {item!r}")
                part = splitters[index]
                if item is _END:
                    if not part.done:
                        raise aiohttp.ClientPayloadError(
                            f"choice {index}'s continuation ended before its answer did")
                    usage = part.usage or usage
                    del splitters[index]
                    continue
                if out := part.feed(item):
                    yield out
            self._eof = True
            yield usage + DONE + b"\n\n"
        finally:
            self.stop()


class _Frames:
    """One part's frames: its choices' ``index`` set to ``index``; its ``[DONE]`` and
    usage-only frame held back."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.done = False
        self.usage = b""
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        self._pending += chunk
        end = self._pending.rfind(b"\n\n")
        if end < 0:
            return b""
        complete, self._pending = self._pending[:end + 2], self._pending[end + 2:]
        return b"".join(self._frame(f) for f in complete.split(b"\n\n")[:-1])

    def _frame(self, frame: bytes) -> bytes:
        if frame.startswith(DONE):
            self.done = True
            return b""
        if not frame.startswith(b"data: {"):
            return frame + b"\n\n"
        with contextlib.suppress(ValueError):
            event = json.loads(frame[6:])
            if isinstance(event, dict) and isinstance(event.get("choices"), list):
                if not event["choices"] and "usage" in event:
                    self.usage = frame + b"\n\n"
                    return b""
                for choice in event["choices"]:
                    if isinstance(choice, dict):
                        choice["index"] = self.index
                return b"data: " + json.dumps(event, separators=(",", ":"),
                                              ensure_ascii=False).encode() + b"\n\n"
        return frame + b"\n\n"  # broken or an error event: the relay reads it so
