"""Packaging: the import names are this checkout's, and the product never imports its
test rig (docs/layout.md, "Import names")."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAMES = ("gateway", "policies", "loadtest")
PRODUCT = ("gateway", "policies")
# The test rig (with the console script's composition root), its extras, a test-only client.
NOT_FOR_PRODUCT = {"loadtest", "tqdm", "matplotlib", "httpx"}
# The rig's parts the console script loads only for demo, sim and bench.
RIG = ("loadtest.demo", "loadtest.sim", "loadtest.bench")


@pytest.mark.parametrize("name", IMPORT_NAMES)
def test_import_name_is_this_checkout(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().is_relative_to(ROOT / name), module.__file__


@pytest.mark.parametrize("name", IMPORT_NAMES)
def test_no_other_distribution_provides_the_name(name: str) -> None:
    others = set(importlib.metadata.packages_distributions().get(name, [])) - {"fairgate"}
    assert not others, f"{sorted(others)} also install a top-level {name!r}"


def _imported_roots(path: Path) -> set[str]:
    """Top-level modules ``path`` imports anywhere (also inside functions), including
    ``importlib.import_module("…")`` / ``__import__("…")`` with a literal name."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (name in {"import_module", "__import__"} and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)):
                roots.add(first.value.split(".")[0])
    return roots


@pytest.mark.parametrize("package", PRODUCT)
def test_product_never_imports_the_test_rig(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offending = {str(f.relative_to(ROOT)): sorted(_imported_roots(f) & NOT_FOR_PRODUCT)
                 for f in files}
    assert not {f: names for f, names in offending.items() if names}


# Runs the console script's main() with some modules made unimportable, as if not installed.
SCRIPT = """
import sys
for name in sys.argv[2:]:
    sys.modules[name] = None
from loadtest.cli import main
sys.exit(main(sys.argv[1].split()))
"""


def _fairgate(command: str, *missing: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, command, *missing], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_serve_works_without_the_test_rig() -> None:
    result = _fairgate("serve --help", *RIG)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout


def test_help_names_every_command_without_the_test_rig() -> None:
    result = _fairgate("--help", *RIG)
    assert result.returncode == 0, result.stderr
    for command in ("serve", "demo", "sim", "bench"):
        assert command in result.stdout


@pytest.mark.parametrize(("command", "missing", "extra"), [
    ("demo", "loadtest.demo", "sim"),
    ("sim --model m", "loadtest.sim", "sim"),
    ("bench all", "loadtest.bench", "bench"),
    ("bench all --quick", "tqdm", "bench"),
    ("bench newcomer", "matplotlib", "bench"),
])
def test_missing_rig_or_extra_is_one_line_and_exit_2(command: str, missing: str,
                                                     extra: str) -> None:
    result = _fairgate(command, missing)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    name = command.split()[0]
    assert line.startswith(f"fairgate {name} needs ")
    assert f"pip install 'fairgate[{extra}]'" in line
    assert f"no module named '{missing}" in line


def test_serve_does_not_load_the_test_rig() -> None:
    code = ("import sys\nfrom loadtest.cli import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    loaded = set(ast.literal_eval(result.stdout.splitlines()[-1]))
    assert "gateway.runtime.cli" in loaded
    assert not {m for m in loaded if m.startswith(RIG) or m.split(".")[0] in
                NOT_FOR_PRODUCT - {"loadtest"}}


def test_uvloop_is_a_runtime_dependency_where_it_is_built() -> None:
    """``pip install fairgate`` serves on uvloop on CPython outside Windows (defaults are
    the product); elsewhere asyncio's loop (``gateway/core/event_loop.py``)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    uvloop = [d for d in deps if d.startswith("uvloop")]
    assert uvloop == ["uvloop>=0.19; sys_platform != 'win32' and "
                      "platform_python_implementation == 'CPython'"], deps
