"""Decode speed of a model run locally against the same model split over RPC workers.

Starts two `corral rpc-server` workers on loopback and one daemon, then alternates
greedy generations: local only (`rpc_servers: ""`) and split (`num_gpu` layers on
the workers, the rest local), so both see the same machine state. On one machine the
split can only be slower (every layer boundary is a round trip through TCP and the
cores are shared); across machines it is what lets a model run at all. Appends to
RESULTS.md.

    .venv/bin/python benchmarks/rpc.py [--rounds 3] [--tokens 64] [--layers 10]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.latency import CLI, Daemon, free_port, record, store_view  # noqa: E402
from corral.registry.starter import STARTER_NAME  # noqa: E402


def worker(threads: int) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(port), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}", timeout=0.5)
        except httpx.RemoteProtocolError:
            break  # something listens there, and it does not speak HTTP
        except httpx.HTTPError:
            time.sleep(0.2)
    return f"127.0.0.1:{port}", proc


def tokens_per_second(d: Daemon, options: dict[str, object], tokens: int) -> float:
    r = d.post("/api/generate", {"model": STARTER_NAME, "prompt": "Once upon a time",
                                 "stream": False, "options": {
                                     "temperature": 0, "num_predict": tokens,
                                     "ignore_eos": True, **options}})
    r.raise_for_status()
    body = r.json()
    return float(body["eval_count"] / (body["eval_duration"] / 1e9))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=10, help="layers on the workers")
    parser.add_argument("--worker-threads", type=int, default=1)
    args = parser.parse_args()
    workers = [worker(args.worker_threads) for _ in range(2)]
    endpoints = ",".join(e for e, _ in workers)
    local: list[float] = []
    split: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as raw:
            tmp = Path(raw)
            d = Daemon(store_view(tmp), tmp, NUM_PARALLEL="1")
            try:
                for _ in range(args.rounds):  # each switch reloads the model
                    tokens_per_second(d, {"rpc_servers": ""}, 4)
                    local.append(tokens_per_second(d, {"rpc_servers": ""}, args.tokens))
                    tokens_per_second(d, {"rpc_servers": endpoints, "num_gpu": args.layers}, 4)
                    split.append(tokens_per_second(
                        d, {"rpc_servers": endpoints, "num_gpu": args.layers}, args.tokens))
            finally:
                d.stop()
    finally:
        for _, proc in workers:
            proc.kill()
            proc.wait()
    a, b = statistics.median(local), statistics.median(split)
    record([f"## {dt.datetime.now():%Y-%m-%d %H:%M}: rpc.py, {STARTER_NAME}, "
            f"{args.tokens} tokens, {args.rounds} rounds", "",
            "| run | decode tok/s (median) | runs |", "|---|---|---|",
            f"| local | {a:.1f} | {', '.join(f'{x:.1f}' for x in local)} |",
            f"| split: {args.layers} layers over 2 loopback workers "
            f"({args.worker_threads} thread each) | {b:.1f} | "
            f"{', '.join(f'{x:.1f}' for x in split)} |",
            "", f"split / local: {b / a:.2f}x"])


if __name__ == "__main__":
    main()
