"""``autoscale``: the bench plays the autoscaler of the vLLM pool, two policies compared.

A harness in this process acts as KEDA would: every ``poll_s`` it reads a signal and
starts or stops simulated backends (``fairgate sim`` processes). A new backend has a cold
start of ``cold_start_s`` (from the decision until it is added to the gateway with ``POST
/admin/backends``; the process boots meanwhile); a scale-down removes the newest with
``DELETE /admin/backends/{name}`` (the gateway drains it, its running streams move to
another backend) and stops the process once the gateway forgot it. The configured
backend ``b0`` stays: every policy keeps at least one.

Three policies in one run, each on a fresh gateway, Redis database and backend ``b0``:

- **fairgate**: ``desired_replicas`` of ``GET /admin/pools`` (``policies/autoscale.py``),
  followed as it is, at the gateway's defaults (the judged row);
- **fairgate_burst_room** (reported, not judged): the same with
  ``autoscale.target_utilization`` 1 / ``step_factor``, the room ``docs/autoscaling.md``
  prescribes for a pool that must absorb bursts of that factor within a cold start, kept
  over the usual load (``autoscale.burst_baseline_s``: twice the step's length, so the
  step itself does not move the baseline);
- **threshold**: the rule of the KEDA guides, tenant-blind: requests waiting (the gateway's
  queue, every class, plus vLLM's ``num_requests_waiting`` summed over the backends) above
  ``threshold`` adds a backend per poll; below it for ``cooldown_s`` (and that long after
  the last change) removes one. fairgate's ``scale_down_delay_s`` is the same cool-down.

Load: interactive requests in an open loop at 1×, then 4×, then 1× the base rate, and a
batch-class user's closed loop deeper than the backends' slots (a steady backlog) the
whole time. Measured per policy: interactive TTFT SLO attainment (the class's
``ttft_slo_ms`` from the gateway's config; a refusal or a failure is a miss),
backend-seconds (each backend from the decision to start it until its process stopped,
within the load), time to react (from the step up to the first backend added after it
serving), and requests lost while scaling down (failed, other than refused at the door,
while in flight during a removal).

Targets (issue "tell the fleet what it needs"): fairgate's attainment ≥ 0.99, with ≥ 20 %
fewer backend-seconds than the threshold rule at equal or better attainment; 0 lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.vllm_metrics import parse_metrics
from gateway.core.settings import Autoscale
from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import MODEL, Backend, Bench, Options
from loadtest.bench.loadgen import LoopUser, cancel_all, closed_loop, progress, stepped_loop
from loadtest.bench.procs import Proc, SimSpec, start_sim
from loadtest.bench.stats import dist_ms

SIM = SimSpec(max_num_seqs=2, max_num_batched_tokens=2048)
ADMIN_KEY = "sk-bench-admin"
POLICIES = ("threshold", "fairgate", "fairgate_burst_room")
COLORS = ("tab:red", "tab:blue", "tab:green")
INTERACTIVE_USERS = 8
BATCH_USER = "batch"
SERVING_TIMEOUT_S = 60.0  # a new backend that takes no work by then is recorded as not serving
REMOVAL_TIMEOUT_S = 120.0  # a removal the gateway has not finished by then: the process stops
ATTAINMENT_TARGET = 0.99
SAVING_TARGET = 0.2
STEP_FACTOR = 4  # the load step: 1× → 4× → 1×


def params(opts: Options) -> dict[str, Any]:
    step_s = opts.duration_s or opts.pick(60.0, 6.0)
    return {
        "rate_1x": opts.pick(2.0, 1.0), "step_factor": STEP_FACTOR,
        # 1× (warm), 4× (the step), 1× (long enough for a scale-down after the cool-down)
        "phases_s": [round(step_s * 2 / 3, 1), step_s, step_s],
        "interactive": {"users": INTERACTIVE_USERS, "prompt_tokens": 256, "max_tokens": 64},
        # the same shape as the interactive requests: one backend's measured tokens/s is what
        # the interactive class gets from it
        "batch": {"concurrency": opts.pick(6, 3), "prompt_tokens": 256, "max_tokens": 64},
        "poll_s": opts.pick(2.0, 0.5), "cold_start_s": opts.pick(8.0, 1.0),
        "cooldown_s": opts.pick(20.0, 3.0), "threshold": 3,
        # "fairgate" runs at the gateway's defaults, as a user gets them (recorded, not
        # set); "fairgate_burst_room" with the room docs/autoscaling.md prescribes for a
        # pool that must absorb this workload's step within a cold start
        "defaults": {"target_utilization": Autoscale().target_utilization,
                     "burst_baseline_s": Autoscale().burst_baseline_s},
        "burst_room": {"target_utilization": 1 / STEP_FACTOR,
                       "burst_baseline_s": round(2 * step_s, 1)},
        "min_replicas": 1, "max_replicas": opts.size or opts.pick(5, 3),
        "ttft_slo_ms": 2000, "autoscale_interval_s": opts.pick(1.0, 0.5),
        "drain_s": opts.pick(30.0, 10.0), "sim": SIM.__dict__,
        "processes": "each backend: one fairgate sim process; the gateway: one process "
                     "(--workers 1); load generator and autoscaler: this process; Valkey",
    }


def gateway_settings(p: dict[str, Any], name: str) -> dict[str, Any]:
    """The gateway's config beside its backend and keys: the defaults, but for the burst
    room of ``fairgate_burst_room``."""
    room = p["burst_room"] if name == "fairgate_burst_room" else {}
    return {"admin_keys": [ADMIN_KEY], "backends_refresh_s": 0.5,
            "classes": {"interactive": {"ttft_slo_ms": p["ttft_slo_ms"]}},
            "autoscale": {"interval_s": p["autoscale_interval_s"],
                          **room, "scale_down_delay_s": p["cooldown_s"],
                          "min_replicas": p["min_replicas"], "max_replicas": p["max_replicas"]}}


# -- the threshold rule (pure) -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ThresholdRule:
    threshold: float
    cooldown_s: float
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True, slots=True)
class ThresholdState:
    replicas: int
    changed_at: float = float("-inf")
    above_at: float = float("-inf")  # when the signal was last at or above the threshold


def threshold_step(rule: ThresholdRule, state: ThresholdState, waiting: float,
                   now_s: float) -> ThresholdState:
    """One poll of the rule: one more backend while ``waiting`` is above the threshold;
    one fewer once it stayed below for a cool-down, a cool-down after the last change."""
    above_at = now_s if waiting >= rule.threshold else state.above_at
    if waiting > rule.threshold and state.replicas < rule.max_replicas:
        return ThresholdState(state.replicas + 1, now_s, above_at)
    if (waiting < rule.threshold and state.replicas > rule.min_replicas
            and now_s - above_at >= rule.cooldown_s
            and now_s - state.changed_at >= rule.cooldown_s):
        return ThresholdState(state.replicas - 1, now_s, above_at)
    return ThresholdState(state.replicas, state.changed_at, above_at)


# -- the fleet: simulated backends started and stopped -------------------------------------

@dataclass(slots=True)
class Replica:
    """One backend's life, in ``time.perf_counter()`` seconds."""

    name: str
    decided_s: float
    proc: Proc | None = None
    url: str = ""
    added_s: float | None = None  # added to the gateway (after the cold start)
    serving_s: float | None = None  # first work seen there
    leaving_s: float | None = None  # removal decided
    stopped_s: float | None = None  # process stopped
    removal: str = ""  # how the gateway answered the removal
    task: asyncio.Task[None] | None = None
    configured: bool = False


