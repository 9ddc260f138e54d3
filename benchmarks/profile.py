"""Where the engine thread's time goes at several streams (issue 55, part 1).

Starts Corral as compare.py does (the starter model, default mode, the same threads),
and at each concurrency runs the compare workload (`corral bench`: streamed
`/v1/completions`, 32 tokens in, 64 out, `ignore_eos`) while py-spy samples the
runner process (`--nonblocking`, so the engine is never paused; py-spy's own CPU is
a few percent of one core). The engine thread's samples are sorted by phase from
the innermost Corral frame:

- native decode: inside `llama_decode` (run.py), where the engine floor is spent;
- native sampling: inside llama.cpp's samplers (a sampler's ctypes calls);
- schedule, run (Python), postprocess (Python), speculation: the Python between
  two decodes, by the step's phases (engine.py's schedule -> run -> postprocess);
- waiting: the engine thread idle, waiting for its next command.

Prints, per level, each phase's share and its milliseconds per step and per output
token (tokens from the bench, steps estimated as tokens / concurrency for decode
steps), and appends them to benchmarks/RESULTS.md. Then the CPU each output token cost
outside the decode, from /proc's per-thread counters: the daemon (HTTP in, the runner's
lines, the dialect, HTTP out), the runner's threads besides its busiest `threads` (the
engine thread and ggml's workers: its streams and HTTP), and the bench client.

    .venv/bin/python benchmarks/profile.py [--levels 4,8,16] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import append_results, bench, start_corral  # noqa: E402
from corral.process import physical_cores  # noqa: E402

# The innermost Corral frame's file (and function) -> the step's phase.
FILES = (("speculative/", "speculation"), ("engine/schedule.py", "schedule"),
         ("engine/batchplan.py", "schedule"), ("engine/placer.py", "schedule"),
         ("engine/kvplan.py", "schedule"), ("engine/postprocess.py", "postprocess"),
         ("llama/sampling.py", "native sampling"), ("llama/textstream.py", "postprocess"),
         ("engine/run.py", "run"), ("engine/kvops.py", "run"))


def decode_lines() -> set[str]:
    """`run.py:N` of each llama_decode call: a sample whose innermost frame sits on one
    of these lines is inside llama.cpp's decode (ctypes adds no Python frame)."""
    source = (ROOT / "corral" / "runner" / "engine" / "run.py").read_text().splitlines()
    return {f"run.py:{n}" for n, line in enumerate(source, 1) if "llama_decode(" in line}


DECODE = decode_lines()


def runner_pid(daemon: int) -> int:
    """The daemon's runner: its child running corral.runner."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == daemon and b"runner" in cmd:
            return int(entry.name)
    raise SystemExit("Error: no runner process under the daemon")


def phase_of(frames: list[str]) -> str | None:
    """The engine thread's phase for one stack (outermost first), or None: not it."""
    if not any("engine/engine.py" in f and "_loop (" in f for f in frames):
        return None
    if not any("_step (" in f for f in frames):
        return "waiting"
    leaf = frames[-1]
    if any(line in leaf for line in DECODE):
        return "native decode"
    for frame in reversed(frames):
        if "corral/" not in frame:
            continue
        for path, phase in FILES:
            if path in frame:
                return phase
        if "_speculate (" in frame:
            return "speculation"
    return "other step"


