"""The GPU check's CPU rehearsal: `benchmarks/gpu_check.sh prepare`, then `run --cpu`, here.

Everything the lent CUDA machine will run, but the CUDA build: the repack is configured
with CMake, the wheels are installed as for Python 3.12, the random model is made and
quantized by Corral's create, and every check runs on the tiny model. The table's GPU
branches are checked on a result shaped like a CUDA run's. The rehearsal needs the
package index and CMake, so it is marked `network` and runs only with CORRAL_TEST_NETWORK=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.registry.gguf import inspect_gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_report import table  # noqa: E402


# pip downloads llama-cpp-python's sources and the wheels, and CMake configures them.
@pytest.mark.network
def test_rehearsal_runs_every_step_but_cuda(chat_gguf: Path, tmp_path: Path) -> None:
    prep, out, build = tmp_path / "gpu", tmp_path / "out", tmp_path / "build"
    env = dict(os.environ, GPU_CHECK_DIR=str(prep), GPU_CHECK_CHAT=str(chat_gguf), OUT=str(out),
               GPU_CHECK_BUILD=str(build))
    env.pop("CORRAL_HOST", None)
    prepared = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "prepare"],
                              env=env, capture_output=True, text=True, timeout=900)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    travel = [ln for ln in prepared.stdout.splitlines() if "what travels" in ln]
    assert travel and int(travel[0].split(": ")[1].split()[0]) < 64
    wheels = {p.name.split("-")[0] for p in (prep / "wheels").glob("*.whl")}
    assert {"corral", "pydantic_core", "gguf", "uvicorn", "starlette"} <= wheels
    assert (prep / "tokenizer.gguf").stat().st_size < 8 << 20
    ran = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "run", "--cpu"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert (build / "site312/pydantic").is_dir()  # the wheels install as for 3.12
    assert not (prep / "build").exists()  # what travels stays as prepared
    result = json.loads((out / "gpu_check.json").read_text())
    checks = result["checks"]
    assert result["mode"] == "cpu rehearsal" and result["gpu"] is None
    # The bindings are the repacked Python sources, over libraries outside the package.
    assert result["bindings"].startswith(str(build / "src/llama_cpp"))
    assert result["libraries"] and "build" not in result["libraries"]
    assert not [k for k, v in checks.items() if "error" in v]
    model = checks["model"]
    assert model["parameters"] > 1e7 and isinstance(model["quantize_seconds"], float)
    # What create made of the F16 it wrote is Q4_K_M (its work folder, under build, stays).
    assert inspect_gguf(model["path"]).quantization == "Q4_K_M"
    assert checks["full_offload"]["equal"] and checks["full_offload"]["tokens"] == 32
    assert checks["full_offload"]["daemon_vram"] is None  # no nvidia-smi here
    assert checks["half_offload"]["split_gpu"] == 0  # no device: nothing claimed on one
    growth = checks["corral"]["growth"]
    assert growth["grew"] and growth["shrank"] and growth["idle"]["slots"] == 1
    assert [lv["c"] for lv in checks["corral"]["levels"]] == [1, 4]
    assert all(lv["failed"] == 0 and lv["tok_s"] > 0 for lv in checks["corral"]["levels"])
    peer = checks["llama_server"]
    assert "skipped" in peer or [lv["c"] for lv in peer["levels"]] == [1, 4]
    assert checks["auto_cap"]["measured_cap"] in (2, 4, 8)
    assert "| 1 |" in (out / "gpu_check.md").read_text()
    # The device tool brings back at most 8 files from $OUT, none of them a model.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and max(p.stat().st_size for p in files) < 16 << 20


@pytest.mark.parametrize("error", [None, 0.04])
def test_table_shows_a_cuda_runs_readings(error: float | None) -> None:
    result = {"mode": "cuda", "gpu": "NVIDIA H200", "build_seconds": 250, "checks": {
        "model": {"parameters": 1.07e9, "write_seconds": 9.0, "quantize_seconds": 20.0},
        "full_offload": {"tokens": 32, "equal": False, "first_difference": 17,
                         "cpu_margin_there": 0.02, "within_tolerance": True, "size": 9e8,
                         "size_vram": 9e8, "all_on_gpu": True, "skipped": None,
                         "daemon_vram": 0},
        "half_offload": {"num_gpu": 8, "split_gpu": 0.45, "estimate_vram": 4e8,
                         "nvidia_smi_vram": 4.2e8, "estimate_error": error},
        "corral": {"levels": [{"c": 1, "tok_s": 300.0, "ttft_p50_ms": 9, "failed": 0}],
                   "growth": {"idle": {"slots": 1, "size": 9e8, "nvidia_smi": 1.1e9},
                              "busiest": {"slots": 16, "size": 2e9, "nvidia_smi": 2.3e9},
                              "after_quiet": {"slots": 8, "size": 1.5e9, "nvidia_smi": 1.8e9,
                                              "seconds": 31.0}}},
        "llama_server": {"levels": [{"c": 1, "tok_s": 320.0, "ttft_p50_ms": 8, "failed": 0}]},
        "auto_cap": {"levels": [{"c": 32, "tok_s": 5000.0}, {"c": 64, "tok_s": 5200.0}],
                     "measured_cap": 32, "guessed_cap": 32}}}
    text = table(result)
    assert "NVIDIA H200" in text and "CUDA build 250 s" in text
    assert "differ at token 17" in text and "100% GPU" in text
    assert "| 1. VRAM held by the daemon process itself | none |" in text
    assert "| 1 | 300.0 | 320.0 | 0.94x | 9 ms | 8 ms |" in text
    assert "measured 32 (guessed 32)" in text and "busiest 16 slots" in text
    assert ("(estimate +4%)" in text) == (error is not None)