class Fleet:
    """The pool's backends: ``b0`` (configured) and those this harness adds and removes."""

    def __init__(self, bench: Bench, http: aiohttp.ClientSession, gateway: str,
                 first: Backend, p: dict[str, Any], label: str) -> None:
        self.bench, self.http, self.gateway, self.p = bench, http, gateway, p
        self.label = label
        now = time.perf_counter()
        self.replicas = [Replica("b0", now, first.proc, first.url, now, now, configured=True)]
        self._next = 1

    def provisioned(self) -> list[Replica]:
        return [r for r in self.replicas if r.leaving_s is None]

    def ready(self) -> list[Replica]:
        return [r for r in self.provisioned() if r.added_s is not None]

    def scale_to(self, count: int) -> None:
        live = self.provisioned()
        for _ in range(count - len(live)):
            replica = Replica(f"a{self._next}", time.perf_counter())
            self._next += 1
            replica.task = asyncio.create_task(self._bring_up(replica))
            self.replicas.append(replica)
        removable = [r for r in live if not r.configured]
        for replica in removable[::-1][:max(0, len(live) - count)]:
            replica.leaving_s = time.perf_counter()
            replica.task = asyncio.create_task(self._retire(replica, replica.task))

    async def _bring_up(self, r: Replica) -> None:
        r.proc = await start_sim(SimSpec(**self.p["sim"]), MODEL, self.bench.log_dir,
                                 f"{self.label}-{r.name}")
        r.url = r.proc.url
        await asyncio.sleep(max(0.0, r.decided_s + self.p["cold_start_s"] - time.perf_counter()))
        async with self.http.post(self.gateway + "/admin/backends", headers=_admin(),
                                  json={"name": r.name, "url": r.url, "model": MODEL}) as resp:
            if resp.status != 201:
                raise RuntimeError(f"adding {r.name}: {resp.status} {await resp.text()}")
        r.added_s = time.perf_counter()
        deadline = r.added_s + SERVING_TIMEOUT_S
        while time.perf_counter() < deadline:
            if await _busy(self.http, r.url):
                r.serving_s = time.perf_counter()
                return
            await asyncio.sleep(0.1)

    async def _retire(self, r: Replica, starting: asyncio.Task[None] | None) -> None:
        if r.added_s is None:  # still in its cold start: never reached the gateway
            if starting is not None:
                await cancel_all([starting])
        else:
            if starting is not None and not starting.done():
                await cancel_all([starting])  # only its wait for the first work
            r.removal = await self._remove(r.name)
        if r.proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, r.proc.stop)
        r.stopped_s = time.perf_counter()

    async def _remove(self, name: str) -> str:
        """DELETE until the gateway answers that the backend is gone (200, then 404)."""
        deadline = time.perf_counter() + REMOVAL_TIMEOUT_S
        answers = []
        while time.perf_counter() < deadline:
            async with self.http.delete(f"{self.gateway}/admin/backends/{name}",
                                        headers=_admin()) as resp:
                answers.append(resp.status)
                if resp.status in (200, 404):
                    return f"removed after {len(answers)} call(s)"
                if resp.status != 202:
                    return f"refused: {resp.status} {(await resp.text())[:200]}"
            await asyncio.sleep(0.25)
        return f"still draining after {REMOVAL_TIMEOUT_S:g} s: stopped anyway"

    async def close(self) -> None:
        """Removals under way finish first (the load is over, so their drains end soon;
        at most ``REMOVAL_TIMEOUT_S``): cancelled, a removal decided just before the end
        left no answer (a clean-clone CI run read it as a failed removal); then the rest
        stops."""
        retiring = [r.task for r in self.replicas if r.leaving_s is not None
                    and r.task is not None and not r.task.done()]
        if retiring:
            await asyncio.wait(retiring, timeout=REMOVAL_TIMEOUT_S)
        tasks = [r.task for r in self.replicas if r.task is not None]
        await cancel_all(tasks)
        now = time.perf_counter()
        for r in self.replicas:
            if r.proc is not None and not r.configured and r.stopped_s is None:
                r.proc.stop()
            if r.stopped_s is None:
                r.stopped_s = now


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


