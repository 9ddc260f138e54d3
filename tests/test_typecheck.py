"""The packages stay mypy-clean (configured in pyproject.toml).

mypy finds modules by their path, and the layer folders sit at the top of the
repository while they install as `corral.<folder>`; so it checks a tree of links laid
out as the installed package is (the foundation's files, and each layer as a
subfolder), kept under build/ so that its cache survives between runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("registry", "runner", "server", "api", "cli")


def installed_layout(tree: Path) -> Path:
    package = tree / "corral"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "corral").glob("*.py")}
    wanted.update({layer: ROOT / layer for layer in LAYERS})
    for link in package.iterdir():
        if link.name not in wanted or not link.is_symlink():
            link.unlink() if link.is_symlink() or link.is_file() else None
    for name, target in wanted.items():
        link = package / name
        if not link.is_symlink():
            link.symlink_to(target)
    return tree


def test_mypy_is_clean() -> None:
    tree = installed_layout(ROOT / "build" / "mypy-tree")
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          str(ROOT / "pyproject.toml"), "--cache-dir",
                          str(ROOT / "build" / "mypy-cache"), "-p", "corral"],
                         cwd=tree, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
