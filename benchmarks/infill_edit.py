"""An editing session replayed against /infill: Corral against llama-server.

One Python file is typed into as a person types: 30 /infill requests whose cursor
moves through a new function a word or a few characters at a time, each streamed. Two
request shapes (`--shape`):

- `editor` (the default), as llama.vim and llama.vscode send it: `input_prefix` is the
  lines above the cursor's line, `prompt` that line up to the cursor (llama.cpp ends the
  prefix with it, before the FIM suffix token), `input_suffix` the rest of the line and
  the lines below;
- `prefix`: the whole file up to the cursor as `input_prefix` and the rest as
  `input_suffix`, so every keystroke lands before the suffix (the shape of the first
  runs in RESULTS.md).

In both, a keystroke inserts tokens before the suffix's. llama-server's `--cache-reuse`
moves cached chunks only over deleted text, so it evaluates the suffix again each time;
Corral parks the suffix's KV while the typed tokens are decoded (runner.engine.kvops).
Both servers run the same GGUF (SmolLM2 with FIM tokens, tests/fim_model.py) on the
same threads: llama-server with one slot and `--cache-reuse 256`, the setting
llama.vscode recommends, and Corral with one slot. Prints time to first token p50 and
p90 for each and the ratio Corral / llama-server (target: at most 0.8), and appends
them to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/infill_edit.py [--threads N] [--n-predict 8] [--shape editor]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import (append_results, free_port, start_llama_server, wait_healthy,  # noqa: E402
                     with_server)

from corral.cli.benchmetrics import percentile  # noqa: E402
from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.create import CreateRequest, create_model  # noqa: E402
from corral.registry.starter import CHAT_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from tests.fim_model import write_fim_gguf  # noqa: E402

MODEL = "fim"
NUM_CTX = 4096
BEFORE = '''"""Small helpers for the inventory service."""

import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    count: int
    price: float

    def total(self) -> float:
        return self.count * self.price


def load(path: str) -> list[Item]:
    with open(path) as f:
        return [Item(**row) for row in json.load(f)]


'''
TYPED = '''def cheapest(items: list[Item]) -> Item:
    best = items[0]
    for item in items[1:]:
        if item.price < best.price:
            best = item
    return best
'''
AFTER = '''

def save(path: str, items: list[Item]) -> None:
    with open(path, "w") as f:
        json.dump([item.__dict__ for item in items], f, indent=2)


if __name__ == "__main__":
    print(cheapest(load("items.json")).name)
'''


def session(shape: str, n: int = 30) -> list[dict[str, str]]:
    """n cursor stops through TYPED, evenly spaced, each as a request of `shape`."""
    stops = [round((i + 1) * len(TYPED) / n) for i in range(n)]
    if shape == "prefix":
        return [{"input_prefix": BEFORE + TYPED[:k], "input_suffix": AFTER} for k in stops]
    return [editor_request(BEFORE + TYPED[:k], AFTER) for k in stops]


def editor_request(before: str, after: str) -> dict[str, str]:
    """What llama.vim sends with the cursor between `before` and `after` (its
    llama#fim: the whole of this small file fits its 256 lines above and 64 below)."""
    start = before.rfind("\n") + 1  # the cursor's line starts here
    # Lines joined by newlines, each ended by one: the rest of the file, newline-ended.
    return {"input_prefix": before[:start], "prompt": before[start:],
            "input_suffix": after if after.endswith("\n") else after + "\n"}


def ttft(url: str, body: dict[str, object]) -> float:
    """Seconds to the first streamed event that carries text (or the final one)."""
    start, first = time.perf_counter(), 0.0
    with httpx.stream("POST", url + "/infill", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end: the next request waits for none
            if not first and line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("content") or event.get("stop"):
                    first = time.perf_counter() - start
    return first


def replay(url: str, args: argparse.Namespace, model: str | None) -> list[float]:
    extra = {"model": model} if model else {}
    sampling = {"n_predict": args.n_predict, "temperature": 0, "seed": 1, "stream": True,
                **extra}
    ttft(url, {"input_prefix": "warm", "input_suffix": "up", **sampling})
    return [ttft(url, {**stop, **sampling}) for stop in session(args.shape)]


def start_corral(store: Path, threads: int) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_NUM_PARALLEL="1",
               CORRAL_CONTEXT_LENGTH=str(NUM_CTX), CORRAL_KEEP_ALIVE="-1",
               CORRAL_NOPRUNE="1", CORRAL_MODELS=str(store))
    proc = subprocess.Popen([sys.executable, "-c", "from corral.cli.main import main; main()",
                             "serve"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    httpx.post(url + "/api/generate", timeout=300, json={
        "model": MODEL, "options": {"num_thread": threads, "num_ctx": NUM_CTX}})
    return url, proc


def fim_store(work: Path) -> tuple[Path, Path]:
    """A store holding only the FIM copy of SmolLM2, and the GGUF itself."""
    source = starter_model_path(Store(load_settings().models), CHAT_NAME)
    if source is None:
        raise SystemExit("Error: the chat starter is not installed; run ./install.sh")
    gguf = write_fim_gguf(source, work / "fim.gguf")
    store = Store(work / "models")
    with gguf.open("rb") as f:
        blob = store.write_blob(iter(lambda: f.read(1 << 20), b""))[0]
    create_model(store, CreateRequest(model=MODEL, files={gguf.name: blob}))
    return work / "models", gguf


def run_one(starter: Callable[[], tuple[str, subprocess.Popen[bytes]]],
            args: argparse.Namespace, model: str | None) -> list[float]:
    return with_server(starter, lambda url: replay(url, args, model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--n-predict", type=int, default=8)
    parser.add_argument("--shape", choices=("editor", "prefix"), default="editor")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                           capture_output=True, text=True, check=True)
    binaries = Path(build.stdout.strip().splitlines()[-1])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        store, gguf = fim_store(Path(tmp))
        peer = run_one(lambda: start_llama_server(binaries, gguf, 1, NUM_CTX, threads,
                                                  "--cache-reuse", "256"), args, None)
        ours = run_one(lambda: start_corral(store, threads), args, MODEL)
    report(args, threads, load, ours, peer)


def report(args: argparse.Namespace, threads: int, load: float, ours: list[float],
           peer: list[float]) -> None:
    p50, q50 = percentile(ours, 50), percentile(peer, 50)
    lines = [f"\n## /infill editing session ({dt.date.today()}, {threads} threads, "
             f"load {load:.1f} at start)\n",
             "30 streamed /infill requests, the cursor moving through a new function of one "
             f"file, `--shape {args.shape}`; SmolLM2 135M with FIM tokens, "
             f"n_predict {args.n_predict}, greedy; "
             "llama-server `-np 1 --cache-reuse 256`, Corral one slot.\n",
             "| server | TTFT p50 ms | TTFT p90 ms |", "|---|---|---|",
             f"| llama-server | {q50 * 1e3:.1f} | {percentile(peer, 90) * 1e3:.1f} |",
             f"| Corral | {p50 * 1e3:.1f} | {percentile(ours, 90) * 1e3:.1f} |",
             f"\nTTFT p50 Corral / llama-server: {p50 / q50:.2f} (target at most 0.8)\n"]
    append_results(lines)


if __name__ == "__main__":
    main()