async def _metrics_text(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _busy(http: aiohttp.ClientSession, url: str) -> bool:
    text = await _metrics_text(http, url)
    if text is None:
        return False
    raw = parse_metrics(text)
    return raw.running + raw.waiting > 0 or (raw.service or (0.0, 0.0))[1] > 0


# -- the two policies ----------------------------------------------------------------------

class Policy(Protocol):
    async def desired(self, fleet: Fleet, now_s: float) -> tuple[int, float]:
        """The replica count wanted now, and the signal it read."""


class FairgateSignal:
    """``GET /admin/pools``: the pool's ``desired_replicas`` (the most over pools)."""

    async def desired(self, fleet: Fleet, now_s: float) -> tuple[int, float]:
        async with fleet.http.get(fleet.gateway + "/admin/pools", headers=_admin()) as resp:
            resp.raise_for_status()
            data = (await resp.json())["data"]
        wanted = max((int(pool["desired_replicas"]) for pool in data), default=0)
        return wanted, float(wanted)


class QueueThreshold:
    """Requests waiting, in the gateway's queue and in every vLLM's, against a threshold."""

    def __init__(self, rule: ThresholdRule) -> None:
        self.rule = rule
        self.state = ThresholdState(rule.min_replicas)

    async def desired(self, fleet: Fleet, now_s: float) -> tuple[int, float]:
        texts = await asyncio.gather(_metrics_text(fleet.http, fleet.gateway),
                                     *(_metrics_text(fleet.http, r.url) for r in fleet.ready()))
        waiting = _queue_depth(texts[0] or "")
        waiting += sum(parse_metrics(t).waiting for t in texts[1:] if t is not None)
        self.state = threshold_step(self.rule, self.state, waiting, now_s)
        return self.state.replicas, waiting


def _queue_depth(text: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "fairgate_queue_depth")


async def autoscaler(policy: Policy, fleet: Fleet, p: dict[str, Any], start: float,
                     stop: asyncio.Event, timeline: list[dict[str, Any]]) -> None:
    """Poll the policy every ``poll_s`` and scale the fleet to its answer."""
    while not stop.is_set():
        now = time.perf_counter()
        try:
            wanted, signal = await policy.desired(fleet, now)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            timeline.append({"t": round(now - start, 2), "error": repr(exc)[:200]})
        else:
            wanted = min(max(wanted, p["min_replicas"]), p["max_replicas"])
            fleet.scale_to(wanted)
            timeline.append({"t": round(now - start, 2), "desired": wanted,
                             "signal": round(signal, 2), "ready": len(fleet.ready()),
                             "provisioned": len(fleet.provisioned())})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), p["poll_s"])


