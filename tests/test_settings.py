from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.core.backend_names import check_backend_name, check_backend_url
from gateway.core.config_file import ConfigFileInvalid, read_config_file
from gateway.core.settings import (
    RedisCluster,
    RedisSentinel,
    Settings,
    addresses,
    load_settings,
)

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
    assert s.store.redis_url == "redis://127.0.0.1:6399/0"
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
    assert s.store.redis_cluster is not None and s.store.redis_url is None, s.store.redis_cluster
    assert s.store.redis_cluster.nodes == ["10.0.0.1:6379", "10.0.0.2:6379"]
    # what a worker process gets: the same cluster, the password included
    monkeypatch.delenv("FAIRGATE_REDIS_CLUSTER__NODES")
    monkeypatch.delenv("FAIRGATE_REDIS_CLUSTER__PASSWORD")
    monkeypatch.setenv("FAIRGATE_REDIS_CLUSTER", s.store.redis_cluster.env())
    again = load_settings().store.redis_cluster
    assert again is not None and again.password is not None, again
    assert again.nodes == s.store.redis_cluster.nodes
    assert again.password.get_secret_value() == "s3cret"
    with pytest.raises(ValidationError, match=r"not store\.redis_url and store\.redis_cluster"):
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
    assert s.store.redis_sentinel is not None
    assert s.store.redis_sentinel.addresses() == [("s1", 26379)]
    assert s.failover_wait_s() == s.store.store_failover_wait_s > 0 and not s.embedded_store()
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__NODES", "s1:26379, s2:26380")
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__PASSWORD", "pw")
    s = load_settings(path)
    assert s.store.redis_sentinel is not None
    sentinel = s.store.redis_sentinel
    assert sentinel.addresses() == [("s1", 26379), ("s2", 26380)], sentinel
    assert s.store.redis_sentinel.password is not None
    assert s.store.redis_sentinel.password.get_secret_value() == "pw"
    monkeypatch.setenv("FAIRGATE_REDIS_SENTINEL__NODES", '["s3:1"]')
    assert load_settings(path).store.redis_sentinel.nodes == ["s3:1"]  # type: ignore[union-attr]
    # a single Redis: an outage answers at once, as before
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__NODES")
    monkeypatch.delenv("FAIRGATE_REDIS_SENTINEL__PASSWORD")
    assert load_settings(None).failover_wait_s() == 0 and load_settings(None).embedded_store()


