"""Pool mode under pressure: 8 clients each generating 1024 tokens from a pool of 8 x 512.

The pool holds half of what the sequences need, so the newest are preempted
and recomputed. Every request must finish with exactly its tokens, the streamed
pieces must be one per token at most (nothing repeated after a resume), and
/metrics must count the preemptions. Appends the run to RESULTS.md.

    .venv/bin/python benchmarks/pool.py [--clients 8] [--tokens 1024] [--pool 4096]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.latency import Daemon, record, store_view  # noqa: E402
from corral.registry.starter import CHAT_NAME  # noqa: E402


def stream(url: str, i: int, tokens: int, out: list[dict[str, Any]]) -> None:
    pieces, final, t0 = [], {}, time.perf_counter()
    with httpx.stream("POST", url + "/api/generate", timeout=1800, json={
            "model": CHAT_NAME, "prompt": f"Tell story number {i}, a long one.",
            "options": {"num_predict": tokens, "ignore_eos": True, "temperature": 0}}) as r:
        for line in r.iter_lines():
            if line:
                chunk = json.loads(line)
                if chunk.get("done"):
                    final = chunk
                elif chunk.get("response"):
                    pieces.append(chunk["response"])
    out.append({"pieces": len(pieces), "chars": len("".join(pieces)), "final": final,
                "seconds": time.perf_counter() - t0, "status": r.status_code})


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"corral_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--pool", type=int, default=8 * 512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as raw:
        tmp = Path(raw)
        d = Daemon(store_view(tmp), tmp, KV_POOL="1", KV_POOL_TOKENS=str(args.pool),
                   MAX_SLOTS=str(args.clients), CONTEXT_LENGTH=str(args.tokens + 512))
        try:
            d.post("/api/generate", {"model": CHAT_NAME})  # load
            results: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            threads = [threading.Thread(target=stream, args=(d.url, i, args.tokens, results))
                       for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            preemptions = metric(d.url, "preemptions_total")
        finally:
            d.stop()
    whole = [r for r in results if r["status"] == 200 and r["final"].get("eval_count") ==
             args.tokens and r["final"].get("done_reason") == "length"
             and 0 < r["pieces"] <= args.tokens]
    lines = [f"## {dt.datetime.now():%Y-%m-%d %H:%M}: pool.py, {CHAT_NAME}", "",
             f"Pool of {args.pool} tokens, {args.clients} clients streaming /api/generate, "
             f"{args.tokens} tokens each (ignore_eos, greedy), num_ctx {args.tokens + 512}.", "",
             "| requests | finished whole | preemptions | wall s | aggregate tok/s |",
             "|---|---|---|---|---|",
             f"| {len(results)} | {len(whole)} | {preemptions:.0f} | {wall:.1f} | "
             f"{args.clients * args.tokens / wall:.1f} |", "",
             "Per request (eval_count, streamed pieces, seconds): " + ", ".join(
                 f"{r['final'].get('eval_count')}/{r['pieces']}/{r['seconds']:.0f}"
                 for r in results), "", ""]
    record(lines)


if __name__ == "__main__":
    main()
