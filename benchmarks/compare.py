"""Side by side on one machine: llama.cpp's llama-server, Corral with N slots, Corral with 1.

Runs the same `corral bench` load over the OpenAI route against each, with the
starter model, the same thread count and concurrency 1, 2, 4, 8; prints one
table of ratios and appends the results (date, CPU, versions) to
benchmarks/RESULTS.md. Also runs llama-bench (tg128, pp512) as the engine floor.

    .venv/bin/python benchmarks/compare.py [--slots 4] [--requests 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corral.config import load_settings  # noqa: E402
from registry.starter import STARTER_NAME, starter_model_path  # noqa: E402
from registry.store import Store  # noqa: E402
from runner.native import physical_cores  # noqa: E402

LEVELS = "1,2,4,8"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"Error: server at {url} exited with {proc.returncode}")
        try:
            # llama-server answers /health; Corral answers /.
            if any(httpx.get(url + path, timeout=2).status_code == 200 for path in ("/health", "/")):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"Error: {url} did not become healthy")


def bench(url: str, out: Path, args: argparse.Namespace, dataset: str = "random",
          levels: str = LEVELS) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-c", "from cli.main import main; main()", "bench", STARTER_NAME,
           "--api", "openai", "--base-url", url, "--concurrency", levels,
           "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
           "--dataset", dataset, "--seed", "1", "--json", str(out)]
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    warm = {"model": STARTER_NAME, "prompt": "warm up", "max_tokens": 4}
    httpx.post(url + "/v1/completions", json=warm, timeout=300)
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=3600)
    return list(json.loads(out.read_text())["levels"])


def start_corral(slots: int, num_ctx: int, threads: int) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_NUM_PARALLEL=str(slots),
               CORRAL_CONTEXT_LENGTH=str(num_ctx), CORRAL_KEEP_ALIVE="-1", CORRAL_NOPRUNE="1")
    proc = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", "serve"],
                            cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    # num_thread is a load option: pin it so every contender uses the same threads.
    httpx.post(url + "/api/generate", timeout=300, json={
        "model": STARTER_NAME, "options": {"num_thread": threads, "num_ctx": num_ctx}})
    return url, proc


def start_llama_server(binaries: Path, model: Path, slots: int, num_ctx: int, threads: int
                       ) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(binaries))
    proc = subprocess.Popen([str(binaries / "llama-server"), "-m", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--parallel", str(slots),
                             "-c", str(num_ctx * slots), "-t", str(threads), "-tb", str(threads),
                             "--cont-batching"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return url, proc


def llama_bench(binaries: Path, model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(binaries / "llama-bench"), "-m", str(model), "-t", str(threads),
                          "-p", "512", "-n", "128", "-o", "json"], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=str(binaries)), timeout=1800)
    rows = json.loads(out.stdout or "[]")
    result = {}
    for row in rows:
        kind = f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row['n_gen']}"
        result[kind] = float(row["avg_ts"])
    return result


def by_level(levels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {lv["label"]: lv for lv in levels}


def decode_rate(lv: dict[str, Any]) -> float:
    tpot = lv["tpot"]["mean"]
    return 1 / tpot if tpot and tpot == tpot else float("nan")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and b == b and a == a else "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--num-ctx", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    model = starter_model_path(Store(load_settings().models))
    if model is None:
        raise SystemExit("Error: the starter model is not installed; run ./install.sh")
    build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                           capture_output=True, text=True, check=True)
    binaries = Path(build.stdout.strip().splitlines()[-1])
    work = ROOT / "benchmarks" / ".out"
    work.mkdir(exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for label, starter in (
            ("llama-server", lambda: start_llama_server(binaries, model, args.slots,
                                                        args.num_ctx, threads)),
            (f"corral-{args.slots}", lambda: start_corral(args.slots, args.num_ctx, threads)),
            ("corral-1", lambda: start_corral(1, args.num_ctx, threads))):
        url, proc = starter()
        try:
            results[label] = bench(url, work / f"{label}.json", args)
            if label.startswith("corral-") and label != "corral-1":
                results[label + "-chat"] = bench(url, work / f"{label}-chat.json", args,
                                                 dataset="chat", levels=str(args.slots))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    floor = llama_bench(binaries, model, threads)
    report(args, threads, results, floor)


def report(args: argparse.Namespace, threads: int, results: dict[str, list[dict[str, Any]]],
           floor: dict[str, float]) -> None:
    ref = by_level(results["llama-server"])
    ours = by_level(results[f"corral-{args.slots}"])
    one = by_level(results["corral-1"])
    chat = results.get(f"corral-{args.slots}-chat", [{}])[0].get("ttft_by_turn", {})
    lines = [f"| conc | llama-server tok/s | corral-{args.slots} tok/s | corral-1 tok/s | "
             f"ratio vs llama-server | ratio vs 1 slot | TTFT p50 ratio |", "|---|---|---|---|---|---|---|"]
    for level in LEVELS.split(","):
        r, o, s = ref[level], ours[level], one[level]
        lines.append(f"| {level} | {r['output_throughput']:.1f} | {o['output_throughput']:.1f} | "
                     f"{s['output_throughput']:.1f} | "
                     f"{ratio(o['output_throughput'], r['output_throughput'])} | "
                     f"{ratio(o['output_throughput'], s['output_throughput'])} | "
                     f"{ratio(o['ttft']['median'], r['ttft']['median'])} |")
    turn1, turn5 = chat.get("1") or chat.get(1), chat.get("5") or chat.get(5)
    targets = [
        ("c=1 decode tok/s vs llama-server (>= 0.9)",
         ratio(decode_rate(ours["1"]), decode_rate(ref["1"]))),
        ("c=4 output tok/s vs llama-server 4 slots (>= 0.9)",
         ratio(ours["4"]["output_throughput"], ref["4"]["output_throughput"])),
        ("c=4 output tok/s vs corral 1 slot (>= 2)",
         ratio(ours["4"]["output_throughput"], one["4"]["output_throughput"])),
        ("c=8 TTFT p50 vs llama-server (<= 1.25)",
         ratio(ours["8"]["ttft"]["median"], ref["8"]["ttft"]["median"])),
        ("chat TTFT turn 5 vs turn 1 (<= 1.5)", ratio(turn5 or 0, turn1 or 0)),
        ("warm TTFT c=1, 32-token prompt, vs llama-server (<= 1.2)",
         ratio(ours["1"]["ttft"]["median"], ref["1"]["ttft"]["median"])),
    ]
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib.metadata import version

    text = [f"## {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}: {cpu}, {threads} threads",
            "", f"corral {version('corral')}, llama-cpp-python {version('llama-cpp-python')}, "
            f"{args.slots} slots, num_ctx {args.num_ctx}, {args.prompt_tokens} prompt / "
            f"{args.max_tokens} output tokens, {args.requests} requests per level, OpenAI route.",
            "", *lines, "", "| target | ratio |", "|---|---|",
            *[f"| {name} | {value} |" for name, value in targets], "",
            f"Engine floor (llama-bench, {threads} threads): "
            + ", ".join(f"{k} {v:.1f} tok/s" for k, v in floor.items()), "",
            "Chat TTFT p50 by turn (ms): "
            + ", ".join(f"{k}: {v * 1000:.0f}" for k, v in chat.items()), "", ""]
    print("\n".join(text))
    results_md = ROOT / "benchmarks" / "RESULTS.md"
    if not results_md.exists():
        results_md.write_text("# Benchmark results\n\nAppended by `benchmarks/compare.py`.\n\n")
    with results_md.open("a") as f:
        f.write("\n".join(text))


if __name__ == "__main__":
    main()
