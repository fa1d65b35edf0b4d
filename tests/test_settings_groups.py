"""The settings in groups by concern: each field declares whether a change needs a restart,
and the flat names of before the groups keep working (YAML, env, overrides), with one
deprecation line per name."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.core.config_file import ConfigFileInvalid, read_config_file
from gateway.core.settings import (
    FLAT,
    GROUPS,
    Settings,
    leaves,
    legacy,
    load_settings,
    restart_fields,
    value_at,
)

BACKEND = "backends: [{name: b0, url: 'http://127.0.0.1:9', model: m}]\n"


def test_every_flat_name_has_its_place_and_every_group_field_a_flat_name() -> None:
    paths = set(leaves())
    lost = {name: path for name, path in FLAT.items() if path not in paths}
    assert lost == {}, f"flat names mapped to no setting: {lost}"
    grouped = {f"{g}.{f}" for g, m in GROUPS.items() for f in m.model_fields}
    unmapped = grouped - set(FLAT.values()) - {"listen.host", "listen.port"}
    assert unmapped == set(), f"group fields without their old flat name: {unmapped}"
    assert FLAT["fairness"] == "fairness.policy" and FLAT["redis_url"] == "store.redis_url"


def test_the_settings_class_stays_small() -> None:
    lines = len(inspect.getsourcelines(Settings)[0])
    assert lines <= 300, f"Settings is {lines} lines: put new settings in a group"


def test_restart_is_declared_on_the_field() -> None:
    restart = restart_fields()
    for path in ("store.redis_url", "listen.port", "fairness.policy", "tenants",
                 "upstream.upstream_timeout_s", "operations.log_level"):
        assert restart.get(path), f"{path} is wired in at start: {sorted(restart)}"
    for path in ("upstream.stream_idle_timeout_s", "pacing.tpot_window_s", "classes",
                 "fleet.scrape_interval_s"):
        assert path not in restart, f"{path} is reloaded: {restart.get(path)}"


def test_flat_yaml_keys_read_as_their_groups_with_one_line_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(legacy, "_said", set())
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(BACKEND + "redis_url: redis://h:1/0\nfairness: round_robin\n"
                    "pacing: fixed\nscrape_interval_s: 0.25\nmax_moves: 7\n")
    nested.write_text(BACKEND + "store: {redis_url: 'redis://h:1/0'}\n"
                      "fairness: {policy: round_robin}\npacing: {mode: fixed}\n"
                      "fleet: {scrape_interval_s: 0.25}\nupstream: {max_moves: 7}\n")
    with capture_logs() as logs:
        old, new = read_config_file(flat), read_config_file(nested)
        read_config_file(flat)  # said once per name and process
    assert old.model_dump(exclude={"config_file"}) == new.model_dump(exclude={"config_file"})
    assert (old.store.redis_url, old.fairness.policy, old.pacing.mode,
            old.fleet.scrape_interval_s, old.upstream.max_moves) == (
        "redis://h:1/0", "round_robin", "fixed", 0.25, 7), old
    said = sorted((e["setting"], e["use"]) for e in logs if e["event"] == "setting_deprecated")
    assert said == [("fairness", "fairness.policy"), ("max_moves", "upstream.max_moves"),
                    ("pacing", "pacing.mode"), ("redis_url", "store.redis_url"),
                    ("scrape_interval_s", "fleet.scrape_interval_s")], said


def test_flat_env_vars_and_overrides_keep_their_precedence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(BACKEND + "fleet: {scrape_interval_s: 0.5, snapshot_stale_s: 2.0}\n"
                    "retry_after_s: 3\nrouting: locality\n")
    monkeypatch.setenv("FAIRGATE_SCRAPE_INTERVAL_S", "0.2")  # flat env over nested YAML
    monkeypatch.setenv("FAIRGATE_LIMITS__RETRY_AFTER_S", "5")  # nested env over flat YAML
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__NODES", "s1:1,s2:2")  # a flat prefix
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__MASTER_NAME", "m")
    monkeypatch.setenv("FAIRGATE_ROUTING", "least_loaded")
    s = load_settings(path)
    assert (s.fleet.scrape_interval_s, s.fleet.snapshot_stale_s) == (0.2, 2.0), s.fleet
    assert s.limits.retry_after_s == 5 and s.routing.mode == "least_loaded", s
    assert s.store.redis_sentinel is not None and s.store.redis_sentinel.addresses() == [
        ("s1", 1), ("s2", 2)], s.store
    # an override (the CLI's, a test's) beats both, flat or nested
    s = load_settings(path, scrape_interval_s=0.05, limits={"retry_after_s": 9})
    assert (s.fleet.scrape_interval_s, s.limits.retry_after_s) == (0.05, 9), s
    monkeypatch.setenv("FAIRGATE_REDIS_URL", "redis://h:2/0")
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__NODES")
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__MASTER_NAME")
    assert value_at(load_settings(path), "store.redis_url") == "redis://h:2/0"


def test_a_flat_key_error_is_one_line_at_its_new_place(tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    for text, words in (("max_queued_per_user: 0\n",
                         "limits.max_queued_per_user: Input should be greater than or equal to 1"),
                        ("fleet: {scrape_interval: 1}\n",
                         "fleet.scrape_interval: unknown key (did you mean scrape_interval_s?)"),
                        ("scrape_intervl_s: 1\n",
                         "scrape_intervl_s: unknown key (did you mean "
                         "fleet.scrape_interval_s?)")):
        path.write_text(BACKEND + text)
        with pytest.raises(ConfigFileInvalid) as bad:
            read_config_file(path)
        assert words in str(bad.value) and "\n" not in str(bad.value), str(bad.value)
