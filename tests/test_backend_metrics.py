from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.published import Published
from gateway.backends.vllm_metrics import (
    OUTPUT,
    PREFIX_CACHE,
    SERVICE,
    WANTED,
    HistogramWindow,
    LoraState,
    MetricsFormatError,
    parse_metrics,
)

# a real vLLM 0.32 CPU server's /metrics with 16 running and 16 waiting
REFERENCE = Path(__file__).parent / "data" / "vllm-0.32-cpu-metrics-under-load.txt"


def test_parses_real_vllm_output() -> None:
    raw = parse_metrics(REFERENCE.read_text())
    assert raw.running == 16 and raw.waiting == 16
    assert 0.0 <= raw.kv_usage <= 1.0
    s, c = raw.sums["vllm:request_time_per_output_token_seconds"]
    assert c > 0 and s > 0


def full_parse(text: str) -> dict[str, float]:
    """The wanted samples as prometheus_client's full exposition parser reads them, summed
    over their labels: the reference the line filter must match."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_line_filter_reads_what_the_full_parse_reads() -> None:
    text = REFERENCE.read_text()
    full, raw = full_parse(text), parse_metrics(text)
    seen = {"vllm:num_requests_running": raw.running, "vllm:num_requests_waiting": raw.waiting,
            "vllm:kv_cache_usage_perc": raw.kv_usage}
    for name, (total, count) in raw.sums.items():
        seen[name + "_sum"], seen[name + "_count"] = total, count
    assert raw.prefix_cache is not None
    seen["vllm:prefix_cache_hits_total"], seen["vllm:prefix_cache_queries_total"] = \
        raw.prefix_cache
    seen.update(raw.counters)
    assert seen == pytest.approx(full), f"line filter {seen} != full parse {full}"
    # running, waiting, kv, TPOT, ITL, TTFT, prefix, and the 4 service counters
    assert len(seen) == 15, sorted(seen)


def test_line_filter_skips_lookalike_families_and_reads_bare_samples() -> None:
    text = "\n".join([
        'vllm:num_requests_running_by_thing{engine="0"} 9',  # a longer name: not ours
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9',
        'vllm:num_requests_running{engine="0",model_name="a}b"} 2',  # a brace in a label
        "vllm:num_requests_running 3 1700000000000",  # no labels, a timestamp
        'vllm:num_requests_waiting{engine="0"} 1.5e0',
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 7',
        "",
    ])
    raw = parse_metrics(text)
    assert (raw.running, raw.waiting, raw.sums) == (5, 1.5, {}), raw


def test_line_filter_rejects_a_garbled_sample() -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics("vllm:num_requests_running{engine=\"0\"} many\n")


def test_sums_over_engines_and_reads_old_names() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2',
        'vllm:num_requests_running{engine="1",model_name="m"} 3',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 4',
        "# TYPE vllm:gpu_cache_usage_perc gauge",
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "# TYPE vllm:time_per_output_token_seconds histogram",
        'vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 2.0',
        'vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 40',
        "",
    ])
    raw = parse_metrics(text)
    assert (raw.running, raw.waiting, raw.kv_usage) == (5, 5, 0.25)
    assert raw.sums == {"vllm:time_per_output_token_seconds": (2.0, 40)}


def test_rejects_non_vllm_text() -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics("# TYPE x gauge\nx 1\n")


def test_tpot_window_uses_recent_delta_not_lifetime_mean() -> None:
    name = "vllm:request_time_per_output_token_seconds"
    w = HistogramWindow(window_s=5.0)
    assert w.add(0.0, {name: (100.0, 100)}) is None  # lifetime mean 1 s is ignored
    assert w.add(1.0, {name: (101.0, 200)}) == pytest.approx(0.01)
    assert w.add(10.0, {name: (111.0, 300)}) == pytest.approx(0.1)  # old point expired
    assert w.add(11.0, {name: (111.0, 300)}) == pytest.approx(0.1)
    assert w.add(20.0, {name: (111.0, 300)}) is None  # nothing finished recently


def test_reads_the_prefix_cache_counters_new_and_old_names() -> None:
    assert parse_metrics(REFERENCE.read_text()).prefix_cache == (3968.0, 13017.0)
    old = "\n".join([
        "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 0",
        "# TYPE vllm:num_requests_waiting gauge", "vllm:num_requests_waiting 0",
        "# TYPE vllm:gpu_prefix_cache_queries counter",
        'vllm:gpu_prefix_cache_queries_total{engine="0"} 100',
        'vllm:gpu_prefix_cache_queries_total{engine="1"} 60',
        "# TYPE vllm:gpu_prefix_cache_hits counter",
        'vllm:gpu_prefix_cache_hits_total{engine="0"} 40', "",
    ])
    assert parse_metrics(old).prefix_cache == (40.0, 160.0)
    none = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n" \
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    assert parse_metrics(none).prefix_cache is None


def test_prefix_hit_rate_is_recent_not_lifetime() -> None:
    w = HistogramWindow(window_s=5.0, names=(PREFIX_CACHE,))
    assert w.add(0.0, {PREFIX_CACHE: (0.0, 1000.0)}) is None  # lifetime: no hits at all
    assert w.add(1.0, {PREFIX_CACHE: (90.0, 1100.0)}) == pytest.approx(0.9)
    assert w.add(10.0, {PREFIX_CACHE: (90.0, 1200.0)}) == pytest.approx(0.0)  # 1.0 expired
    assert w.add(20.0, {PREFIX_CACHE: (90.0, 1200.0)}) is None  # no queries recently
    assert w.add(21.0, {PREFIX_CACHE: (0.0, 0.0)}) is None  # a restarted server


def test_the_service_counters_give_tokens_computed_and_requests_finished() -> None:
    raw = parse_metrics(REFERENCE.read_text())
    # prompt 13,017 of which 3,968 cached, 18,023 generated; 83 finished (by length)
    assert raw.service == (13017.0 - 3968.0 + 18023.0, 83.0)
    assert raw.output == (18023.0, 83.0)
    bare = parse_metrics("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    assert bare.service is None and bare.output is None


def test_service_rates_are_per_second_over_the_window() -> None:
    window = HistogramWindow(30.0, (OUTPUT,))
    assert window.rates(SERVICE) is None
    window.add(100.0, {SERVICE: (1000.0, 10.0), OUTPUT: (600.0, 10.0)})
    assert window.rates(SERVICE) is None  # one sample: no rate yet
    window.add(110.0, {SERVICE: (3000.0, 30.0), OUTPUT: (1800.0, 30.0)})
    assert window.rates(SERVICE) == pytest.approx((200.0, 2.0))
    # the mean output per finished request over the window
    assert window.add(120.0, {SERVICE: (5000.0, 50.0), OUTPUT: (3000.0, 50.0)}) == \
        pytest.approx(60.0)
    # a sample older than the window leaves it: the rate is the recent one
    window.add(150.0, {SERVICE: (5000.0, 50.0), OUTPUT: (3000.0, 50.0)})
    assert window.rates(SERVICE) == pytest.approx((0.0, 0.0))


LORA_INFO_LINE = ('vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{0}",'
                  'waiting_lora_adapters="{0}"}} {1}')
LORA_TEXT = "\n".join([
    "# TYPE vllm:lora_requests_info gauge",
    LORA_INFO_LINE.format("", "1.7e9"),
    LORA_INFO_LINE.format("sql,chat", "1.7000000052e9"),
    LORA_INFO_LINE.format("sql", "1.7000000031e9"),
    'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
]) + "\n"


def test_the_newest_lora_series_is_the_current_state() -> None:
    """vLLM keeps every label combination of its LoRA gauge, each set to the time it
    was last seen: the newest one, not the last line, is what runs now."""
    lora = parse_metrics(LORA_TEXT).lora
    assert lora is not None and (lora.max_lora, lora.active) == (2, ("chat", "sql")), lora
    assert parse_metrics(REFERENCE.read_text()).lora is None  # no --enable-lora there


def test_published_snapshot_carries_adapters_and_lora() -> None:
    shared = Published({}, {}, 0, None, None, {}, None, True, ("sql",), LoraState(2, ("sql",)))
    back = Published.decode(shared.encode())
    assert (back.adapters, back.lora) == (("sql",), LoraState(2, ("sql",))), back
