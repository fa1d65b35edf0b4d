from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.core.settings import RedisCluster, RedisSentinel, addresses, load_settings

YAML = """
redis_url: redis://127.0.0.1:6399/0
listen: {host: 127.0.0.1, port: 8000}
backends:
  - {name: b1, url: http://127.0.0.1:8100, model: llama-3.1-8b}
api_keys:
  - {key: sk-alice, user: alice, priority_class: interactive, weight: 1}
  - {key: sk-app, user: app, priority_class: default, trusted_end_users: true}
admin_keys: [sk-admin]
classes:
  batch: {max_waiting: 2}
"""


def test_yaml_then_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(YAML)
    monkeypatch.setenv("FAIRGATE_LISTEN__PORT", "9001")
    monkeypatch.setenv("FAIRGATE_CONFIG", str(path))
    s = load_settings()
    assert s.listen.port == 9001 and s.listen.host == "127.0.0.1"
    assert s.redis_url == "redis://127.0.0.1:6399/0"
    assert [k.user for k in s.api_keys] == ["alice", "app"] and s.api_keys[1].trusted_end_users
    assert s.models() == ["llama-3.1-8b"]
    # a partial class entry keeps the class's other defaults
    assert s.classes["batch"].max_waiting == 2 and s.classes["batch"].priority_base == 2000
    assert s.classes["interactive"].max_waiting == 3 and s.classes["interactive"].max_tpot_ms == 150


def test_missing_file_and_bad_values_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "nope.yaml")
    with pytest.raises(ValidationError):
        load_settings(None, classes={"urgent": {}})
    with pytest.raises(ValidationError):
        load_settings(None, api_keys=[{"key": "k", "user": "u", "priority_class": "vip"}])
    # a body limit or per-user queue cap below 1 was accepted: no request could pass it
    for field in ("max_body_bytes", "max_queued_per_user"):
        for bad in (0, -1):
            with pytest.raises(ValidationError, match=field):
                load_settings(None, **{field: bad})


def test_a_redis_cluster_from_env_and_one_store_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIRGATE_REDIS_CLUSTER__NODES", '["10.0.0.1:6379", "10.0.0.2:6379"]')
    monkeypatch.setenv("FAIRGATE_REDIS_CLUSTER__PASSWORD", "s3cret")
    s = load_settings()
    assert s.redis_cluster is not None and s.redis_url is None, s.redis_cluster
    assert s.redis_cluster.nodes == ["10.0.0.1:6379", "10.0.0.2:6379"]
    # what a worker process gets: the same cluster, the password included
    monkeypatch.delenv("FAIRGATE_REDIS_CLUSTER__NODES")
    monkeypatch.delenv("FAIRGATE_REDIS_CLUSTER__PASSWORD")
    monkeypatch.setenv("FAIRGATE_REDIS_CLUSTER", s.redis_cluster.env())
    again = load_settings().redis_cluster
    assert again is not None and again.password is not None, again
    assert again.nodes == s.redis_cluster.nodes and again.password.get_secret_value() == "s3cret"
    with pytest.raises(ValidationError, match="not redis_url and redis_cluster"):
        load_settings(redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValidationError, match="is not host:port"):
        load_settings(redis_url=None, redis_cluster={"nodes": ["10.0.0.1"]})
    monkeypatch.delenv("FAIRGATE_REDIS_CLUSTER")
    with pytest.raises(ValidationError):
        load_settings(redis_cluster={"nodes": []})
    assert load_settings(redis_cluster={"nodes": ["h:1"]}).failover_wait_s() > 0


