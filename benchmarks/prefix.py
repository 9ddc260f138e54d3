"""Long prompts, short answers: the workloads chats and agents run, against llama-server.

Each call resends a long prompt (a document, the conversation so far, an agent's system
prompt) and asks for a few tokens, so time to first token is prefill. In one run, with
the base starter, streaming /v1/completions at temperature 0:

  (a) four conversations over their own ~1,200-token documents, four turns each,
      round-robin (each turn resends the document, the turns so far and a question);
  (b) sixteen requests at once sharing a ~1,200-token prefix, cold, then again with
      other questions;
  (c) the four conversations resumed after the idle window in which Corral gives back
      KV (each prompt restored from the RAM cache), one after another, conversation 1
      first; then, as a control (c0), the last of them continued after the same idle
      again with its KV still in its slot: the first request after a long idle is
      slower on some machines whatever it asks (memory not touched for a while is slow
      to touch again on this VM), and the control shows how much of (c) that is;
  (d) Corral with the disk tier: a conversation resumed after its model was unloaded,
      and after the daemon restarted, against a cold prefill of the same prompt.

against llama-server with 4 slots and with 16 slots and --kv-unified (both with their
default host-RAM prompt cache) and Corral in its default mode. Prints TTFT p50/p99 and
the prompt tokens computed against the unique ones, the issue's target ratios, and
appends them to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/prefix.py [--idle 50] [--only corral]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from compare import free_port, start_llama_server, wait_healthy  # noqa: E402

from corral.cli.benchmetrics import percentile  # noqa: E402
from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.starter import STARTER_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from corral.runner.kv.growth import SHRINK_AFTER  # noqa: E402

WORDS = ("river hill snow spring stream valley stone bridge mill town market road field "
         "harvest winter summer forest oak pine meadow village farmer baker smith weaver "
         "lantern window chimney harbour boat sail net fish tide storm cloud rain wind sun "
         "moon star morning evening night bread cheese apple honey salt wool cloth iron "
         "copper silver gold ledger letter song story council church school bell clock "
         "north south east west old new small large quiet busy early late near far").split()
MAX_TOKENS = 8
# (c) waits past the point where an idle Corral is back to one stream: warm slots count
# for half the shrink window after their last use, then the shrink window runs.
IDLE = 1.5 * SHRINK_AFTER + 5
# One client for every request, as the official SDKs keep one: a new httpx client costs
# ~40 ms of CPU here (its TLS context), which sixteen threads of a burst would spend on
# the same two cores as the servers they measure, inside every TTFT. A connection per
# request: llama-server closes idle kept-alive ones, which httpx does not retry.
HTTP = httpx.Client(timeout=900, trust_env=False,
                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))


def document(seed: int, words: int = 900) -> str:
    """~1,200 tokens of plain sentences, different for each seed."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return " ".join(sentences) + "\n\n"


def ask(url: str, prompt: str) -> dict[str, Any]:
    """One streamed completion: TTFT, the text, and the prompt tokens the server computed
    (Corral: prompt - cached tokens; llama-server: its timings' prompt_n)."""
    body = {"model": STARTER_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text, computed, total = time.perf_counter(), None, [], None, None
    with HTTP.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c.get("text", "") for c in chunk.get("choices") or [])
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
            usage, timings = chunk.get("usage"), chunk.get("timings")
            if usage:
                total = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                if "cached_tokens" in details and total is not None:
                    computed = total - int(details["cached_tokens"])
            if timings and "prompt_n" in timings:
                computed = int(timings["prompt_n"])
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "text": "".join(text), "computed": computed,
            "prompt_tokens": total, "end": end - start}


def conversations(url: str, n: int = 4, turns: int = 4) -> tuple[list[float], list[str]]:
    """(a): TTFT of turns 2..turns, round-robin; returns them and the prompts' history."""
    history = [document(100 + i) for i in range(n)]
    warm: list[float] = []
    for turn in range(turns):
        for i in range(n):
            history[i] += f"Question {turn + 1}: what does the text say about the " \
                          f"{WORDS[(7 * turn + i) % len(WORDS)]}?\nAnswer:"
            result = ask(url, history[i])
            history[i] += result["text"] + "\n"
            if turn > 0:
                warm.append(result["ttft"])
    return warm, history