def test_redis_sentinel_and_url_are_exclusive_and_nodes_checked() -> None:
    sentinel = {"master_name": "m", "nodes": ["h:1"]}
    with pytest.raises(ValidationError, match=r"not store\.redis_url and store\.redis_sentinel"):
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
    assert per_model.fairness.fairness_scope == "model"
    assert per_model.cost_factor("llama-3.1-8b") == 1.0
    assert per_model.fleet_models() == []
    for extra, words in (
            ("fairness_scope: all\n", "fairness_scope: Input should be 'model' or 'fleet'"),
            ("cost_factors: {llama-3.1-8b: 0}\n", "cost_factors.llama-3.1-8b: Input should "
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


def test_tenant_shares_add_up_to_at_most_one_and_are_refused_on_one_line(
        tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(YAML + "tenants: {A: {min_share: 0.7}, B: {weight: 9, min_share: 0.3}}\n")
    s = read_config_file(path)
    assert (s.tenants["A"].min_share, s.tenants["B"].min_share) == (0.7, 0.3), s.tenants
    assert load_settings(None, tenants={"A": {}}).tenants["A"].min_share == 0.0
    for extra, words in (
            ("tenants: {A: {min_share: 0.7}, B: {min_share: 0.5}}\n",
             "tenants: the tenants' min_share add up to 1.2 (A 0.7, B 0.5): at most 1"),
            ("tenants: {A: {min_share: 1.5}}\n",
             "tenants.A.min_share: Input should be less than or equal to 1"),
            ("tenants: {A: {min_share: -0.1}}\n",
             "tenants.A.min_share: Input should be greater than or equal to 0")):
        path.write_text(YAML + extra)
        with pytest.raises(ConfigFileInvalid) as bad:
            read_config_file(path)
        assert words in str(bad.value) and "\n" not in str(bad.value), (extra, str(bad.value))


def _models(kind: Any, seen: set[type[BaseModel]]) -> None:
    """Every pydantic model reachable from ``kind`` (through lists, dicts, unions)."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        if kind in seen:
            return
        seen.add(kind)
        for field in kind.model_fields.values():
            _models(field.annotation, seen)
        return
    for arg in typing.get_args(kind):
        _models(arg, seen)


def test_every_config_model_refuses_unknown_keys() -> None:
    """issue 43: a typo in a backend, key or class entry was dropped without a word."""
    models: set[type[BaseModel]] = set()
    _models(Settings, models)
    names = {m.__name__ for m in models}
    assert {"Backend", "ApiKey", "ClassConfig", "ListenSettings", "Tenant", "Adapter", "Discovery",
            "Autoscale", "UsageLimits", "RedisSentinel", "RedisCluster"} <= names, names
    lax = sorted(m.__name__ for m in models if m.model_config.get("extra") != "forbid")
    assert lax == [], f"config models that ignore unknown keys: {lax}"


@pytest.mark.parametrize(("entry", "words"), [
    ("backends:\n  - {name: b1, url: http://127.0.0.1:8100, model: m}\n"
     "  - {name: b2, url: http://127.0.0.1:8101, model: m, role: prefill}\n",
     "backends.1.role: unknown key"),
    ("backends:\n  - {name: b1, url: http://127.0.0.1:8100, model: m, "
     "max_promt_tokens: 10}\n",
     "backends.0.max_promt_tokens: unknown key (did you mean max_prompt_tokens?)"),
    ("api_keys:\n  - {key: sk-a, user: a, tenent: t}\n",
     "api_keys.0.tenent: unknown key (did you mean tenant?)"),
    ("classes:\n  batch: {max_waitng: 2}\n",
     "classes.batch.max_waitng: unknown key (did you mean max_waiting?)"),
    ("listen: {hots: 0.0.0.0}\n", "listen.hots: unknown key (did you mean host?)"),
    ("tenants: {t: {wieght: 2}}\n", "tenants.t.wieght: unknown key (did you mean weight?)"),
    ("tenants: {t: {limits: {rmp: 2}}}\n",
     "tenants.t.limits.rmp: unknown key (did you mean rpm?)"),
    ("adapters: [{name: sql, base_model: m, runtme: true}]\n",
     "adapters.0.runtme: unknown key (did you mean runtime?)"),
    ("discovery: [{dns_name: vllm, port: 8000, model: m, refresh: 1}]\n",
     "discovery.0.refresh: unknown key (did you mean refresh_s?)"),
    ("autoscale: {min_replica: 1}\n",
     "autoscale.min_replica: unknown key (did you mean min_replicas?)"),
])
def test_an_unknown_key_is_named_with_its_place(entry: str, words: str, tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    base = "backends: [{name: b0, url: 'http://127.0.0.1:9', model: m}]\n"
    path.write_text(entry if entry.startswith("backends") else base + entry)
    with pytest.raises(ConfigFileInvalid) as bad:
        read_config_file(path)
    message = str(bad.value)
    assert words in message, message
    assert "\n" not in message and "Extra inputs" not in message, message


ONE_BACKEND = "backends: [{name: b0, url: 'http://127.0.0.1:9', model: m}]\n"


@pytest.mark.parametrize(("text", "words"), [
    # every request of the class would wait past a deadline already gone: 504s
    (ONE_BACKEND + "classes: {batch: {max_waiting: -5}}\n",
     "classes.batch.max_waiting: Input should be greater than or equal to 0"),
    (ONE_BACKEND + "classes: {default: {max_queue_wait_s: -1}}\n",
     "classes.default.max_queue_wait_s: Input should be greater than 0"),
    (ONE_BACKEND + "classes: {default: {max_tpot_ms: 0}}\n",
     "classes.default.max_tpot_ms: Input should be greater than 0"),
    (ONE_BACKEND + "classes: {default: {max_kv_usage: 0}}\n",
     "classes.default.max_kv_usage: Input should be greater than 0"),
    ("backends: [{name: b0, url: 'ftp://127.0.0.1:9', model: m}]\n",
     "backends.0.url: must be an http:// or https:// URL with a host"),
    ("backends: [{name: b0, url: \"http://127.0.0.1:9/a\\r\\nX-Evil: 1\", model: m}]\n",
     "backends.0.url: must not hold a space or a control character"),
    ("backends: [{name: b0, url: 'http://127.0.0.1:9/a b', model: m}]\n",
     "backends.0.url: must not hold a space or a control character"),
    ("backends: [{name: b0, url: 'http://u:secret@127.0.0.1:9', model: m}]\n",
     "backends.0.url: must not carry credentials"),
    # one of the two was dropped without a word
    ("backends:\n  - {name: b0, url: 'http://127.0.0.1:9', model: m}\n"
     "  - {name: b0, url: 'http://127.0.0.1:10', model: m}\n",
     "backends.1.name: 'b0' is also the name of backends.0"),
    ("backends: [{name: '..', url: 'http://127.0.0.1:9', model: m}]\n",
     "backends.0.name: '..' is not a backend name"),
    # one secret for two users: the second was served as the first
    (ONE_BACKEND + "api_keys: [{key: sk-a, user: a}, {key: sk-a, user: b}]\n",
     "api_keys.1.key: the same secret as api_keys.0"),
    (ONE_BACKEND + "api_keys: [{key: sk-a, user: a, id: k1}, {key: sk-b, user: b, id: k1}]\n",
     "api_keys.1.id: 'k1' is also the id of api_keys.0"),
    # an API key's holder would run the admin routes, an admin served as that user
    (ONE_BACKEND + "api_keys: [{key: sk-a, user: a}]\nadmin_keys: [sk-b, sk-a]\n",
     "admin_keys.1: the same secret as api_keys.0"),
])
def test_settings_that_break_service_are_refused(text: str, words: str, tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileInvalid) as bad:
        read_config_file(path)
    assert words in str(bad.value), str(bad.value)
    assert "secret@" not in str(bad.value) and "sk-a" not in str(bad.value), str(bad.value)


def test_the_config_and_the_admin_api_share_one_backend_check() -> None:
    for name in ("b0", "gpu-1.pool_a", "A" * 64):
        assert check_backend_name(name) == name
    for name in ("", ".", "..", "-a", "a/b", "a b", "a\r\n", "é", "a:b", "A" * 65):
        with pytest.raises(ValueError, match="is not a backend name"):
            check_backend_name(name)
    assert check_backend_url("https://vllm-0.vllm:8000/") == "https://vllm-0.vllm:8000"
    assert check_backend_url("http://[::1]:8000/prefix") == "http://[::1]:8000/prefix"
    for url in ("ftp://h:1", "http://", "h:1", "http://h:99999", "http://h:1/?q=1",
                "http://h:1/#f", "http://h:1/a\tb", "http://h:1\n", "http://h:1/\x7f"):
        with pytest.raises(ValueError):
            check_backend_url(url)
    # a configured backend's URL is what the admin API would keep (no trailing '/')
    s = load_settings(None, backends=[{"name": "b0", "url": "http://h:1/", "model": "m"}])
    assert s.backends[0].url == "http://h:1", s.backends[0].url
