"""The packages stay mypy-clean (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_mypy_is_clean() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
