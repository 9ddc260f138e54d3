"""compare.py's workload with every contender up at once, in rounds, each run only once
the machine is quiet: the figures a drifting host cannot decide.

compare.py starts each contender in turn and sweeps its levels; over the minutes
between two contenders this 2-core VM drifts by up to a fifth (the three llama-server
contenders, which serve c=4 alike, read 96.9, 94.1 and 80.7 tok/s in one run). Here
every server is started first (compare.py's contenders, by name); then each round runs
each level once against each contender (compare.py's `bench`: a short warm-up request,
then `corral bench`; the order reversed every other round), and each run waits until the
whole machine has used under 8% of one core for a second (an idle server's timers, a
finished run's exit). Each figure is the median over the rounds, and the target ratios
are compare.py's: Corral against the better llama-server at each level.

Servers that idle keep their memory: Corral settles its shared buffer between runs
where the machine's quiet lasts long enough (runner.kv.settle), as a daemon would.

    .venv/bin/python benchmarks/side_by_side.py [--rounds 5] [--levels 4,8,16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import (  # noqa: E402
    append_results, bench, contenders, llama_server_binaries)
from corral.config import load_settings  # noqa: E402
from corral.registry.starter import starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402

QUIET_SHARE = 8  # clock ticks (1/100 s) of CPU over a second: 8% of one core
QUIET_WAIT = 120.0  # seconds a run waits for quiet before it goes anyway (and says so)
PEERS = ("llama-server 4", "llama-server 8 unified", "llama-server 16 unified")
CONTENDERS = (*PEERS, "corral", "corral spec off")  # compare.py's, by its names


def cpu_ticks() -> int:
    """Every process's user and system time so far, in clock ticks."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone between the listing and the read
            total += int(fields[11]) + int(fields[12])
    return total


def wait_quiet() -> bool:
    """Until the machine has been quiet for a second; False where it never was."""
    deadline = time.monotonic() + QUIET_WAIT
    while time.monotonic() < deadline:
        before = cpu_ticks()
        time.sleep(1.0)
        if cpu_ticks() - before < QUIET_SHARE:
            return True
    return False


def rounds(servers: dict[str, str], args: argparse.Namespace
           ) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out = ROOT / "benchmarks" / ".out" / "side_by_side.json"
    out.parent.mkdir(exist_ok=True)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    names = list(servers)
    for n in range(args.rounds):
        for level in args.levels.split(","):
            for name in (names if n % 2 == 0 else names[::-1]):
                if not wait_quiet():
                    print(f"round {n}: the machine was not quiet for {QUIET_WAIT:.0f} s")
                got = bench(servers[name], out, args, levels=level)[0]
                results.setdefault((name, level), []).append(got)
                print(f"round {n} c={level} {name}: {got['output_throughput']:.1f} tok/s, "
                      f"TTFT p99 {got['ttft']['p99']:.2f} s", flush=True)
    return results


def report(results: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace,
           names: list[str]) -> list[str]:
    levels = args.levels.split(",")

    def tps(name: str, level: str) -> float:
        return statistics.median(r["output_throughput"] for r in results[(name, level)])

    def p99(name: str, level: str) -> float:
        return statistics.median(r["ttft"]["p99"] for r in results[(name, level)])

    host = platform.processor() or platform.machine()
    lines = [f"## {dt.datetime.now():%Y-%m-%d %H:%M}: side_by_side.py, {host}, "
             f"{args.threads} threads, {args.rounds} rounds",
             "", "Every contender up at once; each run once the machine is quiet; medians.", "",
             "| conc | " + " | ".join(f"{n} tok/s (TTFT p99 s)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for level in levels:
        lines.append(f"| {level} | " + " | ".join(
            f"{tps(n, level):.1f} ({p99(n, level):.2f})" for n in names) + " |")
    lines += ["", "| target | " + " | ".join(f"c={lv}" for lv in levels) + " |",
              "|---|" + "---|" * len(levels)]
    peers = [p for p in PEERS if p in names]
    for mine, goal in (("corral", "1.05"), ("corral spec off", "1.0")):
        if mine in names and peers:
            lines.append(f"| {mine} / the better llama-server (>= {goal}) | " + " | ".join(
                f"{tps(mine, lv) / max(tps(p, lv) for p in peers):.2f}" for lv in levels) + " |")
    last = levels[-1]
    if "corral" in names and "llama-server 16 unified" in names:
        lines.append(f"| c={last} TTFT p99, corral / llama-server 16 unified (<= 1.2) | "
                     f"{p99('corral', last) / p99('llama-server 16 unified', last):.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--levels", default="4,8,16")
    parser.add_argument("--num-ctx", type=int, default=4096)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated contender names")
    args = parser.parse_args()
    model = starter_model_path(Store(load_settings().models))
    if model is None:
        raise SystemExit("Error: the starter model is not installed; run ./install.sh")
    only = {x.strip() for x in args.only.split(",") if x.strip()} or set(CONTENDERS)
    chosen = {n: s for n, s in contenders(args, llama_server_binaries(), model, args.threads)
              if n in only}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        servers = {}
        for name, start in chosen.items():
            url, proc = start()
            procs.append(proc)
            servers[name] = url
        results = rounds(servers, args)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    append_results(report(results, args, list(chosen)))


if __name__ == "__main__":
    main()
