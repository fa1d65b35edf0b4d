"""``fairgate bench overhead --profile``: py-spy on the gateway while it is saturated.

Two samplers attach to the worker side by side for the same seconds: one writes a
speedscope profile (open it at speedscope.app), the other an SVG flame graph. A text
summary of the speedscope file names the functions with the most self time and splits the
samples by category (Redis, logging, relay framing, aiohttp server and client, JSON,
Prometheus, the event loop, …). Samples are of a running thread (py-spy's default: an
idle loop waiting in epoll is not sampled).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from loadtest.bench.procs import executable

RATE_HZ = 100  # per sampler: two samplers pause the worker 200 times a second
# Where a sample's time goes. The owners first: the first of them found anywhere in the
# stack takes the sample (JSON written for a log line is logging's; a frame's encoding inside
# the relay is JSON's). Then the leaf-most frame of a layer below (an asyncio write called
# by aiohttp's server is the server's); the event loop only when nothing else is on the stack.
OWNERS = (
    ("logging", r"structlog/|gateway/core/logs\.py|[(/]logging/"),
    ("prometheus", r"prometheus_client/|gateway/core/metrics"),
    ("JSON", r"[(/]json/|orjson|gateway/core/jsonio\.py"),
    ("redis", r"[(/]redis/|hiredis|gateway/storage/"),
    ("relay framing", r"FrameFilter|gateway/proxy/relay"),
)
LAYERS = (
    ("aiohttp client (upstream)", r"aiohttp/client|aiohttp/connector|gateway/proxy/upstream"),
    ("aiohttp server", r"aiohttp/"),
    ("admission and scheduling", r"gateway/scheduling/|policies/"),
    # the process's root frames (gateway/runtime, the loop's start) hold every sample
    ("other gateway code", r"gateway/(?!runtime/|core/event_loop\.py)"),
)
EVENT_LOOP = "event loop (asyncio/uvloop)"
_OWNERS = [(name, re.compile(pattern)) for name, pattern in OWNERS]
_LAYERS = [(name, re.compile(pattern)) for name, pattern in LAYERS]
_LOOP = re.compile(r"asyncio/|uvloop|selectors")
CATEGORIES = (*(n for n, _ in OWNERS), *(n for n, _ in LAYERS), EVENT_LOOP, "other")


def pyspy() -> str | None:
    """The py-spy executable (the ``bench`` extra installs it), or None."""
    return executable("py-spy")


async def record(pid: int, out_dir: Path, label: str, seconds: float,
                 load: Callable[[float], Awaitable[Any]]) -> dict[str, Any]:
    """Run ``load(seconds + margin)`` while two py-spy samplers record ``pid`` for
    ``seconds``; returns the files written (relative to ``out_dir``) and the summary."""
    exe = pyspy()
    if exe is None:
        return {"skipped": "py-spy not installed (pip install 'fairgate[bench]')"}
    files = {"speedscope": f"{label}.speedscope.json", "flamegraph": f"{label}.svg"}
    samplers = _start(exe, pid, out_dir, files, seconds)
    await load(seconds + 1.0)  # the samplers attach within a second; load covers them
    return await asyncio.to_thread(_finish, samplers, out_dir, label, files, seconds)


def _start(exe: str, pid: int, out_dir: Path, files: dict[str, str], seconds: float
           ) -> list[subprocess.Popen[bytes]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(round(seconds)),
         "--rate", str(RATE_HZ), "--format", fmt, "--output", str(out_dir / name)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for fmt, name in files.items()]


def _finish(samplers: list[subprocess.Popen[bytes]], out_dir: Path, label: str,
            files: dict[str, str], seconds: float) -> dict[str, Any]:
    """Wait for the samplers; summarize the speedscope file into ``<label>.txt``."""
    errors = []
    for sampler in samplers:
        _, err = sampler.communicate(timeout=seconds + 60)
        if sampler.returncode != 0:
            errors.append(err.decode(errors="replace").strip()[-300:])
    if errors:
        return {"skipped": f"py-spy failed: {' | '.join(errors)}"}
    summary = summarize(json.loads((out_dir / files["speedscope"]).read_text()))
    text = out_dir / f"{label}.txt"
    text.write_text(summary_text(label, summary))
    return {**files, "summary_text": text.name, **summary}


def summarize(speedscope: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """Samples by category and the functions with the most self time, from py-spy's
    speedscope file (every thread's samples together)."""
    frames = [f"{f['name']} ({short_path(f.get('file') or '?')})"
              for f in speedscope["shared"]["frames"]]
    by_category: collections.Counter[str] = collections.Counter()
    by_self: collections.Counter[str] = collections.Counter()  # weights: seconds
    total, count = 0.0, 0
    for prof in speedscope["profiles"]:
        for stack, weight in zip(prof["samples"], prof["weights"], strict=True):
            if not stack:
                continue
            names = [frames[i] for i in stack]
            total += weight
            count += 1
            by_self[names[-1]] += weight  # speedscope: root first, the leaf last
            by_category[_category(names)] += weight

    def share(counter: collections.Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1) if total else 0.0) for k, v in counter.most_common(n)]

    return {"samples": count, "seconds": round(total, 2),
            "categories_pct": share(by_category, len(CATEGORIES)),
            "top_self_pct": share(by_self, top)}


# the machine's prefix of a frame's file: site-packages, the stdlib, this checkout
_PREFIXES = [re.compile(p) for p in (r"^.*/site-packages/", r"^.*/lib/python3\.\d+/",
                                     r"^.*/(?=(?:gateway|policies|loadtest)/)")]


def short_path(path: str) -> str:
    """A frame's file without the machine's prefix: from the package (``aiohttp/…``,
    ``asyncio/…``, ``gateway/…``) on."""
    for prefix in _PREFIXES:
        short, found = prefix.subn("", path, count=1)
        if found:
            return short
    return path


def _category(names: list[str]) -> str:
    """``names``: a stack, the root first."""
    for name, pattern in _OWNERS:
        if any(pattern.search(frame) for frame in names):
            return name
    for frame in reversed(names):
        for name, pattern in _LAYERS:
            if pattern.search(frame):
                return name
    return EVENT_LOOP if any(_LOOP.search(frame) for frame in names) else "other"


def summary_text(label: str, summary: dict[str, Any]) -> str:
    lines = [f"py-spy profile {label}: {summary['samples']} samples ({summary['seconds']} s) "
             f"of a running thread, {RATE_HZ} Hz", "",
             "by category (the first owner anywhere in the stack: "
             + ", ".join(name for name, _ in OWNERS) + "; else the leaf-most layer: "
             + ", ".join(name for name, _ in LAYERS) + f"; else {EVENT_LOOP}):"]
    lines += [f"  {pct:5.1f} %  {name}" for name, pct in summary["categories_pct"]]
    lines += ["", "top functions by self time:"]
    lines += [f"  {pct:5.1f} %  {name}" for name, pct in summary["top_self_pct"]]
    return "\n".join(lines) + "\n"
