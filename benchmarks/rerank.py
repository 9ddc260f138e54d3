"""Rerank throughput: documents per second on one request of 64 documents, Corral's
/v1/rerank against llama-server's `--reranking` on the same GGUF, same threads, one run.

A real-size reranker is not available offline, so the GGUF is tests/rerank_model.py's
`bench` shape (a random Qwen3-Reranker, 512 wide, 8 layers, on the chat starter's
vocabulary, with Qwen3-Reranker's rerank template). Each server gets a warm-up request,
then REPEATS timed ones; the median counts. The scores of the two are compared too (the
largest difference, which should be under 1e-4), and the result is appended to
benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/rerank.py [--threads N] [--no-llama-server]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import free_port, serve_gguf, wait_healthy  # noqa: E402
from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.starter import CHAT_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from tests.rerank_model import SHAPES, write_reranker  # noqa: E402

N_DOCS, REPEATS, NUM_CTX, MODEL = 64, 3, 2048, "bench-reranker"
QUERY = "How do batteries store energy for electric cars?"


def documents() -> list[str]:
    """64 passages of 30 to 90 words, the same every run."""
    words = ("lithium cell charge voltage anode cathode car engine road energy storage grid "
             "solar panel river bank history museum recipe flour oven bread").split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(30 + (i * 13) % 61))
            for i in range(N_DOCS)]


def timed(url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """Median seconds of REPEATS requests after one warm-up, and the scores by index."""
    httpx.post(url, json=body, timeout=600).raise_for_status()
    times, scores = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        r = httpx.post(url, json=body, timeout=600)
        times.append(time.perf_counter() - start)
        r.raise_for_status()
        by_index = {res["index"]: res["relevance_score"] for res in r.json()["results"]}
        scores = [by_index[i] for i in range(N_DOCS)]
    return statistics.median(times), scores


def corral(gguf: Path, tmp: Path) -> tuple[float, list[float]]:
    # The runner takes the daemon's share of the cores (the physical ones, alone).
    url, proc = serve_gguf(gguf, MODEL, tmp, CONTEXT_LENGTH=str(NUM_CTX))
    try:
        return timed(url + "/v1/rerank", {"model": MODEL, "query": QUERY,
                                          "documents": documents()})
    finally:
        proc.terminate()
        proc.wait(30)


def llama_server(binaries: Path, gguf: Path, threads: int) -> tuple[float, list[float]]:
    port = free_port()
    proc = subprocess.Popen(
        [str(binaries / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
         str(port), "--reranking", "-c", str(NUM_CTX * 4), "--parallel", "4",
         "-t", str(threads), "-tb", str(threads)],
        env=dict(os.environ, LD_LIBRARY_PATH=str(binaries)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        return timed(url + "/v1/rerank", {"model": MODEL, "query": QUERY,
                                          "documents": documents()})
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    chat = starter_model_path(Store(load_settings().models), CHAT_NAME)
    if chat is None:
        raise SystemExit("Error: the chat starter is not installed; run ./install.sh")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_reranker(chat, Path(tmp) / "bench-reranker.gguf", SHAPES["bench"])
        ours, our_scores = corral(gguf, Path(tmp))
        lines = [f"corral: {N_DOCS / ours:.1f} docs/s ({ours:.3f} s a request)"]
        if not args.no_llama_server:
            build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                                   capture_output=True, text=True, check=True)
            binaries = Path(build.stdout.strip().splitlines()[-1])
            theirs, their_scores = llama_server(binaries, gguf, threads)
            diff = max(abs(a - b) for a, b in zip(our_scores, their_scores))
            lines += [f"llama-server --reranking -np 4: {N_DOCS / theirs:.1f} docs/s "
                      f"({theirs:.3f} s a request)",
                      f"ratio corral / llama-server: {theirs / ours:.2f}x docs/s",
                      f"largest score difference: {diff:.2e}"]
    report = "\n".join(lines)
    print(report)
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as out:
        out.write(f"\n## rerank.py ({dt.date.today()}, {threads} threads, {N_DOCS} documents, "
                  f"random Qwen3-Reranker `bench` shape)\n\n```\n{report}\n```\n")


if __name__ == "__main__":
    main()