# -- one policy's run ----------------------------------------------------------------------

def _users() -> list[tuple[str, str]]:
    return [(f"i{i}", "interactive") for i in range(INTERACTIVE_USERS)] + [(BATCH_USER, "batch")]


async def _run(opts: Options, p: dict[str, Any], bench: Bench, name: str) -> dict[str, Any]:
    policy: Policy = FairgateSignal() if name.startswith("fairgate") else QueueThreshold(
        ThresholdRule(p["threshold"], p["cooldown_s"], p["min_replicas"], p["max_replicas"]))
    results: list[Result] = []
    timeline: list[dict[str, Any]] = []
    rate = p["rate_1x"]
    steps = [(rate, p["phases_s"][0]), (rate * p["step_factor"], p["phases_s"][1]),
             (rate, p["phases_s"][2])]
    inter = p["interactive"]
    specs = [Spec(f"i{i}", "interactive", inter["prompt_tokens"], inter["max_tokens"])
             for i in range(INTERACTIVE_USERS)]
    batch = LoopUser(Spec(BATCH_USER, "batch", p["batch"]["prompt_tokens"],
                          p["batch"]["max_tokens"]), p["batch"]["concurrency"])
    async with bench.served(SimSpec(**p["sim"]), f"{name}-b0", _users(), f"gw-{name}",
                            workers=1, **gateway_settings(p, name)) as (b0, gw), \
            aiohttp.ClientSession() as http:
        fleet = Fleet(bench, http, gw.url, b0, p, name)
        target = Target(name, gw.url, MODEL, via_gateway=True)
        bar = progress(int(sum(r * d for r, d in steps)), f"autoscale {name}", opts.progress)
        stop = asyncio.Event()
        try:
            async with new_session() as session:
                start = time.perf_counter()
                scaler = asyncio.create_task(autoscaler(policy, fleet, p, start, stop, timeline))
                load_s = sum(d for _, d in steps)
                batch_loop = asyncio.create_task(closed_loop(
                    session, target, [batch], load_s, bar, sink=results))
                await stepped_loop(session, target, lambda k: specs[k % len(specs)], steps, bar,
                                   seed=1, drain_s=p["drain_s"], sink=results)
                await batch_loop
                end = time.perf_counter()
                stop.set()
                await scaler
        finally:
            stop.set()
            await fleet.close()
        bar.close()
    return measure(p, results, fleet.replicas, timeline, start, end)


