"""The package stays mypy-clean (configured in pyproject.toml), checked as it lies in
the checkout: `corral/` is the package users install, so no link tree is needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*targets: str) -> None:
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          str(ROOT / "pyproject.toml"), "--cache-dir",
                          str(ROOT / "build" / "mypy-cache"), *targets],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean() -> None:
    _mypy("-p", "corral")


def test_the_benchmarks_are_mypy_clean() -> None:
    """The benchmarks run by hand, so a type error there waits for the next run by hand:
    engine_scaling.py indexed the engine's typed end record as a dict, and every run of
    it ended in a ZeroDivisionError, until mypy here named the line."""
    _mypy("--explicit-package-bases",
          *sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py")))
