"""The install smoke check decodes with the real starter model in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # llama.cpp runs in every test here


def test_smoke_decodes_tokens(starter_gguf: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "corral.runner.tools.smoke", str(starter_gguf)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("llama.cpp works: ")


def test_smoke_fails_cleanly_on_a_bad_model(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    out = subprocess.run([sys.executable, "-m", "corral.runner.tools.smoke", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
