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
steps), and appends them to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/profile.py [--levels 4,8,16] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    try:
        pid = runner_pid(proc.pid)
        with tempfile.TemporaryDirectory() as tmp:
            for level in (int(x) for x in args.levels.split(",")):
                levels[level] = profile_level(url, pid, level, args, Path(tmp))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    append_results(report(levels, args.rate, threads))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
