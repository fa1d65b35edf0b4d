"""Alert rules: promtool-valid, unit-tested with promtool, reading metrics that exist."""

from __future__ import annotations

import subprocess

import yaml

from tests.ops.conftest import require_tool
from tests.ops.promql import ROOT, fairgate_names, referenced_metrics

PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rules" / "fairgate.yml"
CASES = PROM / "tests" / "fairgate_test.yml"
ALERTS = {"FairgateInteractiveQueueWaitOverSLO", "FairgateDefaultQueueWaitOverSLO",
          "FairgateBackendUnhealthy", "FairgateBackendTPOTHigh", "FairgateRedisErrors",
          "FairgateBatchClassStalled", "FairgateBatchJobsStalled", "FairgateShareBelowWeight"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 9 rules found" in result.stdout


def test_rule_unit_cases_pass_and_cover_every_alert() -> None:
    result = promtool("test", "rules", str(CASES))
    assert result.returncode == 0, result.stdout + result.stderr
    cases = yaml.safe_load(CASES.read_text())
    tested = {t["alertname"] for case in cases["tests"] for t in case["alert_rule_test"]}
    assert tested == ALERTS
    firing = {t["alertname"] for case in cases["tests"] for t in case["alert_rule_test"]
              if t["exp_alerts"]}
    assert firing == ALERTS - {"FairgateDefaultQueueWaitOverSLO"}


def test_rules_read_metrics_fairgate_exports() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules if "alert" in r} == ALERTS
    recorded = {r["record"] for r in rules if "record" in r}
    known = fairgate_names() | recorded
    for rule in rules:
        names = referenced_metrics(rule["expr"])
        assert names and names <= known, (rule.get("alert") or rule["record"], names - known)
    tpot = next(r for r in rules if r.get("alert") == "FairgateBackendTPOTHigh")
    assert "> 0.15" in tpot["expr"] and tpot["for"] == "5m"


def test_prometheus_configs_load_these_rules() -> None:
    for config in ("prometheus.yml", "prometheus.sim.yml"):
        assert "rules/*.yml" in yaml.safe_load((PROM / config).read_text())["rule_files"]
