"""Speculative decoding at one stream and at four: Corral against llama-server's n-gram modes.

Three workloads on the base starter (`gemma3:270m-base`), greedy, 160 tokens each, in
one run against llama-server built from the pinned sources:

- repetitive: a class in the prompt, then "the same code, with type hints": the model
  writes the file again with a change (three different files, one after another, c=1);
- free: the start of a story (three different ones, c=1), where drafts rarely hold;
- four repetitive requests at once (four different files), aggregate tokens per second.

Contenders at c=1: llama-server `-np 1` without speculation, with `--spec-type ngram-mod`
and with `ngram-simple`; Corral with speculation (its default) and with
`CORRAL_SPECULATIVE=off`. At c=4 the same with `-np 4` and four Corral slots. Rates are
each server's own decode rate (llama-server's `timings.predicted_per_second`, Corral's
`eval_count / eval_duration`); the c=4 aggregate is tokens over wall time, the median
of ROUNDS rounds, each on a server started afresh (one round is five seconds, which a
busy moment on a shared host moves by a tenth; a fresh server, so that no round drafts
from or reuses what an earlier one left). Prints the table and the issue's target
ratios, and appends them to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/spec.py [--threads N] [--n-predict 160]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import append_results, start_corral, start_llama_server, with_server  # noqa: E402

from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.starter import STARTER_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402

NUM_CTX = 4096
ROUNDS = 3  # of four at once, each on a fresh server
CLASS = '''class {name}:
    def __init__(self, {a}, {b}):
        self.{a} = {a}
        self.{b} = {b}
        self.history = []

    def update(self, {a}):
        self.history.append(self.{a})
        self.{a} = {a}
        return self.{a}

    def total(self):
        return sum(self.history) + self.{a} * self.{b}

    def describe(self):
        return "{name}(" + str(self.{a}) + ", " + str(self.{b}) + ")"


def make_{lower}({a}, {b}):
    item = {name}({a}, {b})
    item.update({a} + 1)
    return item
'''
FILES = [("Account", "balance", "rate"), ("Sensor", "reading", "scale"),
         ("Order", "amount", "price"), ("Tank", "level", "width")]
STORIES = ["Once upon a time, in a village at the edge of a great forest,",
           "The storm had been raging for three days when the old lighthouse keeper",
           "Nobody in the city knew where the little red door on Baker Street led, until"]


def repetitive(i: int) -> str:
    name, a, b = FILES[i % len(FILES)]
    code = CLASS.format(name=name, a=a, b=b, lower=name.lower())
    return f"# {name.lower()}.py\n{code}\n\n# {name.lower()}.py, the same code with type hints:\n"


def complete(url: str, prompt: str, n: int, corral: bool) -> tuple[int, float]:
    """(tokens generated, decode tokens/s) of one greedy request."""
    if corral:
        r = httpx.post(url + "/api/generate", timeout=600, json={
            "model": STARTER_NAME, "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "seed": 1, "num_predict": n}}).json()
        count, ns = int(r["eval_count"]), max(int(r["eval_duration"]), 1)
        return count, count / (ns / 1e9)
    r = httpx.post(url + "/completion", timeout=600, json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1,
        "cache_prompt": True}).json()
    return int(r["timings"]["predicted_n"]), float(r["timings"]["predicted_per_second"])


def one_stream(url: str, corral: bool, n: int) -> dict[str, float]:
    complete(url, "Hello", 8, corral)  # warm
    rep = [complete(url, repetitive(i), n, corral)[1] for i in range(3)]
    free = [complete(url, STORIES[i], n, corral)[1] for i in range(3)]
    return {"repetitive": statistics.median(rep), "free": statistics.median(free)}


def four_at_once(url: str, corral: bool, n: int) -> float:
    complete(url, "Hello", 8, corral)
    with ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        counts = list(pool.map(lambda i: complete(url, repetitive(i), n, corral)[0], range(4)))
        return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--n-predict", type=int, default=160)
    args = parser.parse_args()
    threads, n = args.threads or physical_cores(), args.n_predict
    build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                           capture_output=True, text=True, check=True)
    binaries = Path(build.stdout.strip().splitlines()[-1])
    model = starter_model_path(Store(load_settings().models), STARTER_NAME)
    if model is None:
        raise SystemExit("Error: the base starter is not installed; run ./install.sh")
    modes: dict[str, tuple[str, ...]] = {"none": (), "ngram-mod": ("--spec-type", "ngram-mod"),
                                         "ngram-simple": ("--spec-type", "ngram-simple")}
    c1: dict[str, dict[str, float]] = {}
    c4: dict[str, list[float]] = {}
    for label, extra in modes.items():
        c1[f"llama-server {label}"] = with_server(lambda: start_llama_server(
            binaries, model, 1, NUM_CTX, threads, *extra), lambda u: one_stream(u, False, n))
        c4[f"llama-server -np 4 {label}"] = [with_server(lambda: start_llama_server(
            binaries, model, 4, NUM_CTX, threads, *extra), lambda u: four_at_once(u, False, n))
            for _ in range(ROUNDS)]
    for label, spec in (("corral", "on"), ("corral off", "off")):
        c1[label] = with_server(lambda: start_corral(1, NUM_CTX, threads, SPECULATIVE=spec),
                                lambda u: one_stream(u, True, n))
        c4[label + " 4 slots"] = [with_server(
            lambda: start_corral(4, NUM_CTX, threads, SPECULATIVE=spec),
            lambda u: four_at_once(u, True, n)) for _ in range(ROUNDS)]
    report(threads, n, c1, c4)


def report(threads: int, n: int, c1: dict[str, dict[str, float]],
           rounds: dict[str, list[float]]) -> None:
    c4 = {k: statistics.median(v) for k, v in rounds.items()}
    best_ngram = max(c1["llama-server ngram-mod"]["repetitive"],
                     c1["llama-server ngram-simple"]["repetitive"])
    best4 = max(v for k, v in c4.items() if k.startswith("llama-server"))
    ours = c1["corral"]
    targets = [
        ("repetitive c=1: Corral / llama-server none (>= 1.5)",
         ours["repetitive"] / c1["llama-server none"]["repetitive"]),
        ("repetitive c=1: Corral / llama-server best n-gram (>= 1.0)",
         ours["repetitive"] / best_ngram),
        ("free c=1: Corral / Corral off (>= 0.95)", ours["free"] / c1["corral off"]["free"]),
        ("four at once: Corral / llama-server best -np 4 (>= 1.0)",
         c4["corral 4 slots"] / best4)]
    lines = [f"\n## Speculative decoding ({dt.date.today()}, {threads} threads, "
             f"load {os.getloadavg()[0]:.1f} at the end)\n",
             f"`{STARTER_NAME}`, greedy, {n} tokens; decode tok/s (median of 3) at c=1, "
             f"aggregate tok/s of four at once (median of {ROUNDS} rounds, each round's "
             "in brackets).\n",
             "| contender | repetitive c=1 | free c=1 |", "|---|---|---|",
             *[f"| {k} | {v['repetitive']:.1f} | {v['free']:.1f} |" for k, v in c1.items()],
             "", "| contender | four repetitive at once, aggregate |", "|---|---|",
             *[f"| {k} | {c4[k]:.1f} ({', '.join(f'{x:.1f}' for x in v)}) |"
               for k, v in rounds.items()],
             "", "| target | ratio |", "|---|---|",
             *[f"| {k} | {v:.2f} |" for k, v in targets], ""]
    append_results(lines)


if __name__ == "__main__":
    main()
