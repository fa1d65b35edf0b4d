"""Class defaults are written once, in the class table (``policies/classes.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.core.settings import ClassConfig, load_settings
from policies.classes import CLASSES, DEFAULT_CLASS, SPECS
from policies.gates import GatePolicy

ROOT = Path(__file__).resolve().parents[1]


def test_settings_start_from_the_table() -> None:
    settings = load_settings(None)
    for spec in CLASSES:
        got = settings.classes[spec.name]
        want = {f: getattr(spec, f) for f in ClassConfig.model_fields}
        assert got.model_dump() == want, (spec.name, got)
    assert settings.fairness.class_floors == {c.name: c.floor for c in CLASSES if c.floor > 0}


def test_a_partial_class_entry_keeps_the_rest_of_its_row() -> None:
    got = load_settings(None, classes={"batch": {"max_waiting": 5}}).classes["batch"]
    assert got.max_waiting == 5, got
    assert got.max_queue_wait_s == SPECS["batch"].max_queue_wait_s, got
    assert got.priority_base == SPECS["batch"].priority_base, got


def test_gate_defaults_are_the_default_class_row() -> None:
    gate = GatePolicy()
    assert (gate.max_waiting, gate.max_tpot_ms, gate.max_kv_usage) == (
        DEFAULT_CLASS.max_waiting, DEFAULT_CLASS.max_tpot_ms, DEFAULT_CLASS.max_kv_usage), gate


@pytest.mark.parametrize("page", ["README.md", "docs/configuration.md"])
def test_the_docs_show_the_table(page: str) -> None:
    text = (ROOT / page).read_text()
    shown = dict(re.findall(r"^  (\w+): +\{(max_waiting: .*)\}$", text, re.M))
    assert set(shown) == set(SPECS), (page, shown)
    for name, row in shown.items():
        values = dict(part.split(": ") for part in row.split(", "))
        spec = SPECS[name]
        assert values == {"max_waiting": str(spec.max_waiting),
                          "max_tpot_ms": f"{spec.max_tpot_ms:g}",
                          "max_queue_wait_s": f"{spec.max_queue_wait_s:g}",
                          "priority_base": str(spec.priority_base)}, (name, values)
