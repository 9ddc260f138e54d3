"""The built wheel carries every package and subpackage a user install needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGES = ("corral", "registry", "runner", "server", "api", "cli")


def test_every_package_is_listed() -> None:
    root = Path(__file__).resolve().parents[1]
    found = {p.parent.name for p in root.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert found == set(PACKAGES)


def test_wheel_contains_every_module(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a clean copy: a stale build/ would hide missing packages
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "-w", str(tmp_path), str(src)], check=True, timeout=300)
    [wheel] = list(tmp_path.glob("corral-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every layer folder lands under the one `corral` namespace.
    expected = {("corral/" if pkg != "corral" else "") + str(p.relative_to(root))
                for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    page = {f"corral/server/ui/{p.name}" for p in (root / "server" / "ui").iterdir()}
    assert page and page <= names, sorted(page - names)  # the page at /ui ships in the wheel
    top = {n.split("/")[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert top == {"corral"}, top  # no bare `api`, `server`, `runner`... in site-packages
