"""Calibration of the pure roofline step model."""

from __future__ import annotations

import pytest

from loadtest.sim.profiles import DEFAULT_PROFILE, PROFILES

H100 = PROFILES[DEFAULT_PROFILE]


def test_default_profile_is_h100_llama() -> None:
    assert DEFAULT_PROFILE == "h100-llama3.1-8b"
    assert {"instant", "cpu-tiny"} <= set(PROFILES)


def test_decode_step_small_batch_is_4_8_ms() -> None:
    # 8 decodes with 512 tokens of context each.
    assert H100.step_time_s(8, 8 * 512) == pytest.approx(4.8e-3, rel=0.10)


def test_2000_token_prefill_step_is_32_ms() -> None:
    assert H100.step_time_s(2000, 2000) == pytest.approx(32e-3, rel=0.10)


def test_ridge_point_is_295_tokens() -> None:
    assert H100.ridge_tokens == pytest.approx(295, rel=0.02)
    below = H100.step_time_s(200, 200) - H100.step_overhead_s
    above = H100.step_time_s(400, 400) - H100.step_overhead_s
    weights_s = H100.weight_bytes / H100.mem_bw_bytes_s
    assert below < weights_s * 1.01  # memory bound: flat in batch size
    assert above > weights_s * 1.2  # compute bound: grows with tokens


def test_kv_reads_lengthen_decode() -> None:
    assert H100.step_time_s(256, 256 * 4000) > 2 * H100.step_time_s(1, 1000)


def test_instant_profile_costs_nothing() -> None:
    assert PROFILES["instant"].step_time_s(4096, 100_000) == 0.0
    assert H100.step_time_s(0, 0) == 0.0
