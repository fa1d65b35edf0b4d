"""``overhead``'s report: the headline rows (fairgate against direct and the bare aiohttp
proxy, as ratios in the same run), the table of every proxy side by side, and the plot."""

from __future__ import annotations

from typing import Any

from loadtest.bench import report
from loadtest.bench.stats import ratio

CPU_VS_BARE_TARGET = 2.0  # issue 45: fairgate's CPU per request ≤ 2× the bare proxy's
WORKERS_VS_DIRECT_TARGET = 0.5  # issue 45: `--workers 2` req/s ≥ 0.5 of direct's
ADDED_P50_TARGET_MS = 1.0  # added E2E p50 at 500 req/s
ADDED_P99_TARGET_MS = 10.0
JUDGED_RATE = 500
LITELLM_NOTE = ("LiteLLM publishes 12 ms median added latency at ~1,000 RPS (proxy on two "
                "4-CPU instances, its own benchmark with a mock backend).")
MODE_LABELS = {"streamed": "streamed", "non_streamed": "non-streamed"}
# the table's rows, in order, and their names
PROXY_LABELS = {"direct": "direct (no proxy; CPU: the backend's own)",
                "bare_proxy": "bare aiohttp proxy (the Python floor)"}


def _get(run: dict[str, Any] | None, mode: str, key: str, *path: str) -> Any:
    """A number of a run (None when the run, its mode or its key is missing)."""
    value: Any = (run or {}).get(mode, {}).get(key)
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _cpu(run: dict[str, Any] | None, mode: str, key: str) -> float | None:
    return _get(run, mode, key, "cpu", "process_cpu_ms_per_req")  # type: ignore[no-any-return]


def _added(runs: dict[str, Any], name: str, mode: str, key: str, q: str) -> float | None:
    dv, gv = (_get(runs.get(n), mode, key, "e2e_ms", q) for n in ("direct", name))
    return None if dv is None or gv is None else round(gv - dv, 3)


def _judged(value: float | None, ok: bool) -> bool | None:
    return None if value is None else ok


