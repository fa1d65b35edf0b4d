"""Structural checks of deploy/ and of helm/'s values: no Docker engine needed.

The chart itself is rendered with Helm's engine and schema-validated in test_helm_chart.py."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.core.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = ROOT / "helm" / "fairgate"
TEMPLATES = CHART / "templates"

GPU_COMPOSE = DEPLOY / "docker-compose.yml"
SIM_COMPOSE = DEPLOY / "docker-compose.sim.yml"
COMPOSE_FILES = [GPU_COMPOSE, SIM_COMPOSE]
GATEWAY_CONFIG_KEYS = {
    "store",
    "listen",
    "backends",
    "api_keys",
    "admin_keys",
    "classes",
    "fairness",
}
PRIORITY_CLASSES = {"interactive", "default", "batch"}
VLLM_PROFILES = sorted((DEPLOY / "vllm").glob("*.sh"))


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def services(compose: Path) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = load(compose)["services"]
    return data


def command_list(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def is_gateway(service: dict[str, Any]) -> bool:
    return command_list(service)[:1] == ["serve"]


def with_defaults(text: str) -> str:
    """Compose interpolation with an empty environment: ${VAR:-default} -> default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", text)


def is_vllm(service: dict[str, Any]) -> bool:
    return with_defaults(str(service.get("image", ""))).split(":")[0] == "vllm/vllm-openai"


def is_sim(service: dict[str, Any]) -> bool:
    return command_list(service)[:1] == ["sim"]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return [d for d in reservations.get("devices", []) if d.get("driver") == "nvidia"]


def mounted_config(service: dict[str, Any], compose: Path) -> Path:
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if target == "/etc/fairgate/config.yaml":
            return (compose.parent / source).resolve()
    raise AssertionError(
        f"no volume mounted at /etc/fairgate/config.yaml: {service.get('volumes')}"
    )


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# --- docker compose -------------------------------------------------------------------


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_parses_with_two_gateway_replicas_and_redis_aof(compose: Path) -> None:
    svcs = services(compose)
    gateways = [n for n, s in svcs.items() if is_gateway(s)]
    assert len(gateways) == 2, gateways
    redis = svcs["redis"]
    assert str(redis["image"]).startswith("redis:7")
    assert flag_value(command_list(redis), "--appendonly") == "yes"
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"])
    named_volumes = set(load(compose).get("volumes") or {})
    assert redis["volumes"][0].split(":")[0] in named_volumes
    for name in gateways:
        assert svcs[name]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert "redis" in svcs[name]["depends_on"]


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_gateway_replicas_share_a_writable_data_dir(compose: Path) -> None:
    """Batch API files live under data_dir: both replicas must see the same directory."""
    svcs = services(compose)
    mounts = set()
    for svc in (s for s in svcs.values() if is_gateway(s)):
        data_dir = svc["environment"]["FAIRGATE_STORE__DATA_DIR"]
        (mount,) = [v for v in svc["volumes"] if v.split(":")[1] == data_dir]
        mounts.add(mount)
    (mount,) = mounts  # the same named volume in every replica
    assert mount.split(":")[0] in (load(compose).get("volumes") or {})
    # a fresh named volume takes the image directory's owner: the gateway's user
    text = (DEPLOY / "Dockerfile").read_text()
    data_dir = mount.split(":")[1]
    assert re.search(rf"chown 10001 {re.escape(data_dir)}\b", text)
    assert re.search(r"^USER 10001$", text, re.M)


def test_dockerfile_builds_from_python_slim_and_installs_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"^RUN pip install \.", text, re.M)
    assert "EXPOSE 8000" in text
    # compose builds with the repo root as context
    for compose in COMPOSE_FILES:
        for svc in services(compose).values():
            if "build" in svc:
                assert (compose.parent / svc["build"]["context"]).resolve() == ROOT


