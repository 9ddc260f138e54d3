"""The runner's resident memory against what `ps` reports, from a load through a burst.

Sampled every --every seconds (0.1): the runner's VmRSS and `/api/ps`'s `size` for the
model. The run: a load, --first single streamed requests as soon as it is loaded (the
requests that share the first seconds with whatever a load starts in the background),
a pause of --pause seconds, then a burst of --burst streamed requests at once, then
--idle seconds of rest. Each request is 32 tokens of prompt (distinct per request) and
--tokens out with ignore_eos, on `/v1/completions`.

Prints the trace's worst ratio of RSS to `size`, the peak, and the first requests' and
the burst's times to first token, and appends the run to benchmarks/RESULTS.md with
--label naming the design measured (run it once per build to set them side by side).

    .venv/bin/python benchmarks/rss_trace.py --label "patched clear" [--model smollm2:135m]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.latency import Daemon, rss, runner_pids, store_view  # noqa: E402
from corral.registry.starter import CHAT_NAME  # noqa: E402

WORDS = "river stone maple cloud lantern orbit velvet harbor".split()


def prompt(i: int) -> str:
    """32-odd tokens, distinct per request so no prompt cache hit shapes the burst."""
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(28))


class Sampler(threading.Thread):
    """(seconds since start, runner RSS, ps size) every `every` seconds until stopped."""

    def __init__(self, d: Daemon, model: str, every: float) -> None:
        super().__init__(daemon=True)
        self.d, self.model, self.every = d, model, every
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.t0 = time.monotonic()
        self.http = httpx.Client(base_url=d.url, timeout=10)

    def run(self) -> None:
        while not self.done.wait(self.every):
            try:
                self.sample()
            except (httpx.HTTPError, OSError, ValueError):  # a runner gone, a slow answer
                continue

    def sample(self) -> None:
        pids = runner_pids(self.d.proc.pid)
        if not pids:
            return
        shown = [m for m in self.http.get("/api/ps").json()["models"]
                 if m["name"].split(":")[0] == self.model.split(":")[0]]
        if shown:
            self.samples.append((time.monotonic() - self.t0, sum(rss(p) for p in pids),
                                 int(shown[0]["size"])))


def stream_ttft(url: str, model: str, i: int, tokens: int, out: list[float]) -> None:
    body = {"model": model, "prompt": prompt(i), "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    out.append(first if first is not None else float("nan"))


def burst(url: str, model: str, base: int, n: int, tokens: int) -> list[float]:
    out: list[float] = []
    threads = [threading.Thread(target=stream_ttft, args=(url, model, base + i, tokens, out))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return sorted(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        d = Daemon(store_view(tmp), tmp)
        sampler = Sampler(d, args.model, args.every)
        try:
            sampler.start()
            t0 = time.perf_counter()
            d.post("/api/generate", {"model": args.model})
            load = time.perf_counter() - t0
            first = [burst(d.url, args.model, i, 1, args.tokens)[0] for i in range(args.first)]
            time.sleep(args.pause)
            burst_ttft = burst(d.url, args.model, 100, args.burst, args.tokens)
            time.sleep(args.idle)
        finally:
            sampler.done.set()
            sampler.join(timeout=10)
            d.stop()
    samples = [x for x in sampler.samples if x[2]]
    if not samples:
        raise SystemExit("Error: no sample of the runner's memory was taken")
    worst = max(samples, key=lambda x: x[1] / x[2])
    return {"label": args.label, "model": args.model, "load s": load, "first ttft": first,
            "burst ttft": burst_ttft, "samples": samples,
            "worst ratio": worst[1] / worst[2], "worst at": worst,
            "peak rss": max(r for _, r, _ in sampler.samples),
            "peak size": max(s for _, _, s in sampler.samples)}


def p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def report(m: dict[str, Any], args: argparse.Namespace) -> str:
    t, r, s = m["worst at"]
    trace = ", ".join(f"{t:.1f}s {r / 2**20:.0f}/{s / 2**20:.0f}"
                      for t, r, s in m["samples"][::max(1, len(m["samples"]) // 24)])
    lines = [
        f"\n## RSS against `ps` size, {m['label']} ({dt.date.today()}, {m['model']})\n",
        f"Sampled every {args.every} s: load, {args.first} single requests, a burst of "
        f"{args.burst}, {args.idle} s idle; {args.tokens} tokens out each.\n",
        "| design | worst RSS / size | at (s, RSS MiB, size MiB) | peak RSS MiB | "
        "first requests TTFT s | burst TTFT p50 / p99 s |", "|---|---|---|---|---|---|",
        f"| {m['label']} | {m['worst ratio']:.2f} | {t:.1f}, {r / 2**20:.0f}, {s / 2**20:.0f} | "
        f"{m['peak rss'] / 2**20:.0f} | {', '.join(f'{x:.3f}' for x in m['first ttft'])} | "
        f"{statistics.median(m['burst ttft']):.3f} / {p99(m['burst ttft']):.3f} |",
        f"\nTrace (s RSS/size MiB): {trace}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="the design measured, for the table")
    ap.add_argument("--model", default=CHAT_NAME)
    ap.add_argument("--every", type=float, default=0.1)
    ap.add_argument("--first", type=int, default=3)
    ap.add_argument("--pause", type=float, default=2.0)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the samples here")
    args = ap.parse_args()
    m = run(args)
    text = report(m, args)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(m))
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
