"""Soak: mixed load at c=16 for 20 minutes, sampling daemon and runner memory.

Sixteen clients loop over generate, chat, embed, a stream they abandon after a
few tokens, and JSON-schema chat, all on one model: two runners on two cores
each spin their threads against the other's, which measures the CPU's
oversubscription rather than the daemon. After a warm-up, the
resident memory of the daemon and of each runner must not keep growing, and
no request may fail other than with an expected 503. Appends to RESULTS.md.

    .venv/bin/python benchmarks/soak.py [--minutes 20] [--clients 16]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.latency import Daemon, record, rss, runner_pids, store_view  # noqa: E402
from corral.registry.starter import STARTER_NAME  # noqa: E402

MODEL = STARTER_NAME

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}, "required": ["name"]}


def one(client: httpx.Client, kind: str, rng: random.Random) -> httpx.Response:
    greedy = {"temperature": 0.7, "num_predict": rng.randint(8, 48), "seed": rng.randint(0, 99)}
    if kind == "generate":
        return client.post("/api/generate", json={"model": MODEL, "stream": False,
                                                  "prompt": f"Story {rng.random()}:",
                                                  "options": greedy})
    if kind == "chat":
        return client.post("/api/chat", json={"model": MODEL, "stream": False, "options": greedy,
                                              "messages": [{"role": "user",
                                                            "content": f"Say {rng.random()}"}]})
    if kind == "embed":
        return client.post("/api/embed", json={"model": MODEL,
                                               "input": [f"text {rng.random()}"] * 8})
    if kind == "schema":
        return client.post("/api/chat", json={"model": MODEL, "stream": False, "format": SCHEMA,
                                              "options": {**greedy, "num_predict": 24},
                                              "messages": [{"role": "user",
                                                            "content": "A person as JSON."}]})
    with client.stream("POST", "/api/generate", json={"model": MODEL, "prompt": "Once",
                                                      "options": {"num_predict": 200}}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # hang up mid-stream
        return r


def client_loop(url: str, until: float, seed: int, counts: collections.Counter[str],
                errors: list[str]) -> None:
    rng = random.Random(seed)
    kinds = ["generate", "chat", "embed", "cancel", "schema"]
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.monotonic() < until:
            kind = rng.choice(kinds)
            try:
                resp = one(client, kind, rng)
                status = resp.status_code
            except httpx.HTTPError as exc:
                errors.append(f"{kind}: {exc!r}")
                continue
            counts[f"{kind} {status}"] += 1
            if status >= 400 and status != 503:
                body = resp.read().decode("utf-8", "replace") if kind != "cancel" else ""
                errors.append(f"{kind}: HTTP {status} {body[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=2)
    args = parser.parse_args()
    counts: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    samples: list[tuple[float, int, dict[int, int]]] = []
    with tempfile.TemporaryDirectory() as raw:
        tmp = Path(raw)
        d = Daemon(store_view(tmp), tmp)
        start = time.monotonic()
        until = start + args.minutes * 60
        threads = [threading.Thread(target=client_loop, args=(d.url, until, i, counts, errors))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            runners = {pid: rss(pid) for pid in runner_pids(d.proc.pid)}
            samples.append((time.monotonic() - start, rss(d.proc.pid), runners))
            time.sleep(10)
        for t in threads:
            t.join()
        d.stop()
    report(args, counts, errors, samples)


def report(args: argparse.Namespace, counts: collections.Counter[str], errors: list[str],
           samples: list[tuple[float, int, dict[int, int]]]) -> None:
    warm = [s for s in samples if s[0] >= args.warmup * 60] or samples
    first, last = warm[0], warm[-1]
    peak_daemon = max(s[1] for s in warm)
    lines = [f"## {dt.datetime.now():%Y-%m-%d %H:%M}: soak.py, {args.clients} clients, "
             f"{args.minutes:g} minutes", "",
             "| process | RSS after warm-up MB | RSS at end MB | peak MB | growth |",
             "|---|---|---|---|---|",
             f"| daemon | {first[1] / 1e6:.0f} | {last[1] / 1e6:.0f} | {peak_daemon / 1e6:.0f} | "
             f"{last[1] / first[1] - 1:+.1%} |"]
    for pid, start_rss in first[2].items():
        end = last[2].get(pid)
        peak = max(s[2].get(pid, 0) for s in warm)
        if end:
            lines.append(f"| runner {pid} | {start_rss / 1e6:.0f} | {end / 1e6:.0f} | "
                         f"{peak / 1e6:.0f} | {end / start_rss - 1:+.1%} |")
    lines += ["", "RSS by minute, MB (daemon / runners): " + ", ".join(
        f"{int(t // 60)}: {d / 1e6:.0f} / " + " ".join(f"{r / 1e6:.0f}" for r in rs.values())
        for t, d, rs in samples if int(t) % 60 < 10)]
    total = sum(counts.values())
    busy = sum(n for k, n in counts.items() if k.endswith(" 503"))
    lines += ["", f"{total} requests: " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())),
              f"Errors other than 503: {len(errors)}; 503s: {busy}.",
              *[f"- {e}" for e in errors[:10]], ""]
    record(lines)


if __name__ == "__main__":
    main()
