"""Engine scaling: N concurrent greedy requests on N slots versus the same load on 1 slot.

Prints aggregate and per-slot decode tok/s for 1, 2, 4 and 8 concurrent
requests, the ratio against one slot, and the share of each step spent in
Python rather than in llama.cpp. A benchmark, not a test: nothing is asserted.

    .venv/bin/python benchmarks/engine_scaling.py [--model PATH] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corral.config import load_settings  # noqa: E402
from corral.registry.starter import starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from corral.runner.llama.context import EngineConfig  # noqa: E402
from corral.runner.engine.engine import Engine  # noqa: E402
from corral.runner.jobs import Done, Failed, Job, SamplingParams  # noqa: E402

PROMPTS = ["The history of the printing press", "A recipe for bread starts with",
           "The main causes of the French Revolution were", "In a distant galaxy,",
           "The rules of chess say that", "Photosynthesis is the process", "def quicksort(xs):",
           "The best way to learn a language is"]


def run_load(engine: Engine, concurrency: int, tokens: int) -> tuple[float, float]:
    """(aggregate tok/s over the wall time, mean per-request decode tok/s)."""
    rates: list[float] = []
    done = [0]

    def one(i: int) -> None:
        job = engine.submit(Job(prompt=engine.tokenize(PROMPTS[i % len(PROMPTS)]),
                                params=SamplingParams(temperature=0), num_predict=tokens))
        while True:
            event = job.events.get()
            if isinstance(event, Done):
                stats = event.stats
                done[0] += stats.eval_count
                rates.append(stats.eval_count / max(stats.eval_duration / 1e9, 1e-9))
                return
            if isinstance(event, Failed):
                raise event.error

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return done[0] / wall, sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="GGUF path (default: the starter model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,2,4,8")
    args = parser.parse_args()
    path = args.model or starter_model_path(Store(load_settings().models))
    if path is None:
        sys.exit("Error: no model; run ./install.sh or pass --model")
    levels = [int(x) for x in args.levels.split(",")]
    single = Engine(str(path), EngineConfig(n_slots=1, num_ctx=1024))
    single.start()
    run_load(single, 1, 8)  # warm up
    print(f"{'conc':>4}  {'1-slot agg':>10}  {'N-slot agg':>10}  {'per-slot':>8}  "
          f"{'ratio':>5}  {'python %':>8}")
    for n in levels:
        base, _ = run_load(single, n, args.tokens)
        engine = Engine(str(path), EngineConfig(n_slots=n, num_ctx=1024))
        engine.start()
        run_load(engine, n, 8)
        engine.steps, engine.step_time, engine.native_time = 0, 0.0, 0.0
        agg, per_slot = run_load(engine, n, args.tokens)
        python_share = 100 * (1 - engine.native_time / max(engine.step_time, 1e-9))
        print(f"{n:>4}  {base:>10.1f}  {agg:>10.1f}  {per_slot:>8.1f}  {agg / base:>5.2f}  "
              f"{python_share:>7.1f}%")
        engine.stop()
    single.stop()


if __name__ == "__main__":
    main()