def burst(url: str, prefix: str, tag: str) -> dict[str, Any]:
    """(b): sixteen requests at once that share `prefix`."""
    results: list[dict[str, Any]] = [{} for _ in range(16)]
    barrier = threading.Barrier(16)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = ask(url, prefix + f"Task {tag}{i}: name the {WORDS[i * 5]}.\nAnswer:")

    workers = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ttfts = [r["ttft"] for r in results]
    computed = [r["computed"] for r in results]
    return {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99),
            "makespan": max(r["end"] for r in results),
            "computed": sum(computed) if None not in computed else None,
            "prompt_tokens": [r["prompt_tokens"] for r in results]}


def start_corral(threads: int, state: Path, **extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_KEEP_ALIVE="5m",
               CORRAL_NOPRUNE="1", CORRAL_MODELS=str(load_settings().models),
               XDG_STATE_HOME=str(state), **{f"CORRAL_{k}": v for k, v in extra.items()})
    proc = subprocess.Popen([sys.executable, "-m", "corral.server"], cwd=ROOT, env=env,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    load(url, threads)
    return url, proc


def load(url: str, threads: int) -> None:
    httpx.post(url + "/api/generate", timeout=300, json={
        "model": STARTER_NAME, "options": {"num_thread": threads}})


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=120)


def run_contender(url: str, idle: float) -> dict[str, Any]:
    warm, history = conversations(url)
    prefix = document(7)
    cold, again = burst(url, prefix, "a"), burst(url, prefix, "b")
    time.sleep(idle)  # (c): past Corral's shrink window, as a user who stepped away
    # Each turn is one sample that varies by a third between turns: four of them, so
    # that the ratio to a warm turn's p50 is not one draw.
    turns = [h + "Question 5: and the stone?\nAnswer:" for h in history]
    resumed = [ask(url, turn) for turn in turns]
    time.sleep(idle)  # the control: the same idle, the last conversation's KV in its slot
    continued = ask(url, turns[-1] + resumed[-1]["text"] + "\nQuestion 6: and the oak?\nAnswer:")
    shared = ask(url, prefix)["prompt_tokens"]  # the prefix alone: what is shared in (b)
    return {"warm": warm, "cold": cold, "again": again,
            "resumed": [r["ttft"] for r in resumed], "continued": continued["ttft"],
            "prefix_tokens": shared}