@pytest.mark.parametrize(
    ("compose", "config_name"),
    [(GPU_COMPOSE, "gateway.yaml"), (SIM_COMPOSE, "gateway.sim.yaml")],
    ids=["gpu", "sim"],
)
def test_gateway_config_exists_and_names_backend_services(compose: Path, config_name: str) -> None:
    svcs = services(compose)
    for svc in (s for s in svcs.values() if is_gateway(s)):
        config_path = mounted_config(svc, compose)
        assert config_path == DEPLOY / "config" / config_name
        config = load(config_path)
        assert GATEWAY_CONFIG_KEYS <= set(config), GATEWAY_CONFIG_KEYS - set(config)
        assert config["listen"]["port"] == 8000
        assert config["fairness"]["policy"] in {"vtc", "round_robin"}
        assert set(config["classes"]) == PRIORITY_CLASSES
        for gates in config["classes"].values():
            assert {"max_waiting", "max_tpot_ms"} <= set(gates)
        assert config["classes"]["batch"]["max_waiting"] <= 1  # batch only on an empty queue
        host = re.match(r"redis://([^:/]+)", config["store"]["redis_url"])
        assert host and host.group(1) in svcs
        for key in config["api_keys"]:
            assert {"key", "user", "priority_class"} <= set(key)
            assert key["priority_class"] in PRIORITY_CLASSES
        assert config["admin_keys"]
        backends = config["backends"]
        assert backends
        assert len({b["name"] for b in backends}) == len(backends)
        for backend in backends:
            host = re.match(r"http://([^:/]+):(\d+)$", backend["url"])
            assert host, backend["url"]
            assert host.group(1) in svcs, f"backend {backend['url']} names no compose service"
            backend_svc = svcs[host.group(1)]
            assert is_vllm(backend_svc) or is_sim(backend_svc)
            args = command_list(backend_svc)
            served = flag_value(args, "--served-model-name") or flag_value(args, "--model")
            assert served == backend["model"]
            assert backend["model"] in args


def test_every_vllm_service_has_contract_flags_and_one_gpu() -> None:
    svcs = services(GPU_COMPOSE)
    vllm = {n: s for n, s in svcs.items() if is_vllm(s)}
    assert len(vllm) >= 1
    pinned: list[str] = []
    for name, svc in vllm.items():
        args = command_list(svc)
        assert "--enable-chunked-prefill" in args, name
        assert flag_value(args, "--scheduling-policy") == "priority", name
        assert flag_value(args, "--model") == "meta-llama/Llama-3.1-8B-Instruct"
        assert flag_value(args, "--served-model-name") == "llama-3.1-8b"
        assert flag_value(args, "--max-num-batched-tokens") == "2048"
        assert flag_value(args, "--max-num-seqs") == "256"
        assert flag_value(args, "--gpu-memory-utilization") == "0.92"
        assert any("HF_TOKEN" in str(v) for v in svc["environment"].values())
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        devices = gpu_devices(svc)
        assert len(devices) == 1, name
        assert devices[0]["capabilities"] == ["gpu"]
        ids = devices[0].get("device_ids")
        assert devices[0].get("count") == 1 or (ids and len(ids) == 1), name
        pinned.extend(ids or [])
    # Two servers must not share a GPU: the id defaults (${VAR:-N}) differ.
    defaults = [with_defaults(i) for i in pinned]
    assert len(set(defaults)) == len(defaults), defaults


