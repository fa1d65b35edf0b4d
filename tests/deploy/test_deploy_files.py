"""Structural checks of deploy/ and helm/: no Docker engine or helm binary needed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = ROOT / "helm" / "fairgate"
TEMPLATES = CHART / "templates"

GPU_COMPOSE = DEPLOY / "docker-compose.yml"
SIM_COMPOSE = DEPLOY / "docker-compose.sim.yml"
COMPOSE_FILES = [GPU_COMPOSE, SIM_COMPOSE]
GATEWAY_CONFIG_KEYS = {
    "redis_url",
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
        assert config["fairness"] in {"vtc", "round_robin"}
        assert set(config["classes"]) == PRIORITY_CLASSES
        for gates in config["classes"].values():
            assert {"max_waiting", "max_tpot_ms"} <= set(gates)
        assert config["classes"]["batch"]["max_waiting"] <= 1  # batch only on an empty queue
        host = re.match(r"redis://([^:/]+)", config["redis_url"])
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
    } <= names


ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
BLOCK_OPEN = re.compile(r"^(if|range|with|define|block)\b")


@pytest.mark.parametrize("template", template_files(), ids=lambda p: p.name)
def test_template_delimiters_and_blocks_balance(template: Path) -> None:
    text = template.read_text()
    assert text.count("{{") == text.count("}}")
    depth = 0
    for action in ACTION.findall(text):
        if action.startswith("/*"):
            assert action.endswith("*/"), action
            continue
        if BLOCK_OPEN.match(action):
            depth += 1
        elif re.match(r"^end\b", action):
            depth -= 1
            assert depth >= 0, f"unmatched end in {template.name}"
    assert depth == 0, f"{template.name}: {depth} unclosed block(s)"


def defined_templates() -> set[str]:
    return set(re.findall(r'\{\{-?\s*define\s+"([^"]+)"', (TEMPLATES / "_helpers.tpl").read_text()))


@pytest.mark.parametrize("template", template_files(), ids=lambda p: p.name)
def test_every_include_names_a_helper(template: Path) -> None:
    defined = defined_templates()
    assert "fairgate.fullname" in defined
    used = set(re.findall(r'(?:include|template)\s+"([^"]+)"', template.read_text()))
    assert used <= defined, used - defined


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


def test_pool_fields_read_by_templates_exist_in_every_pool() -> None:
    v = values()
    text = "".join(p.read_text() for p in template_files())
    fields = set(re.findall(r"\$pool\.([A-Za-z_][A-Za-z0-9_]*)", text))
    assert {
        "name",
        "model",
        "servedModelName",
        "replicas",
        "tensorParallel",
        "maxModelLen",
        "maxNumBatchedTokens",
        "extraArgs",
    } <= fields
    for pool in v["vllm"]["pools"]:
        optional = {"resources"}
        assert fields - optional <= set(pool), (pool["name"], fields - set(pool))


def test_vllm_pool_template_wires_gpus_probes_and_headless_dns() -> None:
    text = (TEMPLATES / "vllm-pools.yaml").read_text()
    assert "kind: StatefulSet" in text
    assert "clusterIP: None" in text
    assert re.search(r"serviceName:\s*\{\{\s*\$name\s*\}\}", text)
    assert re.search(r"name:\s*\{\{\s*\$name\s*\}\}", text)
    assert '"nvidia.com/gpu" $tp' in text
    assert "$tp := int $pool.tensorParallel" in text
    assert "--tensor-parallel-size" in text
    assert "$.Values.vllm.nodeSelector" in text and "tolerations" in text
    assert re.search(r"mountPath:\s*/dev/shm", text) and "medium: Memory" in text
    for probe in ("readinessProbe", "livenessProbe"):
        assert re.search(probe + r":\s*\n\s*httpGet: \{path: /health", text), probe


def test_gateway_config_lists_every_pool_pod_by_stable_dns() -> None:
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    config = helpers[helpers.index('define "fairgate.gatewayConfig"') :]
    # <release>-<pool>-<i>.<release>-<pool>:<port> for i in 0..replicas-1
    assert "until (int $pool.replicas)" in config
    assert '"http://%s-%d.%s:%d" $poolName $i $poolName' in config
    assert 'include "fairgate.poolName"' in config
    pool_name = helpers[helpers.index('define "fairgate.poolName"') :]
    assert re.search(r'printf "%s-%s" \.root\.Release\.Name \.pool\.name', pool_name)
    for key in GATEWAY_CONFIG_KEYS - {"api_keys", "admin_keys"}:
        assert re.search(rf"^{key}:", config, re.M), key
    configmap = (TEMPLATES / "gateway-configmap.yaml").read_text()
    assert "kind: ConfigMap" in configmap and 'include "fairgate.gatewayConfig"' in configmap
    secret = (TEMPLATES / "gateway-secret.yaml").read_text()
    assert "FAIRGATE_API_KEYS" in secret and "FAIRGATE_ADMIN_KEYS" in secret


def test_gateway_deployment_mounts_config_and_probes() -> None:
    text = (TEMPLATES / "gateway-deployment.yaml").read_text()
    assert "kind: Deployment" in text
    assert "replicas: {{ .Values.gateway.replicaCount }}" in text
    assert '"serve", "--config", "/etc/fairgate/config.yaml"' in text
    assert "mountPath: /etc/fairgate" in text
    assert "path: /ready" in text and "path: /health" in text
    assert "checksum/config" in text
    pdb = (TEMPLATES / "gateway-pdb.yaml").read_text()
    assert pdb.lstrip().startswith("{{- if .Values.gateway.podDisruptionBudget.enabled }}")


def test_redis_statefulset_uses_aof_and_a_pvc_or_external_url() -> None:
    text = (TEMPLATES / "redis.yaml").read_text()
    assert text.lstrip().startswith("{{- if .Values.redis.enabled }}")
    assert "kind: StatefulSet" in text and "volumeClaimTemplates" in text
    assert re.search(r"- --appendonly\s*\n\s*- \"yes\"", text)
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    assert ".Values.redis.externalUrl" in helpers


def test_pools_sharing_a_model_name_share_a_context_length() -> None:
    # The gateway spreads one model's requests over all its backends: a long-context pool
    # must not hide behind the same model name as a short one.
    max_len: dict[str, int] = {}
    for pool in values()["vllm"]["pools"]:
        name, length = pool["servedModelName"], pool["maxModelLen"]
        assert max_len.setdefault(name, length) == length, name


# --- against the gateway's own settings model -------------------------------------------


@pytest.mark.parametrize("config_name", ["gateway.yaml", "gateway.sim.yaml"])
def test_gateway_settings_accept_the_compose_configs(
    config_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings_mod = pytest.importorskip("gateway.settings")
    for var in [v for v in os.environ if v.startswith("FAIRGATE_")]:
        monkeypatch.delenv(var)
    settings = settings_mod.load_settings(DEPLOY / "config" / config_name)
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.listen.port == 8000 and settings.listen.host == "0.0.0.0"
    assert settings.models() == ["llama-3.1-8b"]
    assert len(settings.backends) == 2
    assert settings.classes["batch"].max_waiting == 1


def test_gateway_settings_take_helm_secret_keys_from_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The chart keeps keys out of the ConfigMap and passes them as JSON env vars."""
    settings_mod = pytest.importorskip("gateway.settings")
    keys = values()["gateway"]["keys"]
    config = load(DEPLOY / "config" / "gateway.sim.yaml")
    del config["api_keys"], config["admin_keys"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("FAIRGATE_API_KEYS", json.dumps(keys["apiKeys"]))
    monkeypatch.setenv("FAIRGATE_ADMIN_KEYS", json.dumps(keys["adminKeys"]))
    settings = settings_mod.load_settings(path)
    assert [k.key for k in settings.api_keys] == [k["key"] for k in keys["apiKeys"]]
    assert settings.admin_keys == keys["adminKeys"]
