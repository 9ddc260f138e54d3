"""The CLI entry point as a user runs it: version, list, errors."""

from __future__ import annotations

import os
import subprocess
import sys


def corral(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", "from corral.cli.launch import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_version() -> None:
    out = corral("--version")
    assert out.returncode == 0 and out.stdout.startswith("corral version ")


def test_unknown_command_is_an_error_without_traceback() -> None:
    out = corral("frobnicate")
    assert out.returncode == 1
    assert out.stderr.startswith("Error: ") and "Traceback" not in out.stderr


def test_serve_help_lists_the_environment() -> None:
    out = corral("serve", "--help")
    assert out.returncode == 0 and "CORRAL_KEEP_ALIVE" in out.stdout


def test_help_shows_each_example_on_its_own_line() -> None:
    out = corral("--help")
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert out.returncode == 0
    assert 'cat notes.txt | corral run MODEL "Summarize:"' in lines
    assert any(line.startswith("corral pull llama3.2") and line.endswith("registry")
               for line in lines)
    assert any(line.startswith("open http://127.0.0.1:11434/ui") for line in lines)