def measure(p: dict[str, Any], results: list[Result], replicas: list[Replica],
            timeline: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    slo_s = p["ttft_slo_ms"] / 1000.0
    step_at = start + p["phases_s"][0]
    inter = [r for r in results if r.tag == "interactive"]
    met = [r for r in inter if r.ok and r.ttft is not None and r.ttft <= slo_s]
    removals = [(r.leaving_s, r.stopped_s or end) for r in replicas if r.leaving_s is not None]
    failed = [r for r in results if not r.ok and r.error != "cancelled"]
    refused = [r for r in failed if r.status == 429]
    lost = [r for r in failed if r.status != 429
            and any(r.sent_s <= b and r.end_s >= a for a, b in removals)]
    added = [r for r in replicas if not r.configured and r.decided_s >= step_at]
    first = min((r.serving_s for r in added if r.serving_s is not None), default=None)
    return {
        "interactive": {"sent": len(inter), "slo_met": len(met),
                        "attainment": round(len(met) / len(inter), 4) if inter else None,
                        "ttft_ms": dist_ms([r.ttft for r in inter if r.ttft is not None]),
                        "ttft_by_send": [[round(r.sent_s - start, 2),
                                          None if r.ttft is None else round(r.ttft, 3)]
                                         for r in inter]},
        "batch": {"completed": sum(r.ok for r in results if r.tag == "batch"),
                  "output_tokens": sum(r.output_tokens for r in results
                                       if r.tag == "batch" and r.ok)},
        "backend_seconds": round(sum(max(0.0, min(r.stopped_s or end, end)
                                         - max(r.decided_s, start)) for r in replicas), 1),
        "load_s": round(end - start, 1),
        "react_s": None if first is None else round(first - step_at, 2),
        "failed": len(failed), "refused_429": len(refused), "lost_scaling_down": len(lost),
        "error_sample": next((r.error for r in failed), None),
        "max_replicas_used": max((t.get("provisioned", 0) for t in timeline), default=1),
        "replicas": [_life(r, start) for r in replicas],
        "timeline": timeline,
    }


def _life(r: Replica, start: float) -> dict[str, Any]:
    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - start, 2)

    return {"name": r.name, "decided_s": rel(r.decided_s), "added_s": rel(r.added_s),
            "serving_s": rel(r.serving_s), "leaving_s": rel(r.leaving_s),
            "stopped_s": rel(r.stopped_s), "removal": r.removal}


# -- the report ----------------------------------------------------------------------------

