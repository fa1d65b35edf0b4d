"""Render the chart with Helm's own engine (helm-python-sdk: Helm v4's Go SDK via ctypes).

Run as a subprocess by the tests, so the Go runtime inside libhelm_c never lives in the
pytest process. Reads a JSON request on stdin and writes a JSON answer on stdout:

    {"chart": DIR, "renders": {ID: {"values": {...}, "name": R, "namespace": NS}},
     "lints": {ID: {"values": {...}, "kube_version": "v1.29.0"}}}
    -> {"versions": {...}, "renders": {ID: {"manifests": {PATH: TEXT}} | {"error": MSG}},
        "lints": {ID: REPORT}}
"""

from __future__ import annotations

import json
import sys
from typing import Any

import helm_python as helm


def main() -> None:
    request: dict[str, Any] = json.load(sys.stdin)
    answer: dict[str, Any] = {
        "versions": {"helm_sdk": helm.helm_sdk_version(), "helm_c": helm.helm_c_version()},
        "renders": {},
        "lints": {},
    }
    with helm.Chart.load(request["chart"]) as chart:
        for case_id, case in request.get("renders", {}).items():
            try:
                manifests = chart.render(
                    case.get("values") or {},
                    name=case.get("name", "fg"),
                    namespace=case.get("namespace", "ai"),
                    is_install=True,
                )
            except helm.HelmError as exc:
                answer["renders"][case_id] = {"error": str(exc)}
            else:
                answer["renders"][case_id] = {"manifests": manifests}
    for case_id, case in request.get("lints", {}).items():
        answer["lints"][case_id] = helm.lint(
            request["chart"],
            case.get("values") or {},
            strict=True,
            kube_version=case.get("kube_version"),
        )
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