def disk_tier(threads: int) -> dict[str, float]:
    """(d): the same long prompt after an unload and after a restart, against cold."""
    with tempfile.TemporaryDirectory() as state:
        url, proc = start_corral(threads, Path(state), CACHE_DISK="2GiB")
        try:
            conversation = document(300) + "Question 1: what is the first word?\nAnswer:"
            cold = ask(url, conversation)
            conversation += cold["text"] + "\nQuestion 2: and the last?\nAnswer:"
            httpx.post(url + "/api/generate", json={"model": STARTER_NAME, "keep_alive": 0},
                       timeout=120)
            deadline = time.monotonic() + 120
            while httpx.get(url + "/api/ps").json()["models"] and time.monotonic() < deadline:
                time.sleep(0.2)
            load(url, threads)
            unloaded = ask(url, conversation)
        finally:
            stop(proc)
        url, proc = start_corral(threads, Path(state), CACHE_DISK="2GiB")
        try:
            restarted = ask(url, conversation + unloaded["text"] + "\nQuestion 3: why?\nAnswer:")
            fresh = ask(url, document(301) + "Question 1: what is the first word?\nAnswer:")
        finally:
            stop(proc)
    return {"cold": fresh["ttft"], "after unload": unloaded["ttft"],
            "after restart": restarted["ttft"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", type=float, default=IDLE, help="seconds before (c)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated contender names")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    model = starter_model_path(Store(load_settings().models))
    if model is None:
        raise SystemExit("Error: the starter model is not installed; run ./install.sh")
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    binaries = Path()
    if not only or any(name.startswith("llama-server") for name in only):
        build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                               capture_output=True, text=True, check=True)
        binaries = Path(build.stdout.strip().splitlines()[-1])
    contenders = {
        "llama-server 4": lambda: start_llama_server(binaries, model, 4, 4096, threads),
        "llama-server 16 unified": lambda: start_llama_server(binaries, model, 16, 4096,
                                                              threads, "--kv-unified"),
        "corral": lambda: start_corral(threads, Path(tempfile.mkdtemp())),
    }
    results = {}
    for label, starter in contenders.items():
        if only and label not in only:
            continue
        url, proc = starter()
        try:
            results[label] = run_contender(url, args.idle)
        finally:
            stop(proc)
    disk = disk_tier(threads) if not only or "corral" in only else {}
    report(results, disk, threads, args.idle)


def report(results: dict[str, Any], disk: dict[str, float], threads: int, idle: float) -> None:
    rows = ["| workload | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]

    def row(name: str, value: Any) -> None:
        rows.append(f"| {name} | " + " | ".join(value(r) for r in results.values()) + " |")

    def burst_cell(b: dict[str, Any]) -> str:
        uniq = b["computed"]
        computed = f", {uniq} computed" if uniq is not None else ""
        return f"{b['p50']:.2f} / {b['p99']:.2f} ({b['makespan']:.1f}{computed})"

    row("(a) warm turns TTFT p50 / p99 s", lambda r: f"{percentile(r['warm'], 50):.2f} / "
        f"{percentile(r['warm'], 99):.2f}")
    row("(b) burst of 16, cold: TTFT p50 / p99 s (makespan, prompt tokens computed)",
        lambda r: burst_cell(r["cold"]))
    row("(b') the same burst again", lambda r: burst_cell(r["again"]))
    row(f"(c) resumed after {idle:.0f} s idle, TTFT p50 of four (the first)",
        lambda r: f"{percentile(r['resumed'], 50):.2f} ({r['resumed'][0]:.2f})")
    row(f"(c0) continued after {idle:.0f} s idle more, its KV kept, TTFT s",
        lambda r: f"{r['continued']:.2f}")
    targets = goals(results, disk)
    text = [f"## {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}: prefix.py, {threads} threads",
            "", "Base starter, streaming /v1/completions, temperature 0, "
            f"{MAX_TOKENS} output tokens, ~1,200-token documents and prefix.", "", *rows, ""]
    if disk:
        text += [f"(d) Corral with CORRAL_CACHE_DISK: cold prefill {disk['cold']:.2f} s, "
                 f"after an unload {disk['after unload']:.2f} s, after a restart "
                 f"{disk['after restart']:.2f} s.", ""]
    text += ["| target | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in targets], "", ""]
    print("\n".join(text))
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
        f.write("\n".join(text))


def goals(results: dict[str, Any], disk: dict[str, float]) -> list[tuple[str, str]]:
    corral = results.get("corral")
    peers = [v for k, v in results.items() if k != "corral"]
    if corral is None:
        return []

    def best(pick: Any) -> float:
        return min(pick(p) for p in peers) if peers else float("nan")

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b == b and b > 0 else "-"

    warm = percentile(corral["warm"], 50)
    out = [
        ("(a) warm TTFT p50, corral / best llama-server (<= 0.8)",
         ratio(warm, best(lambda p: percentile(p["warm"], 50)))),
        ("(b) cold burst TTFT p50, corral / best llama-server (<= 0.5)",
         ratio(corral["cold"]["p50"], best(lambda p: p["cold"]["p50"]))),
        ("(b') burst again TTFT p50, corral / best llama-server (<= 0.5)",
         ratio(corral["again"]["p50"], best(lambda p: p["again"]["p50"]))),
        ("(c) resumed TTFT p50 / warm turn TTFT p50, corral (<= 1.2)",
         ratio(percentile(corral["resumed"], 50), warm)),
        ("(c) the first resumed / warm turn p50, corral", ratio(corral["resumed"][0], warm)),
        ("(c) the first resumed / (c0) continued after the same idle, corral",
         ratio(corral["resumed"][0], corral["continued"])),
    ]
    tokens, shared = corral["cold"]["prompt_tokens"], corral["prefix_tokens"]
    if corral["cold"]["computed"] is not None and all(tokens) and shared:
        uniq = shared + sum(t - shared for t in tokens)
        out.append(("(b) prompt tokens computed / unique, corral (<= 1.2)",
                    ratio(corral["cold"]["computed"], uniq)))
    if disk:
        out += [("(d) after unload / cold prefill (<= 0.3)",
                 ratio(disk["after unload"], disk["cold"])),
                ("(d) after restart / cold prefill (<= 0.3)",
                 ratio(disk["after restart"], disk["cold"]))]
    return out


if __name__ == "__main__":
    main()
