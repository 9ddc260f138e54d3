"""install.sh flag detection: never a native build, never AMX, CMAKE_ARGS wins."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

INSTALL = Path(__file__).resolve().parents[1] / "install.sh"


def flags(*args: str, env: dict[str, str] | None = None) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
    full_env.update(env or {})
    out = subprocess.run(["bash", str(INSTALL), "--print-flags", *args], env=full_env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_cpu_flags_are_explicit_and_safe() -> None:
    text = flags("--cpu")
    if os.uname().machine not in ("x86_64", "amd64"):
        pytest.skip("ISA flags are only chosen on x86")
    assert "-DGGML_NATIVE=OFF" in text
    assert "-DGGML_AMX_TILE=OFF" in text and "AMX_INT8=ON" not in text
    cpuinfo = Path("/proc/cpuinfo").read_text()
    expect_avx2 = " avx2" in cpuinfo
    assert ("-DGGML_AVX2=ON" in text) is expect_avx2
    assert "-DGGML_CUDA" not in text


def test_cmake_args_override() -> None:
    assert flags(env={"CMAKE_ARGS": "-DGGML_BLAS=ON"}) == "-DGGML_BLAS=ON"


def test_unknown_option_is_an_error() -> None:
    out = subprocess.run(["bash", str(INSTALL), "--frobnicate"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith("Error: unknown option")
