"""The package stays mypy-clean (configured in pyproject.toml), checked as it lies in
the checkout: `corral/` is the package users install, so no link tree is needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          str(ROOT / "pyproject.toml"), "--cache-dir",
                          str(ROOT / "build" / "mypy-cache"), "-p", "corral"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