def cpu_seconds(stat: Path) -> float:
    """User and system CPU seconds from a /proc stat file (a process's counts its
    threads that have ended too)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each of the process's live threads."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds[int(task.name)] = cpu_seconds(task / "stat")
        except OSError:
            continue  # a thread that ended meanwhile
    return seconds


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Costs:
    """CPU seconds spent during one level, outside the runner's decode threads."""

    daemon: float
    streams: float  # the runner's threads besides its `threads` busiest
    client: float

    @classmethod
    def during(cls, daemon: int, runner: int, threads: int, work: Callable[[], Any]
               ) -> tuple["Costs", Any]:
        d, r = Path(f"/proc/{daemon}/stat"), Path(f"/proc/{runner}/stat")
        d0, r0, threads0, c0 = cpu_seconds(d), cpu_seconds(r), thread_cpu(runner), children_cpu()
        result = work()
        d1, r1, threads1, c1 = cpu_seconds(d), cpu_seconds(r), thread_cpu(runner), children_cpu()
        # The stream threads end with their streams: the process's count keeps them.
        spent = sorted((threads1[t] - threads0.get(t, 0.0) for t in threads1), reverse=True)
        return cls(d1 - d0, (r1 - r0) - sum(spent[:threads]), c1 - c0), result


def profile_level(url: str, pid: int, level: int, args: argparse.Namespace, work: Path
                  ) -> tuple[collections.Counter[str], dict[str, Any]]:
    raw = work / f"spy-{level}.txt"
    spy = subprocess.Popen([str(ROOT / ".venv" / "bin" / "py-spy"), "record", "--pid", str(pid),
                            "--rate", str(args.rate), "--format", "raw", "--nonblocking",
                            "--output", str(raw)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        [result] = bench(url, work / f"bench-{level}.json", args, levels=str(level))
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=120)
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        phase = phase_of(stack.split(";"))
        if phase is not None:
            counts[phase] += int(n)
    return counts, result


def report(levels: dict[int, tuple[collections.Counter[str], dict[str, Any]]],
           rate: int, threads: int) -> list[str]:
    stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [f"\n## Engine thread profile, {stamp} ({threads} threads, py-spy at {rate} Hz)\n",
             "| c | phase | share | ms/step | ms/token |", "|---|---|---|---|---|"]
    for level, (counts, result) in levels.items():
        total = sum(counts.values()) or 1
        tokens = max(int(result.get("output_tokens") or 0), 1)
        steps = max(tokens // level, 1)
        for phase, n in counts.most_common():
            seconds = n / rate
            lines.append(f"| {level} | {phase} | {n / total:.1%} | {1000 * seconds / steps:.2f}"
                         f" | {1000 * seconds / tokens:.3f} |")
    return lines


def cost_report(costs: dict[int, tuple[Costs, dict[str, Any]]]) -> list[str]:
    lines = ["\nCPU per output token outside the decode (ms), speculation off:\n",
             "| c | daemon | runner streams | bench client |", "|---|---|---|---|"]
    for level, (cost, result) in costs.items():
        tokens = max(int(result.get("output_tokens") or 0), 1)
        lines.append(f"| {level} | {1000 * cost.daemon / tokens:.3f} | "
                     f"{1000 * cost.streams / tokens:.3f} | {1000 * cost.client / tokens:.3f} |")
    return lines


def measure_costs(args: argparse.Namespace, threads: int, work: Path
                  ) -> dict[int, tuple[Costs, dict[str, Any]]]:
    """Each level again without py-spy (its sampling is CPU too), speculation off so
    that every token is one row of a step."""
    url, proc = start_corral(0, args.num_ctx, threads, SPECULATIVE="off")
    costs = {}
    try:
        pid = runner_pid(proc.pid)
        for level in (int(x) for x in args.levels.split(",")):
            costs[level] = Costs.during(proc.pid, pid, threads, lambda: bench(
                url, work / f"cost-{level}.json", args, levels=str(level))[0])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="4,8,16")
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--num-ctx", type=int, default=2048)
    args = parser.parse_args()
    threads = physical_cores()
    url, proc = start_corral(0, args.num_ctx, threads)
    levels: dict[int, tuple[collections.Counter[str], dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pid = runner_pid(proc.pid)
            for level in (int(x) for x in args.levels.split(",")):
                levels[level] = profile_level(url, pid, level, args, Path(tmp))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        costs = measure_costs(args, threads, Path(tmp))
    append_results(report(levels, args.rate, threads) + cost_report(costs))  # prints too


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
