"""helm/fairgate rendered by Helm's own engine, every manifest checked against Kubernetes schemas.

The renderer is helm-python-sdk (Helm v4's Go SDK behind a C ABI, no helm binary), run in a
subprocess (tests/deploy/helm_render.py). Each rendered object is validated with
kubernetes-validate's strict schemas (unknown fields are errors); ServiceMonitor and KEDA's
ScaledObject are CRDs with no bundled schema and are checked structurally instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.core.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "fairgate"
RENDERER = Path(__file__).with_name("helm_render.py")

# The chart's kubeVersion floor, a mid version, and the newest schemas bundled.
KUBE_VERSIONS = ["1.25.0", "1.31.0", kubernetes_validate.latest_version()]
CRD_GROUPS = {"monitoring.coreos.com", "keda.sh"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}

EXTERNAL_REDIS = "rediss://redis.shared.svc:6380/2"
EXTERNAL_CLUSTER = ["vk-0.vk-headless.data.svc:6380", "vk-1.vk-headless.data.svc:6380"]
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
APPS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
FULL_POOLS = [
    {
        "name": "llama-8b",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "servedModelName": "llama-3.1-8b",
        "replicas": 3,
        "tensorParallel": 1,
        "maxModelLen": 0,
        "maxNumBatchedTokens": 2048,
        "maxNumSeqs": 256,
        "extraArgs": [],
    },
    {
        "name": "llama-70b-long",
        "model": "meta-llama/Llama-3.3-70B-Instruct",
        "servedModelName": "llama-3.3-70b-128k",
        "replicas": 2,
        "tensorParallel": 4,
        "maxModelLen": 131072,
        "maxNumBatchedTokens": 2048,
        "maxNumSeqs": 64,
        "extraArgs": [],
        "resources": {"requests": {"cpu": "16", "memory": "200Gi"}, "limits": {"memory": "320Gi"}},
    },
    {
        "name": "llama-70b-short",
        "model": "meta-llama/Llama-3.3-70B-Instruct",
        "servedModelName": "llama-3.3-70b",
        "replicas": 1,
        "tensorParallel": 2,
        "maxModelLen": 10240,
        "maxNumBatchedTokens": 2048,
        "maxNumSeqs": 256,
        "extraArgs": ["--quantization", "fp8"],
        # A pool on other nodes: its own selector replaces the H100 default.
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    },
]
EXTRA_BACKEND = {"name": "ext-8b", "url": "http://vllm-ext.other.svc:8100", "model": "llama-3.1-8b"}


def readme_values() -> dict[str, Any]:
    """The `# my-values.yaml` block of docs/deploying.md."""
    section = (ROOT / "docs" / "deploying.md").read_text()
    block = re.search(r"```yaml\n\s*# my-values.yaml\n(.*?)\n\s*```", section, re.S)
    assert block, "docs/deploying.md has no my-values.yaml block"
    text = textwrap.dedent(block.group(1))
    data: dict[str, Any] = yaml.safe_load(text)
    return data


RENDERS: dict[str, dict[str, Any]] = {
    "default": {},
    # External Redis, HPA (External metric + CPU), NetworkPolicy, shared Batch storage,
    # ServiceMonitor, keys from an existing Secret, three pools incl. TP4 128k.
    "full": {
        "name": "prod",
        "values": {
            "redis": {"enabled": False, "externalUrl": EXTERNAL_REDIS},
            "gateway": {
                "autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": 70},
                "persistence": {"enabled": True, "storageClassName": "nfs"},
                "keys": {"existingSecret": "fairgate-keys"},
                "config": {"extraBackends": [EXTRA_BACKEND]},
            },
            "vllm": {"pools": FULL_POOLS, "cache": {"pvcSize": "500Gi"}},
            "networkPolicy": {"enabled": True, "gatewayFrom": [APPS], "metricsFrom": [MONITORING]},
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
    },
    # In-chart Redis behind a NetworkPolicy, HPA on a Pods metric with a selector.
    "pods-hpa": {
        "values": {
            "gateway": {
                "autoscaling": {
                    "enabled": True,
                    "minReplicas": 3,
                    "maxReplicas": 12,
                    "metric": {
                        "type": "Pods",
                        "selector": {"matchLabels": {"priority_class": "interactive"}},
                        "targetAverageValue": "50",
                    },
                },
            },
            "networkPolicy": {"enabled": True, "metricsFrom": [MONITORING]},
        },
    },
    # Names at their limits: a 40-character release still yields valid DNS labels.
    "long-name": {"name": "a-rather-long-release-name-for-fairgate01"},
    # The values file docs/deploying.md tells operators to write.
    "readme": {"values": readme_values()},
    # An in-chart Valkey Cluster (3 masters x 1 replica) behind a NetworkPolicy.
    "cluster": {
        "values": {"redis": {"enabled": False}, "redisCluster": {"enabled": True},
                   "networkPolicy": {"enabled": True}},
    },
    # An external cluster, named by some of its nodes.
    "cluster-external": {
        "values": {"redis": {"enabled": False},
                   "redisCluster": {"externalNodes": EXTERNAL_CLUSTER},
                   "networkPolicy": {"enabled": True}},
    },
    # Redis behind Sentinel (a master, a replica, three sentinels) behind NetworkPolicies.
    "sentinel": {"values": {"redis": {"topology": "sentinel"},
                            "networkPolicy": {"enabled": True}}},
    # KEDA scales two pools on fairgate_pool_desired_replicas (one with its own bounds),
    # the third keeps its fixed replicas.
    "keda": {
        "values": {
            "vllm": {
                "autoscaling": {"enabled": True, "maxReplicas": 3,
                                "prometheus": {"serverAddress": "http://prom.monitoring:9090"}},
                "pools": [{**FULL_POOLS[0], "autoscaling": {"minReplicas": 1, "maxReplicas": 6}},
                          FULL_POOLS[1],
                          {**FULL_POOLS[2], "autoscaling": {"enabled": False}}],
            },
            "serviceMonitor": {"enabled": True},
        },
    },
}
KEDA_BOUNDS = {"llama-8b": (1, 6), "llama-70b-long": (0, 3)}  # the "keda" render's
FAILURES: dict[str, tuple[dict[str, Any], str]] = {
    "unknown-redis-topology": ({"redis": {"topology": "ring"}},
                               "redis.topology must be standalone or sentinel"),
    "sentinel-below-quorum": ({"redis": {"topology": "sentinel", "sentinel": {"sentinels": 1}}},
                              "must be at least redis.sentinel.quorum"),
    "no-keys": ({"gateway": {"keys": {"apiKeys": []}}}, "gateway.keys.apiKeys is empty"),
    "external-redis-without-url": (
        {"redis": {"enabled": False}},
        "redis.externalUrl is required",
    ),
    "cluster-and-redis": (
        {"redisCluster": {"enabled": True}},
        "redisCluster replaces redis: set redis.enabled=false",
    ),
    "hpa-min-over-max": (
        {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "minReplicas must not exceed maxReplicas",
    ),
    "hpa-bad-metric-type": (
        {"gateway": {"autoscaling": {"enabled": True, "metric": {"type": "Object"}}}},
        "must be External or Pods",
    ),
    "duplicate-pool": (
        {"vllm": {"pools": [FULL_POOLS[0], FULL_POOLS[0]]}},
        'name "llama-8b" is used twice',
    ),
    "keda-min-over-max": (
        {"vllm": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "autoscaling minReplicas must not exceed maxReplicas",
    ),
    "pool-name-not-dns": (
        {"vllm": {"pools": [{**FULL_POOLS[0], "name": "Llama_8B"}]}},
        "is not a DNS label",
    ),
}
LINTS = {
    "default": {},
    "full": RENDERS["full"]["values"],
    "pods-hpa": RENDERS["pods-hpa"]["values"],
    "cluster": RENDERS["cluster"]["values"],
    "sentinel": RENDERS["sentinel"]["values"],
    "keda": RENDERS["keda"]["values"],
}


# --- rendering --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm_answer() -> dict[str, Any]:
    renders = {
        case_id: {"values": case.get("values", {}), "name": case.get("name", "fg")}
        for case_id, case in RENDERS.items()
    }
    renders.update({f"fail:{k}": {"values": v} for k, (v, _) in FAILURES.items()})
    request = {
        "chart": str(CHART),
        "renders": renders,
        "lints": {k: {"values": v, "kube_version": "v1.29.0"} for k, v in LINTS.items()},
    }
    proc = subprocess.run(
        [sys.executable, str(RENDERER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


class Release:
    """One rendered release: its objects, by kind and name."""

    def __init__(self, manifests: dict[str, str], name: str) -> None:
        self.name = name
        self.notes = manifests.pop("fairgate/templates/NOTES.txt", "")
        self.objects: list[dict[str, Any]] = [
            doc
            for path, text in sorted(manifests.items())
            for doc in yaml.safe_load_all(text)
            if doc
        ]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in self.of(kind)])
        return found[0]

    def component(self, kind: str, component: str) -> list[dict[str, Any]]:
        return [
            o
            for o in self.of(kind)
            if o["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]

    def gateway(self) -> dict[str, Any]:
        (deploy,) = self.of("Deployment")
        return deploy

    def config(self) -> dict[str, Any]:
        (cm,) = self.component("ConfigMap", "gateway")
        data: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
        return data

    def pools(self) -> list[dict[str, Any]]:
        return self.component("StatefulSet", "vllm")


@pytest.fixture(scope="module")
def releases(helm_answer: dict[str, Any]) -> dict[str, Release]:
    out = {}
    for case_id, case in RENDERS.items():
        result = helm_answer["renders"][case_id]
        assert "error" not in result, f"{case_id}: {result.get('error')}"
        out[case_id] = Release(result["manifests"], case.get("name", "fg"))
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels semantics (the chart uses no matchExpressions)."""
    assert set(selector) <= {"matchLabels"}, selector
    match = selector.get("matchLabels", selector)
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == name]
    return found