def test_sim_stack_has_no_gpu_and_runs_fairgate_sim() -> None:
    svcs = services(SIM_COMPOSE)
    assert not any(gpu_devices(s) for s in svcs.values())
    assert not any(is_vllm(s) for s in svcs.values())
    sims = [s for s in svcs.values() if is_sim(s)]
    assert len(sims) == 2
    for svc in sims:
        args = command_list(svc)
        assert flag_value(args, "--scheduling-policy") == "priority"
        assert flag_value(args, "--profile") == "h100-llama3.1-8b"
        assert flag_value(args, "--model") == "llama-3.1-8b"
        assert flag_value(args, "--port") == "8000"


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_prometheus_scrapes_services_of_its_compose_file(compose: Path) -> None:
    svcs = services(compose)
    prom = svcs["prometheus"]
    config_file = flag_value(command_list(prom), "--config.file")
    assert config_file
    mount = next(v for v in prom["volumes"] if v.startswith("./prometheus:"))
    container_dir = mount.split(":")[1]
    rel = Path(config_file).relative_to(container_dir)
    config = load(DEPLOY / "prometheus" / rel)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {
        name: [t for sc in job["static_configs"] for t in sc["targets"]]
        for name, job in jobs.items()
    }
    for job, hosts in targets.items():
        for target in hosts:
            host = target.split(":")[0]
            assert host == "localhost" or host in svcs, f"{job}: {target} is no service"
    gateways = {n for n, s in svcs.items() if is_gateway(s)}
    backends = {n for n, s in svcs.items() if is_vllm(s) or is_sim(s)}
    assert {t.split(":")[0] for t in targets["fairgate"]} == gateways
    assert {t.split(":")[0] for t in targets["vllm"]} == backends


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_grafana_provisioning_is_mounted(compose: Path) -> None:
    grafana = services(compose)["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == "/var/lib/grafana/dashboards"
    datasources = load(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"]
    prom = next(d for d in datasources if d["type"] == "prometheus")
    assert re.match(r"http://prometheus:9090/?$", prom["url"])
    assert "prometheus" in services(compose)
    providers = load(DEPLOY / "grafana/provisioning/dashboards/fairgate.yml")["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_nginx_balances_over_the_gateway_replicas() -> None:
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    upstreams = set(re.findall(r"^\s*server\s+([\w-]+):8000", conf, re.M))
    for compose in COMPOSE_FILES:
        assert upstreams == {n for n, s in services(compose).items() if is_gateway(s)}
    assert "proxy_buffering off" in conf


# --- vLLM launch profiles ---------------------------------------------------------------


def profile_args(path: Path) -> list[str]:
    """The `vllm serve` invocation's words, continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("exec vllm serve"))
    return line.split()


def test_vllm_profiles_exist() -> None:
    names = {p.name for p in VLLM_PROFILES}
    assert {
        "llama-3.1-8b-h100.sh",
        "llama-3.3-70b-long-tp4.sh",
        "llama-3.3-70b-short-tp2.sh",
        "llama-3.1-8b-pd-disagg.sh",
    } <= names


@pytest.mark.parametrize("profile", VLLM_PROFILES, ids=lambda p: p.name)
def test_vllm_profile_flags(profile: Path) -> None:
    args = profile_args(profile)
    assert "--enable-chunked-prefill" in args
    assert flag_value(args, "--scheduling-policy") == "priority"
    assert flag_value(args, "--gpu-memory-utilization") == "0.92"
    assert flag_value(args, "--max-num-batched-tokens")
    text = profile.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in text
    # Every profile states its TTFT/TPOT trade-off.
    assert "TTFT" in text and "TPOT" in text


def test_vllm_profile_pools() -> None:
    by_name = {p.name: profile_args(p) for p in VLLM_PROFILES}
    long_ = by_name["llama-3.3-70b-long-tp4.sh"]
    assert flag_value(long_, "--tensor-parallel-size") == "4"
    assert flag_value(long_, "--max-model-len") == "131072"
    short = by_name["llama-3.3-70b-short-tp2.sh"]
    assert flag_value(short, "--tensor-parallel-size") == "2"
    assert flag_value(short, "--max-model-len") == "10240"
    small = by_name["llama-3.1-8b-h100.sh"]
    assert flag_value(small, "--max-num-batched-tokens") == "2048"
    assert flag_value(small, "--max-num-seqs") == "256"
    pd = by_name["llama-3.1-8b-pd-disagg.sh"]
    kv = flag_value(pd, "--kv-transfer-config")
    assert kv == """'{"kv_connector":"NixlConnector","kv_role":"kv_both"}'"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("profile", VLLM_PROFILES, ids=lambda p: p.name)
def test_vllm_profile_is_valid_bash(profile: Path) -> None:
    subprocess.run(["bash", "-n", str(profile)], check=True)


def test_vllm_readme_explains_every_flag_and_the_roofline() -> None:
    readme = (DEPLOY / "vllm" / "README.md").read_text()
    flags = {a for p in VLLM_PROFILES for a in profile_args(p) if a.startswith("--")}
    missing = {f for f in flags if f"`{f}`" not in readme}
    assert not missing, f"README does not explain {sorted(missing)}"
    for number in ("4.8 ms", "32 ms", "295"):
        assert number in readme


# --- Helm chart -------------------------------------------------------------------------


def values() -> dict[str, Any]:
    data: dict[str, Any] = load(CHART / "values.yaml")
    return data


def template_files() -> list[Path]:
    return sorted(p for p in TEMPLATES.iterdir() if p.suffix in {".yaml", ".tpl", ".txt"})


def test_chart_yaml_required_fields() -> None:
    chart = load(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "fairgate" == CHART.name
    assert re.match(r"^\d+\.\d+\.\d+", str(chart["version"]))
    assert chart["appVersion"]
    assert chart.get("type", "application") == "application"


def test_values_yaml_required_fields() -> None:
    v = values()
    assert v["gateway"]["replicaCount"] == 2
    assert v["gateway"]["port"] == 8000
    assert {"enabled", "externalUrl"} <= set(v["redis"])
    assert v["vllm"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert v["vllm"]["tolerations"]
    common = [str(a) for a in v["vllm"]["commonArgs"]]
    assert "--enable-chunked-prefill" in common
    assert flag_value(common, "--scheduling-policy") == "priority"
    pool_keys = {
        "name",
        "model",
        "servedModelName",
        "replicas",
        "tensorParallel",
        "maxModelLen",
        "maxNumBatchedTokens",
        "extraArgs",
    }
    pools = v["vllm"]["pools"]
    assert pools
    for pool in pools:
        assert pool_keys <= set(pool), pool_keys - set(pool)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pool["name"])
        assert isinstance(pool["extraArgs"], list)
    assert len({p["name"] for p in pools}) == len(pools)
    by_tp = {p["tensorParallel"]: p for p in pools}
    assert by_tp[4]["maxModelLen"] == 131072
    assert by_tp[2]["maxModelLen"] == 10240
    assert set(v["gateway"]["config"]["classes"]) == PRIORITY_CLASSES


def test_expected_templates_exist() -> None:
    names = {p.name for p in TEMPLATES.iterdir()}
    assert {
        "_helpers.tpl",
        "NOTES.txt",
        "gateway-deployment.yaml",
        "gateway-service.yaml",
        "gateway-configmap.yaml",
        "gateway-pdb.yaml",
        "redis.yaml",
        "vllm-pools.yaml",
        "servicemonitor.yaml",
        "gateway-secret.yaml",
        "gateway-hpa.yaml",
        "gateway-pvc.yaml",
        "networkpolicy.yaml",
    } <= names


def lookup(tree: Any, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("template", template_files(), ids=lambda p: p.name)
def test_referenced_values_exist(template: Path) -> None:
    v = values()
    refs = set(re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", template.read_text()))
    missing = sorted(r for r in refs if not lookup(v, r.lstrip(".")))
    assert not missing, f"{template.name} reads values that values.yaml lacks: {missing}"


def test_pools_sharing_a_model_name_split_it_by_prompt_length() -> None:
    # The gateway spreads one model's requests over the backends whose prompt range holds
    # them: pools of one model name with different context lengths must declare ranges
    # that neither overlap nor leave a gap, and a pool's range must fit its context.
    by_name: dict[str, list[dict[str, Any]]] = {}
    for pool in values()["vllm"]["pools"]:
        by_name.setdefault(pool["servedModelName"], []).append(pool)
    for name, pools in by_name.items():
        if len({p["maxModelLen"] for p in pools}) == 1:
            continue
        spans = sorted((p.get("minPromptTokens", 0), p.get("maxPromptTokens"), p)
                       for p in pools)
        assert spans[0][0] == 0, name
        for (_, high, pool), (low, _, _) in itertools.pairwise(spans):
            assert high is not None and high + 1 == low, name
            assert high < pool["maxModelLen"], pool["name"]
        assert spans[-1][1] is None, name  # the longest pool takes what the others do not


# --- against the gateway's own settings model -------------------------------------------


@pytest.mark.parametrize("config_name", ["gateway.yaml", "gateway.sim.yaml"])
def test_gateway_settings_accept_the_compose_configs(
    config_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in [v for v in os.environ if v.startswith("FAIRGATE_")]:
        monkeypatch.delenv(var)
    settings = load_settings(DEPLOY / "config" / config_name)
    assert settings.store.redis_url == "redis://redis:6379/0"
    assert settings.listen.port == 8000 and settings.listen.host == "0.0.0.0"
    assert settings.models() == ["llama-3.1-8b"]
    assert len(settings.backends) == 2
    assert settings.classes["batch"].max_waiting == 1


SENTINEL_COMPOSE = DEPLOY / "docker-compose.sentinel.yml"


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_sentinel_override_points_the_gateways_at_its_sentinels(
    compose: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-f <stack> -f docker-compose.sentinel.yml`: each gateway's settings (its config
    file, then the two files' environment merged) name the override's sentinels, which
    monitor the stack's `redis`, and a replica follows it."""
    base, extra = services(compose), services(SENTINEL_COMPOSE)
    sentinels = {n for n, s in extra.items() if "--sentinel" in str(s.get("command"))}
    assert len(sentinels) == 3, sentinels
    for name in sentinels:
        script = str(extra[name]["command"])
        assert "sentinel monitor fairgate redis 6379 2" in script, script
        assert extra[name]["hostname"] == name
    replica = extra["redis-replica"]
    assert flag_value(command_list(replica), "--replicaof") == "redis"
    assert flag_value(command_list(replica), "--appendonly") == "yes"
    gateways = [n for n, s in base.items() if is_gateway(s)]
    assert set(gateways) <= set(extra), (gateways, sorted(extra))
    for name in gateways:
        env = {**base[name]["environment"], **extra[name]["environment"]}
        for var in [v for v in os.environ if v.startswith("FAIRGATE_")]:
            monkeypatch.delenv(var)
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        settings = load_settings(mounted_config(base[name], compose))
        assert settings.store.redis_url is None and settings.store.redis_sentinel is not None
        assert {host for host, _ in settings.store.redis_sentinel.addresses()} == sentinels
        assert settings.store.redis_sentinel.master_name == "fairgate"
        assert set(extra[name]["depends_on"]) == sentinels