def headline(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    rows: list[report.Headline] = []
    for mode in p["modes"]:
        rows += _rate_rows(p, runs, mode)
        rows += _max_rows(p, runs, mode)
        rows += _baseline_rows(p, runs, mode)
    return rows


def _baseline_rows(p: dict[str, Any], runs: dict[str, Any], mode: str) -> list[report.Headline]:
    """This tree's fairgate against ``--baseline-tree``'s, one worker each, same run."""
    base = runs.get("gateway_baseline")
    if base is None:
        return []
    m, g, rows = MODE_LABELS[mode], runs["gateway"], []
    for key, label in [(f"rate_{r}", f"at {r} req/s") for r in p["rates"]] + [
            ("max", "at saturation")]:
        before, after = _cpu(base, mode, key), _cpu(g, mode, key)
        rows.append(report.Headline(
            f"{m}: CPU per request {label} (ms), baseline tree (direct column) / this tree; "
            "ratio = this ÷ baseline", before, after, ratio(after, before), "–", None))
    before, after = _get(base, mode, "max", "req_s"), _get(g, mode, "max", "req_s")
    rows.append(report.Headline(
        f"{m}: max req/s, closed loop, one worker, baseline tree (direct column) / this tree",
        before, after, ratio(after, before), "–", None))
    return rows


def _rate_rows(p: dict[str, Any], runs: dict[str, Any], mode: str) -> list[report.Headline]:
    d, g, b = runs["direct"], runs["gateway"], runs.get("bare_proxy")
    m, rows = MODE_LABELS[mode], []
    for rate in p["rates"]:
        key, judged = f"rate_{rate}", rate == JUDGED_RATE
        for q, bound in (("p50", ADDED_P50_TARGET_MS), ("p99", ADDED_P99_TARGET_MS)):
            added = _added(runs, "gateway", mode, key, q)
            rows.append(report.Headline(
                f"{m}: E2E {q} at {rate} req/s (ms); ratio column = added ms",
                _get(d, mode, key, "e2e_ms", q), _get(g, mode, key, "e2e_ms", q), added,
                f"added ≤ {bound:g} ms" if judged else "–",
                _judged(added, added is not None and added <= bound) if judged else None))
        dv, gv = _get(d, mode, key, "req_s"), _get(g, mode, key, "req_s")
        rows.append(report.Headline(f"{m}: achieved req/s at {rate} req/s offered", dv, gv,
                                    ratio(gv, dv), "–", None))
        bare, gw = _cpu(b, mode, key), _cpu(g, mode, key)
        share = ratio(gw, bare)
        rows.append(report.Headline(
            f"{m}: CPU per request at {rate} req/s (ms), bare aiohttp proxy (direct column) / "
            "fairgate one worker; ratio = fairgate ÷ bare proxy", bare, gw, share,
            f"≤ {CPU_VS_BARE_TARGET:g}× bare", _judged(share, (share or 0) <= CPU_VS_BARE_TARGET)))
        rows.append(report.Headline(
            f"{m}: floor: the backend's own CPU per request at {rate} req/s (ms), direct",
            _cpu(d, mode, key), None, None, "–", None))
        rows.append(report.Headline(
            f"{m}: Redis commands / round trips per request at {rate} req/s", None,
            _get(g, mode, key, "cpu", "redis_commands_per_req"),
            _get(g, mode, key, "cpu", "redis_round_trips_per_req"),
            "– (ratio column: round trips)", None))
    return rows


def _max_rows(p: dict[str, Any], runs: dict[str, Any], mode: str) -> list[report.Headline]:
    """Saturation: a closed loop of ``max_concurrency`` clients."""
    d, g, w = runs["direct"], runs["gateway"], runs["gateway_wide"]
    many, b, n = runs["gateway_workers"], runs.get("bare_proxy"), p["workers"]
    m = MODE_LABELS[mode]
    direct = _get(d, mode, "max", "req_s")
    rows = []
    for label, run, judge in (("one worker (default gates)", g, False),
                              ("one worker (waiting gate wide open)", w, False),
                              (f"--workers {n} (default gates)", many, True)):
        got = _get(run, mode, "max", "req_s")
        share = ratio(got, direct)
        rows.append(report.Headline(
            f"{m}: max req/s, closed loop, {label}", direct, got, share,
            f"≥ {WORKERS_VS_DIRECT_TARGET:g} of direct" if judge else "–",
            _judged(share, (share or 0) >= WORKERS_VS_DIRECT_TARGET) if judge else None))
    bare_max = _get(b, mode, "max", "req_s")
    rows.append(report.Headline(
        f"{m}: floor: max req/s, closed loop, bare aiohttp proxy; ratio = fairgate one "
        "worker (wide open) ÷ bare proxy", direct, bare_max,
        ratio(_get(w, mode, "max", "req_s"), bare_max), "–", None))
    bare = _cpu(b, mode, "max")
    for label, run in (("one worker", g), (f"--workers {n}", many)):
        gw = _cpu(run, mode, "max")
        share = ratio(gw, bare)
        rows.append(report.Headline(
            f"{m}: CPU per request at saturation (ms), bare aiohttp proxy (direct column) / "
            f"fairgate {label}; ratio = fairgate ÷ bare proxy", bare, gw, share,
            f"≤ {CPU_VS_BARE_TARGET:g}× bare", _judged(share, (share or 0) <= CPU_VS_BARE_TARGET)))
    cpu = _get(many, mode, "max", "cpu") or {}
    rows.append(report.Headline(
        f"{m}: --workers {n} at saturation, cores: supervisor + workers "
        f"{' + '.join(str(c) for c in cpu.get('process_split_cores', []))}, backend "
        f"{cpu.get('backend_cores')}, load generator {cpu.get('loadgen_cores')}",
        None, cpu.get("process_cores"), None, "–", None))
    cores = _get(w, mode, "max", "cpu", "process_cores") or 0.0
    wide_max = _get(w, mode, "max", "req_s")
    rows.append(report.Headline(f"{m}: gateway req/s per busy core (wide-open run)", None,
                                round(wide_max / cores, 1) if cores and wide_max else None,
                                None, "–", None))
    return rows


def _proxy_names(p: dict[str, Any], runs: dict[str, Any]) -> list[tuple[str, str]]:
    names = [(k, v) for k, v in PROXY_LABELS.items() if k in runs]
    names += [(peer, runs[peer].get("label", peer)) for peer in p["peers"] if peer in runs]
    n = p["workers"]
    if "gateway_baseline" in runs:
        names.append(("gateway_baseline", f"fairgate, 1 worker, baseline tree "
                                          f"`{p.get('baseline_tree')}`"))
    names += [("gateway", "**fairgate, 1 worker**"), ("gateway_wide",
                                                     "fairgate, 1 worker, waiting gate wide"),
              ("gateway_workers", f"**fairgate, `--workers {n}`**")]
    return names


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


def table(p: dict[str, Any], runs: dict[str, Any], mode: str) -> str:
    """Every proxy side by side in one mode: saturation, CPU per request, added latency."""
    rates = p["rates"]
    head = ["proxy", "max req/s (closed loop)", "CPU ms/req at max"]
    head += [f"CPU ms/req at {r}/s" for r in rates]
    head += [f"added p50 / p99 at {r}/s (ms)" for r in rates]
    head += [f"achieved at {rates[-1]}/s"]
    lines = [f"**{MODE_LABELS[mode]}**, every proxy in front of the same simulator "
             f"({p['max_concurrency']} clients at max):", "",
             "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name, label in _proxy_names(p, runs):
        run = runs[name]
        if "skipped" in run:
            lines.append(f"| {label} | skipped: {run['skipped']} |" + " |" * (len(head) - 2))
            continue
        cells = [label, _fmt(_get(run, mode, "max", "req_s")), _fmt(_cpu(run, mode, "max"))]
        cells += [_fmt(_cpu(run, mode, f"rate_{r}")) for r in rates]
        cells += [f"{_fmt(_added(runs, name, mode, f'rate_{r}', 'p50'))} / "
                  f"{_fmt(_added(runs, name, mode, f'rate_{r}', 'p99'))}" for r in rates]
        cells.append(_fmt(_get(run, mode, f"rate_{rates[-1]}", "req_s")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(p: dict[str, Any], runs: dict[str, Any]) -> list[str]:
    found = [table(p, runs, mode) for mode in p["modes"]]
    profiled = {mode: _get(runs["gateway"], mode, "profile") for mode in p["modes"]}
    for mode, prof in profiled.items():
        if prof:
            found.append(f"py-spy, fairgate one worker at saturation, {MODE_LABELS[mode]}: "
                         + (prof["skipped"] if "skipped" in prof else
                            f"profile/{prof['speedscope']}, profile/{prof['flamegraph']}, "
                            f"summary profile/{prof['summary_text']}; by category: "
                            + ", ".join(f"{k} {v} %" for k, v in prof["categories_pct"])))
    return [*found, LITELLM_NOTE]


def figure(p: dict[str, Any], runs: dict[str, Any]) -> Any:
    fig, ax = report.figure("Added latency (instant backend, streamed)", "offered req/s",
                            "E2E p50 (ms)")
    for name, label in _proxy_names(p, runs):
        ys = [_get(runs[name], "streamed", f"rate_{r}", "e2e_ms", "p50") for r in p["rates"]]
        if any(y is not None for y in ys):
            ax.plot(p["rates"], ys, "-o", label=label.replace("*", ""))
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return fig