def port_of(c: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(port)


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def test_the_engine_is_helm_v4(helm_answer: dict[str, Any]) -> None:
    assert helm_answer["versions"]["helm_sdk"].startswith("v4.")


@pytest.mark.parametrize("case_id", list(LINTS))
def test_helm_lint_strict_is_clean(helm_answer: dict[str, Any], case_id: str) -> None:
    report = helm_answer["lints"][case_id]
    assert not report["errors"], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warning or error
    assert not problems, problems


@pytest.mark.parametrize("case_id", list(FAILURES))
def test_bad_values_fail_with_a_message(helm_answer: dict[str, Any], case_id: str) -> None:
    result = helm_answer["renders"][f"fail:{case_id}"]
    assert "manifests" not in result
    assert FAILURES[case_id][1] in result["error"]


# --- every object against the Kubernetes schemas -----------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case_id", list(RENDERS))
def test_every_object_validates_against_kubernetes_schemas(
    releases: dict[str, Release], case_id: str, kube_version: str
) -> None:
    release = releases[case_id]
    assert release.objects
    skipped = []
    for obj in release.objects:
        if obj["apiVersion"].split("/")[0] in CRD_GROUPS:
            skipped.append(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert set(skipped) <= {"ServiceMonitor", "ScaledObject"}


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_names_are_unique_dns_labels_and_carry_release_labels(
    releases: dict[str, Release], case_id: str
) -> None:
    release = releases[case_id]
    seen = set()
    for obj in release.objects:
        meta = obj["metadata"]
        key = (obj["kind"], meta["name"])
        assert key not in seen, key
        seen.add(key)
        assert DNS_LABEL.fullmatch(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
        assert "namespace" not in meta  # the release namespace applies
        assert meta["labels"]["app.kubernetes.io/instance"] == release.name
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for sts in release.of("StatefulSet"):
        # pod <sts>-<ordinal> plus the controller-revision-hash label value fit in 63
        assert len(sts["metadata"]["name"]) <= 52


def test_default_render_has_the_expected_objects(releases: dict[str, Release]) -> None:
    release = releases["default"]
    kinds = sorted(o["kind"] for o in release.objects)
    assert kinds == sorted(
        ["ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget"]  # gateway
        + ["Service", "StatefulSet"]  # redis
        + ["Service", "StatefulSet"] * 3  # three vLLM pools
    )
    assert "llama-70b-long: 1 x 4 GPU" in release.notes


@pytest.mark.parametrize("case_id", ["full", "pods-hpa"])
def test_optional_objects_render_when_enabled(releases: dict[str, Release], case_id: str) -> None:
    release = releases[case_id]
    assert len(release.of("HorizontalPodAutoscaler")) == 1
    nps = release.of("NetworkPolicy")
    components = {np["metadata"]["labels"]["app.kubernetes.io/component"] for np in nps}
    redis_in_chart = case_id != "full"
    assert components == ({"gateway", "vllm", "redis"} if redis_in_chart else {"gateway", "vllm"})
    if case_id == "full":
        assert len(release.of("ServiceMonitor")) == 2
        assert len(release.of("PersistentVolumeClaim")) == 1
        assert not release.component("StatefulSet", "redis")
        assert not release.of("Secret")  # keys come from gateway.keys.existingSecret


# --- vLLM pools ---------------------------------------------------------------------------


def expected_pools(case_id: str) -> list[dict[str, Any]]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pools: list[dict[str, Any]] = (
        RENDERS[case_id].get("values", {}).get("vllm", {}).get("pools", values["vllm"]["pools"])
    )
    return pools


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_vllm_pools_carry_the_fairgate_contract(releases: dict[str, Release], case_id: str) -> None:
    release = releases[case_id]
    by_pool = {s["metadata"]["labels"]["fairgate.io/pool"]: s for s in release.pools()}
    pools = expected_pools(case_id)
    assert set(by_pool) == {p["name"] for p in pools}
    for pool in pools:
        sts = by_pool[pool["name"]]
        # a pool KEDA scales leaves its replicas to KEDA (not reset by an upgrade)
        scaled = case_id == "keda" and pool["name"] in KEDA_BOUNDS
        assert sts["spec"].get("replicas") == (None if scaled else pool["replicas"])
        spec = sts["spec"]["template"]["spec"]
        vllm = container(sts, "vllm")
        args = [str(a) for a in vllm["args"]]
        assert vllm["command"] == ["vllm", "serve"]
        assert args[0] == pool["model"]
        assert "--enable-chunked-prefill" in args
        assert flag_value(args, "--scheduling-policy") == "priority"
        assert flag_value(args, "--served-model-name") == pool["servedModelName"]
        assert flag_value(args, "--tensor-parallel-size") == str(pool["tensorParallel"])
        assert flag_value(args, "--max-num-batched-tokens") == str(pool["maxNumBatchedTokens"])
        assert flag_value(args, "--max-num-seqs") == str(pool["maxNumSeqs"])
        assert flag_value(args, "--port") == str(port_of(vllm, "http"))
        max_len = flag_value(args, "--max-model-len")
        assert max_len == (str(pool["maxModelLen"]) if pool["maxModelLen"] else None)
        for extra in pool["extraArgs"]:
            assert extra in args
        # GPUs: limit == tensor parallel size; the rest of the pool's resources kept.
        resources = vllm["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == pool["tensorParallel"]
        for section, entries in pool.get("resources", {}).items():
            for key, value in entries.items():
                assert resources[section][key] == value
        # H100 nodes (or the pool's own selector), tolerating the GPU taint.
        assert spec["nodeSelector"] == pool.get("nodeSelector", H100)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
        # /health probes on the serving port.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert (
            vllm["startupProbe"]["failureThreshold"] * vllm["startupProbe"]["periodSeconds"] >= 1800
        )
        # Shared memory for NCCL: a memory-backed emptyDir on /dev/shm.
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e for e in vllm["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "hf-token",
            "key": "HF_TOKEN",
            "optional": True,
        }
        # Weights cache: a PVC per pod when vllm.cache.pvcSize is set.
        claims = {c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])}
        cache_pvc = bool(RENDERS[case_id].get("values", {}).get("vllm", {}).get("cache"))
        assert ("cache" in claims) == cache_pvc
        assert ("cache" in volumes) != cache_pvc
        assert mounts["/cache"] == "cache"


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_vllm_pods_drain_with_migrate_before_they_stop(
    releases: dict[str, Release], case_id: str
) -> None:
    """preStop drains the pod's backend through the gateway with migrate and waits grace +
    margin; postStart undrains it; the termination grace covers both and vLLM's shutdown."""
    release = releases[case_id]
    (secret,) = release.component("Secret", "gateway") or [None]
    for sts in release.pools():
        vllm = container(sts, "vllm")
        env = {e["name"]: e for e in vllm["env"]}
        pool = sts["metadata"]["labels"]["fairgate.io/pool"]
        assert env["FAIRGATE_POOL"]["value"] == pool
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        (service,) = release.component("Service", "gateway")
        assert env["FAIRGATE_URL"]["value"] == (
            f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}")
        key_ref = env["DRAIN_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert key_ref["key"] == "DRAIN_ADMIN_KEY"
        grace = int(env["FAIRGATE_DRAIN_GRACE_S"]["value"])
        margin = int(env["FAIRGATE_DRAIN_MARGIN_S"]["value"])
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == (
            grace + margin + 60)
        hooks = vllm["lifecycle"]
        for hook, action in (("preStop", "drain"), ("postStart", "undrain")):
            command = hooks[hook]["exec"]["command"]
            assert command[:2] == ["python3", "-c"] and command[-1] == action, command
            compile(command[2], "drain_hook.py", "exec")  # the script is Python
            assert '"migrate": True' in command[2] and "urlopen" in command[2]
    if secret is not None:
        assert secret["stringData"]["DRAIN_ADMIN_KEY"] in json.loads(
            secret["stringData"]["FAIRGATE_ADMIN_KEYS"])


def test_the_tp4_long_context_pool(releases: dict[str, Release]) -> None:
    (long_pool,) = [
        s
        for s in releases["full"].pools()
        if s["metadata"]["labels"]["fairgate.io/pool"] == "llama-70b-long"
    ]
    args = [str(a) for a in container(long_pool, "vllm")["args"]]
    assert flag_value(args, "--tensor-parallel-size") == "4"
    assert flag_value(args, "--max-model-len") == "131072"
    assert flag_value(args, "--served-model-name") == "llama-3.3-70b-128k"
    assert container(long_pool, "vllm")["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert long_pool["spec"]["replicas"] == 2


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_headless_services_give_each_pool_pod_the_dns_name_the_gateway_uses(
    releases: dict[str, Release], case_id: str
) -> None:
    release = releases[case_id]
    expected = []
    for sts in release.pools():
        svc = release.get("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(sts))
        # no other pool's pods
        for other in release.pools():
            if other is not sts:
                assert not selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(other))
        assert selects(sts["spec"]["selector"], pod_labels(sts))
        port = port_of(container(sts, "vllm"), "http")
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["targetPort"] == "http" and svc_port["port"] == port
        name, served = (
            sts["metadata"]["name"],
            flag_value(container(sts, "vllm")["args"], "--served-model-name"),
        )
        # a pool KEDA scales: every pod it may start
        pool = sts["metadata"]["labels"]["fairgate.io/pool"]
        count = (KEDA_BOUNDS[pool][1] if case_id == "keda" and pool in KEDA_BOUNDS
                 else sts["spec"]["replicas"])
        expected += [
            (f"http://{name}-{i}.{svc['metadata']['name']}:{port}", served)
            for i in range(count)
        ]
    extra = RENDERS[case_id].get("values", {}).get("gateway", {}).get("config", {})
    expected += [(b["url"], b["model"]) for b in extra.get("extraBackends", [])]
    backends = release.config()["backends"]
    assert sorted((b["url"], b["model"]) for b in backends) == sorted(expected)
    assert len({b["name"] for b in backends}) == len(backends)
    for b in backends:
        host = b["url"].split("//")[1].split(".")[0]
        assert DNS_LABEL.fullmatch(host) and len(host) <= 63


# --- gateway ------------------------------------------------------------------------------


def load_gateway_settings(
    release: Release, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secret: dict[str, str]
) -> Any:
    for var in [v for v in os.environ if v.startswith("FAIRGATE_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(release.config()))
    for key, value in secret.items():
        monkeypatch.setenv(key, value)
    for env in container(release.gateway(), "gateway")["env"]:
        if env["name"] != "FAIRGATE_CONFIG":
            monkeypatch.setenv(env["name"], env["value"])
    return load_settings(path)


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_gateway_settings_accept_the_rendered_config_and_secret(
    releases: dict[str, Release], case_id: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    release = releases[case_id]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    secrets = release.of("Secret")
    if secrets:
        (secret,) = secrets
        data = secret["stringData"]
    else:  # an existing Secret the operator created with the same two keys
        data = {
            "FAIRGATE_API_KEYS": json.dumps([{"key": "sk-x", "user": "x"}]),
            "FAIRGATE_ADMIN_KEYS": "[]",
        }
    settings = load_gateway_settings(release, monkeypatch, tmp_path, data)
    assert settings.listen.host == "0.0.0.0"
    assert settings.listen.port == port_of(container(release.gateway(), "gateway"), "http")
    expected_models = {
        flag_value(container(s, "vllm")["args"], "--served-model-name") for s in release.pools()
    }
    assert set(settings.models()) >= expected_models
    if secrets:
        assert [k.key for k in settings.api_keys] == [
            k["key"] for k in values["gateway"]["keys"]["apiKeys"]
        ]
        assert settings.admin_keys == values["gateway"]["keys"]["adminKeys"]
    mounts = {
        m["mountPath"]: m["name"] for m in container(release.gateway(), "gateway")["volumeMounts"]
    }
    assert mounts[str(settings.store.data_dir)] == "data"
    assert settings.classes["batch"].max_waiting == 1


def test_the_default_70b_pools_are_one_model_split_by_prompt_length(
    releases: dict[str, Release],
) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pools = {p["name"]: p for p in values["vllm"]["pools"]}
    backends = releases["default"].config()["backends"]
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for backend in backends:
        by_pool.setdefault(backend["pool"], []).append(backend)
        # each backend's prefill-token gate is sized from its own pool's token budget
        assert backend["max_num_batched_tokens"] == pools[backend["pool"]]["maxNumBatchedTokens"]
    (short,), (long,) = by_pool["llama-70b-short"], by_pool["llama-70b-long"]
    assert short["model"] == long["model"] == "llama-3.3-70b"
    assert short["max_prompt_tokens"] + 1 == long["min_prompt_tokens"]  # no gap, no overlap
    assert "min_prompt_tokens" not in short and "max_prompt_tokens" not in long
    assert short["max_prompt_tokens"] < pools["llama-70b-short"]["maxModelLen"]
    assert all("max_prompt_tokens" not in b for b in by_pool["llama-8b"])


@pytest.mark.parametrize("case_id", list(RENDERS))
def test_gateway_wiring(releases: dict[str, Release], case_id: str) -> None:
    release = releases[case_id]
    deploy = release.gateway()
    gw = container(deploy, "gateway")
    labels = pod_labels(deploy)
    assert selects(deploy["spec"]["selector"], labels)
    # config mounted from the rendered ConfigMap at the path the args name
    (cm,) = release.component("ConfigMap", "gateway")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    (config_mount,) = [m for m in gw["volumeMounts"] if m["mountPath"] == "/etc/fairgate"]
    assert volumes[config_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    workers = RENDERS[case_id].get("values", {}).get("gateway", {}).get("workers", 2)
    assert gw["args"] == ["serve", "--config", "/etc/fairgate/config.yaml",
                          "--workers", str(workers)]
    # keys from the Secret (rendered or existing) via envFrom
    (env_from,) = gw["envFrom"]
    existing = (
        RENDERS[case_id].get("values", {}).get("gateway", {}).get("keys", {}).get("existingSecret")
    )
    secret_name = (
        existing or release.get("Secret", env_from["secretRef"]["name"])["metadata"]["name"]
    )
    assert env_from["secretRef"]["name"] == secret_name
    assert "FAIRGATE_API_KEYS" not in cm["data"]["config.yaml"]
    assert "sk-" not in cm["data"]["config.yaml"]
    # probes, service, PDB
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"
    (svc,) = release.component("Service", "gateway")
    assert selects({"matchLabels": svc["spec"]["selector"]}, labels)
    (svc_port,) = svc["spec"]["ports"]
    assert port_of(gw, svc_port["targetPort"]) == release.config()["listen"]["port"]
    (pdb,) = release.of("PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"], labels)
    replicas = deploy["spec"].get("replicas")
    hpas = release.of("HorizontalPodAutoscaler")
    floor = hpas[0]["spec"]["minReplicas"] if hpas else replicas
    assert pdb["spec"]["minAvailable"] < floor  # a node drain can always evict one
    # Batch files: one shared claim when persistence is on, else an emptyDir.
    data = volumes["data"]
    pvcs = release.of("PersistentVolumeClaim")
    if pvcs:
        assert data["persistentVolumeClaim"]["claimName"] == pvcs[0]["metadata"]["name"]
        assert pvcs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvcs[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    else:
        assert data == {"name": "data", "emptyDir": {}}
    assert deploy["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001


@pytest.mark.parametrize("case_id", ["full", "pods-hpa"])
def test_hpa_scales_the_gateway_deployment_on_queue_depth(
    releases: dict[str, Release], case_id: str
) -> None:
    release = releases[case_id]
    (hpa,) = release.of("HorizontalPodAutoscaler")
    deploy = release.gateway()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": deploy["apiVersion"],
        "kind": "Deployment",
        "name": deploy["metadata"]["name"],
    }
    assert "replicas" not in deploy["spec"]  # left to the HPA, not reset on upgrade
    metric = hpa["spec"]["metrics"][0]
    body = metric[metric["type"].lower()]
    assert body["metric"]["name"] == "fairgate_queue_depth"
    assert body["target"]["type"] == "AverageValue"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    if case_id == "full":
        assert metric["type"] == "External"
        assert body["target"]["averageValue"] == "200"
        assert hpa["spec"]["metrics"][1]["resource"]["target"]["averageUtilization"] == 70
    else:
        assert metric["type"] == "Pods"
        assert body["metric"]["selector"] == {"matchLabels": {"priority_class": "interactive"}}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
        assert len(hpa["spec"]["metrics"]) == 1


def test_keda_scales_each_pool_on_its_desired_replicas_when_enabled(
    releases: dict[str, Release],
) -> None:
    release = releases["keda"]
    scaled = {o["metadata"]["labels"]["fairgate.io/pool"]: o for o in release.of("ScaledObject")}
    assert set(scaled) == set(KEDA_BOUNDS), scaled
    by_pool = {s["metadata"]["labels"]["fairgate.io/pool"]: s for s in release.pools()}
    for pool, (low, high) in KEDA_BOUNDS.items():
        obj, sts = scaled[pool], by_pool[pool]
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        assert obj["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"]}
        assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (low, high)
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert meta["serverAddress"] == "http://prom.monitoring:9090"
        assert meta["query"] == (
            f'max(fairgate_pool_desired_replicas{{pool="{pool}", namespace="ai"}})')
        # the signal is a replica count: one replica per unit, started from zero at once
        assert (meta["threshold"], meta["activationThreshold"]) == ("1", "0")
        assert "replicas" not in sts["spec"]
    # the pool KEDA leaves alone keeps its fixed replicas
    assert by_pool["llama-70b-short"]["spec"]["replicas"] == FULL_POOLS[2]["replicas"]
    config = release.config()
    counts: dict[str, int] = {}
    for backend in config["backends"]:
        counts[backend["pool"]] = counts.get(backend["pool"], 0) + 1
    assert counts == {"llama-8b": 6, "llama-70b-long": 3,
                      "llama-70b-short": FULL_POOLS[2]["replicas"]}, counts
    assert config["fleet"]["cold_start_wait_s"] == 900
    assert "KEDA on fairgate_pool_desired_replicas" in release.notes


def test_no_scaled_object_unless_enabled(releases: dict[str, Release]) -> None:
    for case_id, release in releases.items():
        if case_id != "keda":
            assert not release.of("ScaledObject"), case_id
            assert "fleet" not in release.config(), case_id


def test_without_hpa_the_deployment_sets_replicas(releases: dict[str, Release]) -> None:
    assert releases["default"].gateway()["spec"]["replicas"] == 2
    assert not releases["default"].of("HorizontalPodAutoscaler")


# --- Redis --------------------------------------------------------------------------------


def test_in_chart_redis_uses_aof_on_a_pvc(releases: dict[str, Release]) -> None:
    release = releases["default"]
    (sts,) = release.component("StatefulSet", "redis")
    redis = container(sts, "redis")
    args = [str(a) for a in redis["args"]]
    assert flag_value(args, "--appendonly") == "yes"
    assert flag_value(args, "--appendfsync") == "everysec"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = redis["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"] and mount["mountPath"] == flag_value(
        args, "--dir"
    )
    (svc,) = release.component("Service", "redis")
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(sts))
    url = release.config()["store"]["redis_url"]
    assert url == f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"
    assert port_of(redis, "redis") == svc["spec"]["ports"][0]["port"]


def test_external_redis_url_replaces_the_statefulset(releases: dict[str, Release]) -> None:
    release = releases["full"]
    assert release.config()["store"]["redis_url"] == EXTERNAL_REDIS
    assert not release.component("Service", "redis")
    assert not release.component("StatefulSet", "redis")
    assert "in-chart StatefulSet" not in release.notes


def test_in_chart_redis_cluster_replaces_the_single_pod(releases: dict[str, Release]) -> None:
    release = releases["cluster"]
    assert not release.component("StatefulSet", "redis")
    (sts,) = release.component("StatefulSet", "valkey-cluster")
    assert sts["spec"]["replicas"] == 6, sts["spec"]["replicas"]
    valkey = container(sts, "valkey")
    args = [str(a) for a in valkey["args"]]
    assert flag_value(args, "--cluster-enabled") == "yes"
    assert flag_value(args, "--appendonly") == "yes"
    assert flag_value(args, "--cluster-preferred-endpoint-type") == "hostname"
    (svc,) = release.component("Service", "valkey-cluster")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(sts))
    name, headless = sts["metadata"]["name"], svc["metadata"]["name"]
    port = port_of(valkey, "redis")
    config = release.config()
    assert "redis_url" not in config["store"], config
    assert config["store"]["redis_cluster"]["nodes"] == [f"{name}-{i}.{headless}:{port}"
                                                for i in range(6)]
    (job,) = release.component("Job", "valkey-cluster-create")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--cluster-replicas 1" in script, script
    assert "seq 0 5" in script, script
    gw_np = netpol(release, "gateway")
    assert any(selects(p["podSelector"], pod_labels(sts)) and egress_ports(r) == {(port, "TCP")}
               for r in gw_np["spec"]["egress"] for p in r.get("to", [])), gw_np
    assert "Redis Cluster" in release.notes


def test_an_external_redis_cluster_is_named_by_its_nodes(
        releases: dict[str, Release], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    release = releases["cluster-external"]
    assert not release.component("StatefulSet", "redis")
    assert not release.component("StatefulSet", "valkey-cluster")
    assert release.config()["store"]["redis_cluster"] == {"nodes": EXTERNAL_CLUSTER}
    egress = netpol(release, "gateway")["spec"]["egress"]
    assert any(egress_ports(r) == {(6380, "TCP")} and "to" not in r for r in egress), egress
    (secret,) = release.of("Secret")
    settings = load_gateway_settings(release, monkeypatch, tmp_path, secret["stringData"])
    assert settings.store.redis_cluster is not None and settings.store.redis_url is None
    assert settings.store.redis_cluster.nodes == EXTERNAL_CLUSTER


# --- NetworkPolicy ------------------------------------------------------------------------


def netpol(release: Release, component: str) -> dict[str, Any]:
    (np,) = release.component("NetworkPolicy", component)
    return np


def egress_ports(rule: dict[str, Any]) -> set[tuple[int | str, str]]:
    return {(p["port"], p["protocol"]) for p in rule.get("ports", [])}


@pytest.mark.parametrize("case_id", ["full", "pods-hpa"])
def test_network_policies_isolate_redis_and_vllm(
    releases: dict[str, Release], case_id: str
) -> None:
    release = releases[case_id]
    gateway_labels = pod_labels(release.gateway())
    gw_np = netpol(release, "gateway")
    assert selects(gw_np["spec"]["podSelector"], gateway_labels)
    assert set(gw_np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    egress = gw_np["spec"]["egress"]
    assert any(egress_ports(r) == {(53, "UDP"), (53, "TCP")} for r in egress)  # DNS
    # gateway -> every vLLM pool pod on its serving port
    vllm_rules = [
        r
        for r in egress
        if any(
            selects(p["podSelector"], pod_labels(s))
            for p in r.get("to", [])
            for s in release.pools()
        )
    ]
    (vllm_rule,) = vllm_rules
    for sts in release.pools():
        assert any(selects(p["podSelector"], pod_labels(sts)) for p in vllm_rule["to"])
        assert egress_ports(vllm_rule) == {(port_of(container(sts, "vllm"), "http"), "TCP")}
    # gateway -> Redis
    if release.component("StatefulSet", "redis"):
        (redis_sts,) = release.component("StatefulSet", "redis")
        (redis_rule,) = [
            r
            for r in egress
            if any(selects(p["podSelector"], pod_labels(redis_sts)) for p in r.get("to", []))
        ]
        assert egress_ports(redis_rule) == {
            (port_of(container(redis_sts, "redis"), "redis"), "TCP")
        }
        redis_np = netpol(release, "redis")
        assert selects(redis_np["spec"]["podSelector"], pod_labels(redis_sts))
        (rule,) = redis_np["spec"]["ingress"]
        assert [selects(p["podSelector"], gateway_labels) for p in rule["from"]] == [True]
    else:  # external Redis: its URL's port, and each extra backend's
        assert any(egress_ports(r) == {(6380, "TCP")} and "to" not in r for r in egress)
        assert any(egress_ports(r) == {(8100, "TCP")} and "to" not in r for r in egress)
    # vLLM: only the gateway and the metrics scrapers may connect
    vllm_np = netpol(release, "vllm")
    for sts in release.pools():
        assert selects(vllm_np["spec"]["podSelector"], pod_labels(sts))
    assert not selects(vllm_np["spec"]["podSelector"], gateway_labels)
    (rule,) = vllm_np["spec"]["ingress"]
    peers = rule["from"]
    assert selects(peers[0]["podSelector"], gateway_labels)
    assert peers[1:] == [MONITORING]
    assert egress_ports(rule) == {("http", "TCP")}
    assert {p for r in vllm_np["spec"]["egress"] for p in egress_ports(r)} == {
        (53, "UDP"),
        (53, "TCP"),
        (443, "TCP"),
        (port_of(container(release.gateway(), "gateway"), "http"), "TCP"),  # drainOnStop
    }
    (to_gateway,) = [r for r in vllm_np["spec"]["egress"] if "to" in r]
    assert selects(to_gateway["to"][0]["podSelector"], gateway_labels)
    # gateway ingress: from anywhere unless gatewayFrom is set
    (gw_in,) = gw_np["spec"]["ingress"]
    if case_id == "full":
        assert gw_in["from"][:2] == [APPS, MONITORING]
        (from_vllm,) = gw_in["from"][2:]  # the vLLM pods' drain hooks
        for sts in release.pools():
            assert selects(from_vllm["podSelector"], pod_labels(sts))
    else:
        assert "from" not in gw_in
    assert egress_ports(gw_in) == {("http", "TCP")}


# --- ServiceMonitor -----------------------------------------------------------------------


def test_service_monitors_select_the_gateway_and_vllm_services(
    releases: dict[str, Release],
) -> None:
    release = releases["full"]
    monitors = release.of("ServiceMonitor")
    services = release.of("Service")
    selected = set()
    for sm in monitors:
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        hits = [s for s in services if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
        assert hits, sm["metadata"]["name"]
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        for svc in hits:
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
            selected.add(svc["metadata"]["name"])
    wanted = {
        s["metadata"]["name"]
        for s in services
        if s["metadata"]["labels"]["app.kubernetes.io/component"] in {"gateway", "vllm"}
    }
    assert selected == wanted


def test_sentinel_topology_replaces_the_single_redis(releases: dict[str, Release],
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    release = releases["sentinel"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]["sentinel"]
    (nodes,) = release.component("StatefulSet", "redis")
    (sentinels,) = release.component("StatefulSet", "redis-sentinel")
    assert nodes["spec"]["replicas"] == 1 + values["replicas"]  # a master and its replicas
    assert sentinels["spec"]["replicas"] == values["sentinels"] >= values["quorum"]
    script = container(nodes, "redis")["args"][0]
    assert "--appendonly yes" in script and "--replicaof" in script, script
    conf = container(sentinels, "sentinel")["args"][0]
    assert f"down-after-milliseconds {values['masterName']} {values['downAfterMilliseconds']}" \
        in conf, conf
    # the gateway asks each sentinel pod, by its stable DNS name, for the master
    (svc,) = release.component("Service", "redis-sentinel")
    name, port = svc["metadata"]["name"], svc["spec"]["ports"][0]["port"]
    config = release.config()["store"]
    assert "redis_url" not in config
    assert config["redis_sentinel"] == {
        "master_name": values["masterName"],
        "nodes": [f"{sentinels['metadata']['name']}-{i}.{name}:{port}"
                  for i in range(values["sentinels"])]}
    settings = load_gateway_settings(release, monkeypatch, tmp_path, {
        "FAIRGATE_API_KEYS": "[]", "FAIRGATE_ADMIN_KEYS": "[]"})
    assert settings.store.redis_sentinel is not None and settings.store.redis_url is None
    assert settings.failover_wait_s() == values["failoverWaitSeconds"]
    assert port_of(container(sentinels, "sentinel"), "sentinel") == port
    # the gateway may reach the sentinels; the Redis pods take replication and checks
    egress = netpol(release, "gateway")["spec"]["egress"]
    assert any(egress_ports(r) == {(port, "TCP")}
               and selects(r["to"][0]["podSelector"], pod_labels(sentinels)) for r in egress)
    (rule,) = netpol(release, "redis")["spec"]["ingress"]
    assert [selects(p["podSelector"], pod_labels(w)) for p in rule["from"]
            for w in (nodes, sentinels)].count(True) == 2
    assert selects(netpol(release, "redis-sentinel")["spec"]["podSelector"], pod_labels(sentinels))
