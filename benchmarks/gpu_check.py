"""The checks of benchmarks/gpu_check.sh, run on the GPU machine; one JSON and one table out.

1. Both starters fully offloaded: greedy text equals the CPU run's, `ps` says 100% GPU.
2. Half the layers offloaded (num_gpu): `ps` shows the split, and the estimate's GPU bytes
   are compared with what the device reports used.
3. c = 1, 4, 16, 64: aggregate tok/s and TTFT, Corral's default mode against llama-server
   with the same slots, in one run.
4. The slot count auto mode picks on this GPU, and the estimate behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corral.registry.create import CreateRequest, create_model  # noqa: E402
from corral.registry.store import Store  # noqa: E402

PROMPT = "The capital of France is"
LEVELS = "1,4,16,64"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_used_bytes() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split()) << 20


def start(models: Path, work: Path, **env: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    full = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(models),
                CORRAL_NOPRUNE="1", CORRAL_KEEP_ALIVE="-1", XDG_STATE_HOME=str(work),
                **{f"CORRAL_{k}": v for k, v in env.items()})
    proc = subprocess.Popen([sys.executable, "-m", "corral.server"], env=full, cwd=work,
                            stderr=open(work / f"daemon-{port}.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("Error: the daemon did not start")


def greedy(url: str, model: str, **options: Any) -> tuple[str, dict[str, Any]]:
    r = httpx.post(url + "/api/generate", timeout=600, json={
        "model": model, "prompt": PROMPT, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 16, **options}})
    r.raise_for_status()
    ps = [m for m in httpx.get(url + "/api/ps").json()["models"] if m["name"] == model][0]
    return str(r.json()["response"]), ps


def offload_checks(url: str, names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        cpu_text, _ = greedy(url, name, num_gpu=0)
        httpx.post(url + "/api/generate", json={"model": name, "keep_alive": 0}, timeout=60)
        time.sleep(2)
        before = gpu_used_bytes()
        gpu_text, ps = greedy(url, name)
        full_used = gpu_used_bytes() - before
        layers = int(httpx.post(url + "/api/show", json={"model": name}).json()["model_info"]
                     .get(f"{ps['details']['family']}.block_count", 0))
        httpx.post(url + "/api/generate", json={"model": name, "keep_alive": 0}, timeout=60)
        time.sleep(2)
        before = gpu_used_bytes()
        _, half = greedy(url, name, num_gpu=max(1, layers // 2))
        half_used = gpu_used_bytes() - before
        rows.append({"model": name, "cpu_text": cpu_text, "gpu_text": gpu_text,
                     "same_first_tokens": gpu_text[:24] == cpu_text[:24],
                     "full": {"size": ps["size"], "size_vram": ps["size_vram"],
                              "device_used": full_used},
                     "half": {"num_gpu": layers // 2, "size": half["size"],
                              "size_vram": half["size_vram"], "device_used": half_used,
                              "estimate_error": half["size_vram"] / max(half_used, 1) - 1}})
    return rows


def slot_count(url: str, model: str) -> int:
    """The slots auto mode chose, from the daemon's own /metrics gauge."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("corral_slots{") and f'"{model}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def bench(url: str, model: str, out: Path, levels: str = LEVELS) -> list[dict[str, Any]]:
    subprocess.run([sys.executable, "-c", "from corral.cli.launch import main; main()", "bench", model,
                    "--api", "openai", "--base-url", url, "--concurrency", levels,
                    "--max-tokens", "64", "--prompt-tokens", "32", "--seed", "1",
                    "--json", str(out)], check=True, timeout=1800)
    return list(json.loads(out.read_text())["levels"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--bin", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--build-seconds", type=int, default=0)
    args = parser.parse_args()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    store = Store(work / "models")
    names = []
    for gguf in sorted(args.models.glob("*.gguf")):
        name = gguf.stem.replace("-", ":", 1) if gguf.stem.count("-") else gguf.stem
        with gguf.open("rb") as f:
            digest, _ = store.import_blob(f)
        create_model(store, CreateRequest(model=name, files={gguf.name: digest}))
        names.append(name)
    url, proc = start(store.root, work)
    try:
        offload = offload_checks(url, names)
        ps = greedy(url, names[0])[1]
        slots = slot_count(url, names[0])
        corral = bench(url, names[0], args.out / "corral.json")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    model_path = next(p for p in args.models.glob("*.gguf") if p.stem.startswith(
        names[0].split(":")[0]))
    port = free_port()
    server = subprocess.Popen([str(args.bin / "llama-server"), "-m", str(model_path), "--port",
                               str(port), "-ngl", "999", "--parallel", str(slots), "-c",
                               str(4096 * slots)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        reference = bench(f"http://127.0.0.1:{port}", names[0], args.out / "llama-server.json")
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {"build_seconds": args.build_seconds, "offload": offload, "auto": {
        "slots": slots, "ps": ps}, "corral": corral,
        "llama_server": reference}
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu_check.md").write_text(table(result))
    print(table(result))


def table(result: dict[str, Any]) -> str:
    lines = [f"CUDA build: {result['build_seconds']} s; auto mode chose "
             f"{result['auto']['slots']} slots.", "",
             "| model | same greedy start | full size / vram MB | half: estimate vs device |",
             "|---|---|---|---|"]
    for row in result["offload"]:
        lines.append(f"| {row['model']} | {row['same_first_tokens']} | "
                     f"{row['full']['size'] / 1e6:.0f} / {row['full']['size_vram'] / 1e6:.0f} | "
                     f"{row['half']['estimate_error']:+.0%} |")
    lines += ["", "| c | Corral tok/s | llama-server tok/s | Corral TTFT p50 ms | "
              "llama-server TTFT p50 ms |", "|---|---|---|---|---|"]
    for ours, ref in zip(result["corral"], result["llama_server"]):
        lines.append(f"| {ours['label']} | {ours['output_throughput']:.0f} | "
                     f"{ref['output_throughput']:.0f} | {ours['ttft']['median'] * 1000:.0f} | "
                     f"{ref['ttft']['median'] * 1000:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
