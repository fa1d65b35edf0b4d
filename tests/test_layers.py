"""The layering of docs/architecture.md is kept: import-linter's contracts
(``[tool.importlinter]`` in pyproject.toml, also run by ``make lint``) hold, and the doc's
folder sections follow the contract's order."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _folder_layers() -> list[set[str]]:
    """The ``gateway-folders`` contract's layers, top first, each a set of sibling names."""
    (contract,) = [c for c in CONFIG["contracts"] if c["id"] == "gateway-folders"]
    return [{name.strip() for name in re.split(r"[|:]", layer)} for layer in contract["layers"]]


def test_every_contract_is_kept() -> None:
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, check=False)
    out = done.stdout + done.stderr
    contracts = len(CONFIG["contracts"])
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{out}"
    assert f"Contracts: {contracts} kept, 0 broken." in out, out


def test_no_contract_ignores_an_import() -> None:
    ignoring = {c["id"]: c["ignore_imports"] for c in CONFIG["contracts"] if "ignore_imports" in c}
    assert not ignoring, f"contracts with an escape hatch: {ignoring}"


def test_architecture_doc_lists_the_folders_in_the_contracts_order() -> None:
    layers = _folder_layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    headings = re.findall(r"^#### `gateway/([a-z_]+)/",
                          (ROOT / "docs" / "architecture.md").read_text(), re.M)
    ranks = [(folder, rank.get(folder)) for folder in headings]
    assert all(r is not None for _, r in ranks), f"a folder the contract lacks: {ranks}"
    assert [r for _, r in ranks] == sorted(r for _, r in ranks if r is not None), \
        f"docs/architecture.md's folder sections out of the contract's order: {ranks}"
    folders = {p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").exists()}
    assert folders <= set(headings), f"folders without a section: {folders - set(headings)}"
