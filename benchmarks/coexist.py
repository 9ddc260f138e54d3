"""Two models busy at once, against each alone: the chat starter and the base starter,
c=1 each (the common RAG setup: two models side by side). Prints each model's
tokens/s alone and together and the ratio (target: each keeps >= 0.45 of its solo
speed), and appends the run to benchmarks/RESULTS.md. Never a pass/fail.

    .venv/bin/python benchmarks/coexist.py [--tokens 192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from corral.registry.starter import CHAT_NAME, STARTER_NAME  # noqa: E402
from latency import Daemon, record, runner_pids, store_view  # noqa: E402

PROMPT = "Once upon a time"


def speed(d: Daemon, model: str, tokens: int) -> float:
    """Decode tokens/s of one generation of exactly `tokens` tokens, by the server."""
    r = d.post("/api/generate", {"model": model, "prompt": PROMPT, "raw": True,
                                 "stream": False, "options": {
                                     "num_predict": tokens, "ignore_eos": True,
                                     "temperature": 0}}).json()
    return float(r["eval_count"]) / (float(r["eval_duration"]) / 1e9)


def together(d: Daemon, models: list[str], tokens: int) -> dict[str, float]:
    out: dict[str, float] = {}
    barrier = threading.Barrier(len(models))

    def run(model: str) -> None:
        barrier.wait()
        out[model] = speed(d, model, tokens)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = [CHAT_NAME, STARTER_NAME]
    with tempfile.TemporaryDirectory() as raw:
        tmp = Path(raw)
        d = Daemon(store_view(tmp), tmp / "d", MAX_LOADED_MODELS="2")
        try:
            for m in models:
                speed(d, m, 8)  # load both, warm
            solo: dict[str, list[float]] = {m: [] for m in models}
            both: dict[str, list[float]] = {m: [] for m in models}
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                for m in models:
                    solo[m].append(speed(d, m, args.tokens))
                for m, v in together(d, models, args.tokens).items():
                    both[m].append(v)
            pids = runner_pids(d.proc.pid)
            assert len(pids) == 2, f"found {len(pids)} runner processes, not 2"
            idle = idle_cpu(pids, 3.0)
        finally:
            d.stop()
    lines = [f"## {dt.datetime.now():%Y-%m-%d %H:%M}: coexist.py", "",
             f"Two models decoding at once (c=1 each, {args.tokens} tokens, median of "
             f"{args.rounds}, interleaved) against each alone, server-side tok/s:", "",
             "| model | alone | together | kept | target |", "|---|---|---|---|---|"]
    for m in models:
        a, b = statistics.median(solo[m]), statistics.median(both[m])
        lines.append(f"| {m} | {a:.1f} | {b:.1f} | {b / a:.2f} | >= 0.45 |")
    lines.append(f"\nBoth runners idle afterwards: {idle:.1f}% of one core over 3 s "
                 "(no spin-waiting).")
    record(lines + [""])


def idle_cpu(pids: list[int], seconds: float) -> float:
    """CPU the processes use together while nothing is asked of them, in % of one core."""
    def ticks() -> int:
        total = 0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        return total
    time.sleep(1.0)  # past any spin after the last step
    before = ticks()
    time.sleep(seconds)
    return 100.0 * (ticks() - before) / (os.sysconf("SC_CLK_TCK") * seconds)


if __name__ == "__main__":
    main()
