"""The README is a map and the docs name only what exists.

Every `corral` subcommand, `CORRAL_*`/`OLLAMA_*` variable and route that README.md and
docs/*.md name is checked against its source: the typer app, the settings table in
corral/config.py and the daemon's route table. Every relative link resolves, anchor
included, and docs/configuration.md is what docs/make_configuration.py writes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import typer.main

from corral.cli.main import app
from corral.config import SPECS
from corral.server.daemon import routes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans: where commands are written out."""
    blocks = FENCE.findall(text)
    return blocks + SPAN.findall(FENCE.sub("", text))


def _where(found: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} ({', '.join(sorted(pages))})" for name, pages in found.items())


def test_readme_is_a_map_of_at_most_200_lines() -> None:
    lines = len(_text(README).splitlines())
    assert lines <= 200, f"README.md has {lines} lines: move details into a page under docs/"


def test_configuration_page_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_configuration",
                                                  ROOT / "docs" / "make_configuration.py")
    assert spec and spec.loader
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert _text(ROOT / "docs" / "configuration.md") == generator.render(), (
        "docs/configuration.md differs from corral/config.py's settings table: "
        "run `.venv/bin/python docs/make_configuration.py`")


def test_docs_name_only_real_subcommands() -> None:
    commands = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    unknown: dict[str, set[str]] = {}
    for page in PAGES:
        for code in _code(_text(page)):
            for name in re.findall(r"(?<![\w/.-])corral ([a-z][\w-]*)", code):
                if name not in commands:
                    unknown.setdefault(name, set()).add(page.name)
    assert not unknown, f"no such subcommand: {_where(unknown)}"


def _suite_variables() -> set[str]:
    """The variables the test suite itself reads (CORRAL_TEST_NETWORK and the like)."""
    read = re.compile(r"environ(?:\.get\(|\[)\"((?:CORRAL|OLLAMA)_\w+)\"")
    return {name for path in (ROOT / "tests").glob("*.py") for name in read.findall(_text(path))}


def test_docs_name_only_real_variables() -> None:
    settings = {prefix + spec.name for spec in SPECS for prefix in ("CORRAL_", "OLLAMA_")}
    known = settings | _suite_variables()
    unknown: dict[str, set[str]] = {}
    for page in PAGES:
        for name in re.findall(r"\b(?:CORRAL|OLLAMA)_[A-Z0-9_]+", _text(page)):
            # `CORRAL_MAX_*` names a family: some setting must start so.
            ok = (name in known if not name.endswith("_")
                  else any(s.startswith(name) for s in settings))
            if not ok:
                unknown.setdefault(name, set()).add(page.name)
    assert not unknown, f"no such variable in corral/config.py: {_where(unknown)}"


def _route_patterns() -> list[re.Pattern[str]]:
    table = routes(None, None, None)  # type: ignore[arg-type]  # the handlers are not called
    patterns = []
    for _, path, _ in table:
        pattern = re.escape(path)
        pattern = re.sub(r"\\\{\w+:path\\\}", ".+", pattern)
        patterns.append(re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", pattern)))
    return patterns


def _named_routes(text: str, readme: bool) -> set[str]:
    """/api, /v1, /v2 and /corral paths anywhere; any path in a curl URL; and, in the
    README's API table, every path in the route column."""
    named = set(re.findall(r"(?<![\w./~-])/(?:api|v1|v2|corral)\b[^\s`'\"|)\]]*", text))
    named |= set(re.findall(r"(?:localhost|127\.0\.0\.1):11434(/[^\s`'\"|)\]]*)", text))
    if readme:
        for row in re.findall(r"^\| (`[^|]*) \|", text, re.M):
            named |= {word for span in SPAN.findall(row) for word in span.split()
                      if word.startswith("/")}
    return {name.rstrip(".,:;*") or "/" for name in named}


def test_docs_name_only_real_routes() -> None:
    patterns = _route_patterns()
    prefixes = {p.pattern.replace("\\", "") for p in patterns}

    def real(path: str) -> bool:
        if any(p.fullmatch(path) for p in patterns):
            return True  # a route, or a family of routes such as `/v1` or `/api/blobs`
        return any(prefix.startswith(path.rstrip("/") + "/") for prefix in prefixes)

    unknown: dict[str, set[str]] = {}
    for page in PAGES:
        for path in _named_routes(_text(page), page == README):
            if not real(path):
                unknown.setdefault(path, set()).add(page.name)
    assert not unknown, f"no such route in corral/server/daemon.py: {_where(unknown)}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", _text(path)), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_docs_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", _text(page))):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check offline
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