def _headline(runs: dict[str, Any]) -> list[report.Headline]:
    th, fg, room = runs["threshold"], runs["fairgate"], runs["fairgate_burst_room"]
    att_t, att_f = th["interactive"]["attainment"], fg["interactive"]["attainment"]
    bs_t, bs_f = th["backend_seconds"], fg["backend_seconds"]
    ratio = round(bs_f / bs_t, 3) if bs_t else None
    equal_or_better = att_t is not None and att_f is not None and att_f >= att_t
    return [
        report.Headline("interactive TTFT SLO attainment, threshold rule vs fairgate",
                        att_t, att_f, None, f"≥ {ATTAINMENT_TARGET}",
                        att_f is not None and att_f >= ATTAINMENT_TARGET),
        report.Headline("backend-seconds used (the GPU bill), threshold rule vs fairgate",
                        bs_t, bs_f, ratio, f"≤ {1 - SAVING_TARGET:g}× at equal or better "
                        "attainment", ratio is not None and ratio <= 1 - SAVING_TARGET
                        and equal_or_better),
        report.Headline("not the default: with the room for a 4× step (target_utilization "
                        "0.25, burst_baseline_s twice the step): attainment; backend-seconds "
                        "(ratio to the threshold rule)", room["interactive"]["attainment"],
                        room["backend_seconds"],
                        round(room["backend_seconds"] / bs_t, 3) if bs_t else None, "–", None),
        report.Headline("time to react to the 4× step (s): the step to the first added "
                        "backend serving", th["react_s"], fg["react_s"], None, "–", None),
        report.Headline("requests lost while scaling down", th["lost_scaling_down"],
                        fg["lost_scaling_down"], None, "0",
                        th["lost_scaling_down"] == 0 and fg["lost_scaling_down"] == 0),
        report.Headline("interactive TTFT p99 (ms)", th["interactive"]["ttft_ms"]["p99"],
                        fg["interactive"]["ttft_ms"]["p99"], None, "–", None),
        report.Headline("most backends at once", th["max_replicas_used"],
                        fg["max_replicas_used"], None, "–", None),
        report.Headline("batch requests completed", th["batch"]["completed"],
                        fg["batch"]["completed"], None, "–", None),
    ]


def _plots(p: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    step = (p["phases_s"][0], p["phases_s"][0] + p["phases_s"][1])
    fig, ax = report.figure("Desired vs actual backends", "seconds since the load began",
                            "backends")
    for name, color in zip(POLICIES, COLORS, strict=True):
        rows = [t for t in runs[name]["timeline"] if "desired" in t]
        ax.step([t["t"] for t in rows], [t["desired"] for t in rows], where="post",
                color=color, linestyle="--", label=f"{name}: desired")
        ax.step([t["t"] for t in rows], [t["ready"] for t in rows], where="post",
                color=color, label=f"{name}: serving")
    for x in step:
        ax.axvline(x, color="black", linestyle=":")
    ax.legend()
    fig2, ax2 = report.figure("Interactive TTFT by send time", "seconds since the load began",
                              "TTFT (s)")
    for name, color in zip(POLICIES, COLORS, strict=True):
        points = [(t, v) for t, v in runs[name]["interactive"]["ttft_by_send"] if v is not None]
        ax2.scatter([t for t, _ in points], [v for _, v in points], s=6, color=color,
                    label=name)
    ax2.axhline(p["ttft_slo_ms"] / 1000.0, color="green", linestyle=":", label="TTFT target")
    for x in step:
        ax2.axvline(x, color="black", linestyle=":")
    ax2.legend()
    return {"autoscale_replicas.png": fig, "autoscale_ttft.png": fig2}


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        for name in POLICIES:
            runs[name] = await _run(opts, p, bench, name)
    notes = ["Columns: 'direct' is the threshold rule (the KEDA guides' queue-size trigger), "
             "'gateway' fairgate's desired replicas; the ratio is fairgate ÷ threshold.",
             f"Cold start {p['cold_start_s']:g} s per backend, poll every {p['poll_s']:g} s, "
             f"cool-down {p['cooldown_s']:g} s, threshold {p['threshold']} waiting requests, "
             f"{p['min_replicas']}–{p['max_replicas']} backends."]
    return report.write(opts, "autoscale", p, runs, _headline(runs), _plots(p, runs), notes)

