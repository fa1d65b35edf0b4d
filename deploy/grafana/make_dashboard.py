"""Generate deploy/grafana/dashboards/fairgate.json (run: python deploy/grafana/make_dashboard.py).

The JSON is committed; tests/ops/test_grafana.py checks it is what this script makes and
that every query names metrics fairgate or vLLM really export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "dashboards" / "fairgate.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
RI = "$__rate_interval"
SLO_QUEUE_WAIT_S = 5
SLO_TPOT_S = 0.15


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                            "id": len(self.panels) + 1, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def add(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True}


def timeseries(title: str, targets: list[tuple[str, str]], unit: str = "short",
               thresholds: list[tuple[float, str]] | None = None, stack: bool = False,
               description: str = "") -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": True}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line+area"}
        steps += [{"color": color, "value": value} for value, color in thresholds]
    else:
        custom["thresholdsStyle"] = {"mode": "off"}
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in
                    enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom,
                                     "thresholds": {"mode": "absolute", "steps": steps}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom",
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def state_timeline(title: str, expr: str, legend: str) -> dict[str, Any]:
    return {
        "type": "state-timeline", "title": title, "datasource": DS,
        "targets": [target(expr, legend, "A")],
        "fieldConfig": {"defaults": {
            "mappings": [{"type": "value", "options": {
                "0": {"text": "closed", "color": "red"}, "1": {"text": "open", "color": "green"}}}],
            "thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                         {"color": "green", "value": 1}]},
            "color": {"mode": "thresholds"}}, "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8},
    }


def quantiles(metric: str, by: str, qs: tuple[float, ...]) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RI}])))",
             f"p{round(q * 100)} {{{{{by}}}}}") for q in qs]


def build() -> dict[str, Any]:
    lay = Layout()
    lay.row("Queues")
    lay.add(timeseries("Queued requests by class", [
        (f"max by (priority_class) (fairgate_queue_depth{{{M}}})", "{{priority_class}}")]))
    lay.add(timeseries("Oldest queued request by class", [
        (f"max by (priority_class) (fairgate_queue_oldest_wait_seconds{{{M}}})",
         "{{priority_class}}")], unit="s", thresholds=[(SLO_QUEUE_WAIT_S, "red")]))
    lay.add(timeseries("Top users: tokens/s", [
        (f"topk(10, sum by (user) (rate(fairgate_user_tokens_total{{{M}}}[{RI}])))",
         "{{user}}")], stack=True,
        description="The top users have their own series (metrics_top_users); the rest "
                    "is 'other'."))

    lay.row("Latency vs SLO (as clients see it)")
    lay.add(timeseries("Queue wait by class", quantiles(
        "fairgate_queue_wait_seconds", "priority_class", (0.5, 0.99)), unit="s",
        thresholds=[(SLO_QUEUE_WAIT_S, "red")],
        description=f"Interactive SLO: p99 < {SLO_QUEUE_WAIT_S}s (alert rule)."))
    lay.add(timeseries("Time to first token by class (streams)", quantiles(
        "fairgate_time_to_first_token_seconds", "priority_class", (0.5, 0.95, 0.99)), unit="s"))
    lay.add(timeseries("Time per output token by class (streams)", quantiles(
        "fairgate_time_per_output_token_seconds", "priority_class", (0.5, 0.99)), unit="s",
        thresholds=[(SLO_TPOT_S, "red")]))

    lay.row("Backends and gates")
    lay.add(state_timeline("Gate open per backend and class",
                           "min by (backend, priority_class) (fairgate_gate_open)",
                           "{{backend}} {{priority_class}}"), w=12)
    lay.add(timeseries("Gate closed time by reason", [
        (f"sum by (backend, reason) (rate(fairgate_gate_closed_seconds_total[{RI}]))",
         "{{backend}} {{reason}}")], unit="percentunit", stack=True,
        description="Fraction of time a class's gate was closed, summed over classes."), w=12)
    lay.add(timeseries("vLLM waiting / running", [
        ("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}"),
        ("sum by (instance) (vllm:num_requests_running)", "running {{instance}}"),
        ("max by (backend) (fairgate_backend_waiting_requests)", "gate view waiting {{backend}}"),
    ], thresholds=[(3, "orange")]))
    lay.add(timeseries("KV cache usage", [
        ("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}"),
        ("max by (backend) (fairgate_backend_kv_cache_usage_ratio)", "gate view {{backend}}"),
    ], unit="percentunit"))
    lay.add(timeseries("Backend TPOT", [
        ("max by (backend) (fairgate_backend_tpot_seconds)", "gate view {{backend}}"),
        (f"histogram_quantile(0.9, sum by (instance, le) "
         f"(rate(vllm:request_time_per_output_token_seconds_bucket[{RI}])))",
         "vLLM p90 {{instance}}"),
    ], unit="s", thresholds=[(SLO_TPOT_S, "red")]))
    lay.add(timeseries("Dispatches/s by backend and class", [
        (f"sum by (backend, priority_class) (rate(fairgate_dispatches_total{{{M}}}[{RI}]))",
         "{{backend}} {{priority_class}}")], unit="reqps", stack=True))
    lay.add(timeseries("vLLM priority rank of dispatches (p90)", quantiles(
        "fairgate_dispatch_priority_rank", "priority_class", (0.9,))))
    lay.add(timeseries("Backend health", [
        ("max by (backend) (fairgate_backend_healthy)", "healthy {{backend}}"),
        ("max by (backend) (fairgate_backend_drained)", "drained {{backend}}")]))
    lay.add(timeseries("Prefix cache hit rate: vLLM vs the gateway's index", [
        ("max by (backend) (fairgate_backend_prefix_cache_hit_ratio)", "vLLM {{backend}}"),
        (f"sum by (backend) (rate(fairgate_prefix_predicted_blocks_total{{kind=\"hit\"}}"
         f"[{RI}])) / sum by (backend) (rate(fairgate_prefix_predicted_blocks_total"
         f"{{kind=\"query\"}}[{RI}]))", "predicted {{backend}}"),
        (f"sum by (instance) (rate(vllm:prefix_cache_hits_total[{RI}])) / sum by (instance) "
         f"(rate(vllm:prefix_cache_queries_total[{RI}]))", "vLLM direct {{instance}}"),
    ], unit="percentunit",
        description="vLLM's own counters (hits / queries, tokens) beside what the prefix "
                    "index predicted at dispatch (routing: locality; blocks of the hashed "
                    "prompt head)."), w=12)
    lay.add(timeseries("Dispatch decisions by reason", [
        (f"sum by (reason) (rate(fairgate_dispatch_decisions_total{{{M}}}[{RI}]))",
         "{{reason}}")], unit="reqps", stack=True,
        description="cache_hit: sent where its prefix is cached; load: placed by load "
                    "(least_loaded, or the prefix's backend was too busy); fairness_order: "
                    "nothing cached anywhere, the fairness order's next."), w=12)
    lay.add(timeseries("Pending prefill tokens by backend", [
        ("max by (backend) (fairgate_backend_pending_prefill_tokens)", "{{backend}}"),
        (f"sum by (backend) (rate(fairgate_gate_closed_seconds_total"
         f"{{reason=\"prefill_tokens\"}}[{RI}]))", "gate held {{backend}} (s/s)")],
        description="Estimated uncached prompt tokens dispatched to each backend and maybe "
                    "not yet scheduled (the prefill-token gate's count), and the share of "
                    "time that count filled a class's max_waiting_prefill_tokens."), w=12)

    lay.row("Fairness")
    lay.add(timeseries("Service share per user", [
        (f"sum by (user) (rate(fairgate_user_service_total{{{M}}}[5m])) / ignoring (user) "
         f"group_left sum(rate(fairgate_user_service_total{{{M}}}[5m]))", "{{user}}")],
        unit="percentunit", stack=True,
        description="Weighted service (prompt × w_in + output × w_out) / key weight."), w=12)
    lay.add(timeseries("Requests dispatched per user", [
        (f"sum by (user) (rate(fairgate_user_requests_total{{{M}}}[{RI}]))", "{{user}}")],
        unit="reqps", stack=True), w=12)
    lay.add(timeseries("Share ratio: served ÷ entitled share (1 = fair)", [
        (f"max by (level, name) (fairgate_share_ratio{{{M}}})", "{{level}} {{name}}")],
        description="Each backlogged tenant's and user's share of the recent service (60 s "
                    "half-life, every replica's) over the share its weight entitles it to "
                    "among the backlogged. Every replica reports the same value (from "
                    "Redis)."), w=12)

    lay.row("Batch")
    lay.add(timeseries("Batch jobs by status", [
        ("max by (status) (fairgate_batch_jobs)", "{{status}}")]))
    lay.add(timeseries("Batch lines finished/s", [
        (f"sum by (outcome) (rate(fairgate_batch_requests_total[{RI}]))", "{{outcome}}")],
        unit="reqps", stack=True))
    lay.add(timeseries("Batch class: queued vs dispatched", [
        (f'max(fairgate_queue_depth{{{M},priority_class="batch"}})', "queued"),
        (f'sum(rate(fairgate_dispatches_total{{{M},priority_class="batch"}}[{RI}]))',
         "dispatched/s")]))

    lay.row("Reliability: continued answers and preemption")
    lay.add(timeseries("Preemptions/s by the preempted request's class", [
        (f"sum by (priority_class) (rate(fairgate_preemptions_total{{{M}}}[{RI}]))",
         "{{priority_class}}")], unit="reqps", stack=True,
        description="Running requests that gave their slot to a waiting request of a "
                    "higher class (docs/scheduling.md, preemption)"))
    lay.add(timeseries("Preemptions/s by the preempted user and class (top 10)", [
        (f"topk(10, sum by (user, priority_class) "
         f"(rate(fairgate_user_preemptions_total{{{M}}}[{RI}])))",
         "{{user}} {{priority_class}}")], unit="reqps", stack=True,
        description="Whose streams give their slot (fair preemption takes the most "
                    "over-served user's youngest stream; top users have their own series, "
                    "the rest is 'other')"))
    lay.add(timeseries("Tokens resent by preemption/s, and the allowance left", [
        (f"sum by (priority_class) "
         f"(rate(fairgate_preemption_recomputed_tokens_total{{{M}}}[{RI}]))",
         "resent/s {{priority_class}}"),
        (f"sum(fairgate_preemption_recompute_allowance_tokens{{{M}}})", "allowance")],
        description="What preemption costs (prompt plus generated, resent by the "
                    "continuation) against its budget: preempt_recompute_ratio of the "
                    "tokens served plus the burst (docs/scheduling.md)"))
    lay.add(timeseries("Continued answers/s by reason and outcome", [
        (f"sum by (reason, outcome) (rate(fairgate_continuations_total[{RI}]))",
         "{{reason}} {{outcome}}")], unit="reqps", stack=True))
    lay.add(timeseries("Tokens sent again by continuations/s (the cost)", [
        (f"sum by (reason) (rate(fairgate_continuation_recomputed_tokens_total[{RI}]))",
         "{{reason}}")]))
    lay.add(timeseries("Pause of a continued answer (p50, p90)", quantiles(
        "fairgate_continuation_pause_seconds", "reason", (0.5, 0.9)), unit="s"))

    lay.row("LoRA adapters")
    lay.add(timeseries("Adapters resident per backend, and its slots", [
        ("sum by (backend) (fairgate_backend_adapter_loaded)", "resident {{backend}}"),
        ("max by (backend) (fairgate_backend_lora_slots)", "slots {{backend}}")],
        description="Adapters each backend lists (docs/adapters.md) against vLLM's "
                    "--max-loras"))
    lay.add(timeseries("Adapter loads and unloads/s by outcome", [
        (f"sum by (outcome) (rate(fairgate_adapter_loads_total[{RI}]))", "load {{outcome}}"),
        (f"sum by (outcome) (rate(fairgate_adapter_unloads_total[{RI}]))",
         "unload {{outcome}}")], unit="ops", stack=True,
        description="Runtime loads (a request for an adapter resident nowhere) and the "
                    "unloads that made room for them"))
    lay.add(timeseries("Adapter requests held: loading or queued", [
        (f"sum by (adapter, state) (fairgate_adapter_requests{{{M}}})",
         "{{adapter}} {{state}}")], stack=True))
    lay.add(timeseries("Adapter wait to dispatch (p90), its load included", quantiles(
        "fairgate_adapter_wait_seconds", "adapter", (0.9,)), unit="s"))

    lay.row("Errors and Redis")
    lay.add(timeseries("Errors/s by status and type", [
        (f"sum by (status, type) (rate(fairgate_errors_total[{RI}]))", "{{status}} {{type}}")],
        unit="reqps", stack=True))
    lay.add(timeseries("Finished requests/s by status", [
        (f"sum by (status) (rate(fairgate_requests_total{{{M}}}[{RI}]))", "{{status}}")],
        unit="reqps", stack=True))
    lay.add(timeseries("Redis latency and errors", [
        *quantiles("fairgate_redis_command_duration_seconds", "command", (0.99,)),
        (f"sum(rate(fairgate_redis_errors_total[{RI}]))", "errors/s")], unit="s"))
    lay.add(timeseries("Event loop lag (p99, the busiest process)", [
        (f"max(histogram_quantile(0.99, sum by (instance, le) "
         f"(rate(fairgate_event_loop_lag_seconds_bucket[{RI}]))))", "p99")], unit="s",
        description="How late a gateway process's event loop ran a timer: a busy loop "
                    "delays every request that process serves by as much"))
    lay.add(timeseries("Dispatch decisions on a stale snapshot/s", [
        (f"sum by (backend) (rate(fairgate_dispatch_stale_view_total{{{M}}}[{RI}]))",
         "{{backend}}")], unit="reqps",
        description="Decisions that admitted nothing because the deciding process's gates "
                    "came from a snapshot older than the one before the backend's stored "
                    "one: a replica behind its backends' snapshots (a slow loop, a slow "
                    "Redis). Each such process decides again at its next snapshot."))

    return {
        "uid": "fairgate-overview", "title": "fairgate", "tags": ["fairgate", "vllm"],
        "schemaVersion": 39, "version": 1, "editable": True, "timezone": "browser",
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source",
             "query": "prometheus", "current": {"text": "Prometheus", "value": "prometheus"}},
            {"type": "query", "name": "model", "label": "Model", "datasource": DS,
             "query": {"query": "label_values(fairgate_queue_depth, model)", "refId": "model"},
             "definition": "label_values(fairgate_queue_depth, model)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
