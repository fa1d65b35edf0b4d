from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.core.settings import load_settings

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