def test_redis_sentinel_from_yaml_and_env(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text("redis_sentinel: {master_name: fairgate, nodes: ['s1:26379']}\n")
    s = load_settings(path)
    assert s.redis_sentinel is not None and s.redis_sentinel.addresses() == [("s1", 26379)]
    assert s.failover_wait_s() == s.store_failover_wait_s > 0 and not s.embedded_store()
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__NODES", "s1:26379, s2:26380")
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__PASSWORD", "pw")
    s = load_settings(path)
    assert s.redis_sentinel is not None
    assert s.redis_sentinel.addresses() == [("s1", 26379), ("s2", 26380)], s.redis_sentinel
    assert s.redis_sentinel.password is not None
    assert s.redis_sentinel.password.get_secret_value() == "pw"
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__NODES", '["s3:1"]')
    assert load_settings(path).redis_sentinel.nodes == ["s3:1"]  # type: ignore[union-attr]
    # a single Redis: an outage answers at once, as before
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__NODES")
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__PASSWORD")
    assert load_settings(None).failover_wait_s() == 0 and load_settings(None).embedded_store()


def test_redis_sentinel_and_url_are_exclusive_and_nodes_checked() -> None:
    sentinel = {"master_name": "m", "nodes": ["h:1"]}
    with pytest.raises(ValidationError, match="not redis_url and redis_sentinel"):
        load_settings(None, redis_url="redis://x:1/0", redis_sentinel=sentinel)
    with pytest.raises(ValidationError, match="is not host:port"):
        load_settings(None, redis_sentinel={"master_name": "m", "nodes": ["h"]})
    with pytest.raises(ValidationError):
        load_settings(None, redis_sentinel={"master_name": "m", "nodes": []})


def test_redis_nodes_are_read_alike_for_cluster_and_sentinel() -> None:
    """One reading of "host:port" for both topologies; an IPv6 host loses its brackets."""
    nodes = ["10.0.0.1:6379", "[::1]:26379"]
    cluster = RedisCluster(nodes=nodes)
    sentinel = RedisSentinel(master_name="m", nodes=",".join(nodes))
    want = [("10.0.0.1", 6379), ("::1", 26379)]
    assert addresses(cluster.nodes) == want, addresses(cluster.nodes)
    assert sentinel.addresses() == want, sentinel.addresses()


def test_fairness_scope_and_cost_factors_are_checked_clearly(tmp_path: Path) -> None:
    from gateway.core.config_file import ConfigFileInvalid, read_config_file

    two = YAML.replace("backends:\n", "backends:\n  - {name: b2, url: http://127.0.0.1:8101,"
                       " model: llama-3.1-70b}\n")
    path = tmp_path / "fairgate.yaml"
    path.write_text(two + "fairness_scope: fleet\ncost_factors: {llama-3.1-70b: 8}\n")
    s = read_config_file(path)
    assert (s.cost_factor("llama-3.1-70b"), s.cost_factor("llama-3.1-8b")) == (8.0, 1.0)
    assert s.fleet_models() == ["llama-3.1-70b", "llama-3.1-8b"], s.fleet_models()
    per_model = load_settings(None, cost_factors={"llama-3.1-8b": 4.0},
                              backends=[{"name": "b", "url": "http://h", "model": "llama-3.1-8b"}])
    assert per_model.fairness_scope == "model" and per_model.cost_factor("llama-3.1-8b") == 1.0
    assert per_model.fleet_models() == []
    for extra, words in (
            ("fairness_scope: all\n", "fairness_scope Input should be 'model' or 'fleet'"),
            ("cost_factors: {llama-3.1-8b: 0}\n", "cost_factors.`llama-3.1-8b` Input should "
             "be greater than 0"),
            ("cost_factors: {llama-3.1-8b: .inf}\n", "Input should be a finite number"),
            ("cost_factors: {llama-3.1-8b: cheap}\n", "Input should be a valid number"),
            ("cost_factors: {gpt-4: 2}\n", "cost_factors: 'gpt-4' is not a served model "
             "(llama-3.1-70b, llama-3.1-8b)"),
            ("adapters: [{name: sql, base_model: llama-3.1-8b}]\ncost_factors: {sql: 2}\n",
             "cost_factors: 'sql' is an adapter: its requests count at its base model's "
             "factor ('llama-3.1-8b')"),
            ("fairness_scope: fleet\nredis_cluster: {nodes: ['h:1']}\n",
             "fairness_scope fleet needs one Redis")):
        alone = "redis_cluster" in extra  # one store only: the cluster instead of the URL
        path.write_text((two.replace("redis_url: redis://127.0.0.1:6399/0\n", "") if alone
                         else two) + extra)
        with pytest.raises(ConfigFileInvalid) as bad:
            read_config_file(path)
        assert words in str(bad.value), (extra, str(bad.value))
