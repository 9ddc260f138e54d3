"""The first five minutes, measured: cold start, per-route overhead, and memory against `ps`.

The cold start is timed over --cold-runs (20) cold `corral run smollm2:135m hi`: how many
end within two minutes, and how long the longest took.

Prints ratios and a breakdown, never a pass/fail, and appends the run to
benchmarks/RESULTS.md. Everything runs on loopback against daemons it starts
over a temporary view of the user's store (blobs hard-linked).

    .venv/bin/python benchmarks/latency.py [--rounds 20] [--cold-runs 20] [--skip-memory]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corral.config import load_settings  # noqa: E402
from corral.registry.starter import CHAT_NAME, STARTER_NAME  # noqa: E402

CLI = [sys.executable, "-c", "from corral.cli.launch import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store_view(tmp: Path) -> Path:
    """Manifests copied, blobs hard-linked: the benchmark never touches the user's store."""
    src = load_settings().models
    root = tmp / "models"
    (root / "blobs").mkdir(parents=True)
    for blob in (src / "blobs").iterdir():
        if blob.name.startswith("sha256-") and not blob.name.endswith("-partial"):
            (root / "blobs" / blob.name).hardlink_to(blob)
    shutil.copytree(src / "manifests", root / "manifests")
    return root


class Daemon:
    def __init__(self, models: Path, tmp: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{self.port}",
                        CORRAL_MODELS=str(models), CORRAL_NOPRUNE="1",
                        XDG_STATE_HOME=str(tmp / "state"), CORRAL_KEEP_ALIVE="-1",
                        **{f"CORRAL_{k}": v for k, v in env.items()})
        self.proc = subprocess.Popen([*CLI, "serve"], env=self.env, cwd=ROOT,
                                     stderr=subprocess.DEVNULL)
        wait_until(lambda: answers(self.url), 60)
        # One client, as the ollama and openai clients keep one: a new httpx client
        # costs ~35 ms of TLS setup that has nothing to do with the server.
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("Error: timed out")
        time.sleep(0.01)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- cold start --------------------------------------------------------------------------

COLD_LIMIT = 120.0  # seconds a cold `corral run ... hi` gets to end before it counts as hung


def cold_start(models: Path, tmp: Path, model: str, run: int = 0) -> dict[str, float]:
    """`corral run MODEL "hi"` with no daemon: the CLI starts one, which loads the model.
    "answer done" is NaN when the answer did not end within COLD_LIMIT."""
    port = free_port()
    state = tmp / f"cold-{model.replace(':', '-')}-{run}"
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(models),
               CORRAL_NOPRUNE="1", XDG_STATE_HOME=str(state))
    listening: list[float] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, "run", model, "hi", "--verbose"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def watch() -> None:  # when the daemon the CLI started first answers
        wait_until(lambda: answers(f"http://127.0.0.1:{port}"), 60)
        listening.append(time.perf_counter())

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter()
    try:
        # The chat starter samples as its model card says, with a num_predict cap: every
        # answer should end. One that does not within the limit is counted, not waited on.
        _, err = proc.communicate(timeout=COLD_LIMIT)
        done = time.perf_counter()
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        done = float("nan")
    watcher.join()
    pid_file = state / "corral" / "server.pid"
    if pid_file.exists():
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
    load = next((line.split(":", 1)[1].strip() for line in err.decode().splitlines()
                 if line.strip().startswith("load duration")), "")
    return {"daemon listening": listening[0] - t0, "first token": first - t0,
            "answer done": done - t0, "load_duration": parse_go_duration(load)}


def cold_runs(models: Path, tmp: Path, model: str, n: int) -> dict[str, float]:
    """`n` cold starts of `model`: the first one's steps, how many ended, the longest."""
    runs = [cold_start(models, tmp, model, i) for i in range(n)]
    ended = [r["answer done"] for r in runs if r["answer done"] == r["answer done"]]
    return {**runs[0], "runs": n, "ended": len(ended),
            "longest": max(ended) if len(ended) == n else float("nan")}


def parse_go_duration(text: str) -> float:
    for unit, scale in (("ms", 1e-3), ("µs", 1e-6), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * scale
            except ValueError:
                return float("nan")
    return float("nan")


# ---- per-route overhead ---------------------------------------------------------------------

# Each native request is the same work as the /v1 one beside it: /api/generate is raw,
# as /v1/completions is, and both chat routes render the same template.
ROUTES: dict[str, Callable[[str], tuple[str, dict[str, Any]]]] = {
    "/api/generate": lambda m: ("/api/generate", {
        "model": m, "prompt": "hi", "stream": False, "raw": True,
        "options": {"temperature": 0, "num_predict": 1}}),
    "/api/chat": lambda m: ("/api/chat", {
        "model": m, "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": {"temperature": 0, "num_predict": 1}}),
    "/v1/completions": lambda m: ("/v1/completions", {
        "model": m, "prompt": "hi", "max_tokens": 1, "temperature": 0}),
    "/v1/chat/completions": lambda m: ("/v1/chat/completions", {
        "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "temperature": 0}),
}


PAIRS = {"/api/generate": "/v1/completions", "/api/chat": "/v1/chat/completions"}


def route_overhead(d: Daemon, model: str, rounds: int) -> dict[str, float]:
    """Median seconds of a 1-token request per route, interleaved so drift hits all alike."""
    d.post("/api/generate", {"model": model})  # loaded before timing
    samples: dict[str, list[float]] = {r: [] for r in ROUTES}
    for _ in range(rounds):
        for name, make in ROUTES.items():
            path, body = make(model)
            samples[name].append(timed(lambda: d.post(path, body).raise_for_status()))
    samples["/api/show"] = [timed(lambda: d.post("/api/show", {"model": model}))
                            for _ in range(rounds)]
    return {k: statistics.median(v) for k, v in samples.items()}


def tags_with_100(d: Daemon, rounds: int) -> tuple[int, float]:
    for i in range(100 - len(d.get("/api/tags").json()["models"])):
        d.post("/api/copy", {"source": CHAT_NAME, "destination": f"copy{i}:latest"})
    n = len(d.get("/api/tags").json()["models"])
    return n, statistics.median(timed(lambda: d.get("/api/tags")) for _ in range(rounds))


# ---- memory against the estimate ----------------------------------------------------------

def runner_pids(daemon_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"\0corral.runner\0--config" in cmd and ppid == daemon_pid:
            pids.append(int(entry.name))
    return pids


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def memory_case(models: Path, tmp: Path, model: str, slots: int) -> dict[str, Any]:
    """Idle and after-use runner memory; `slots` 0 is auto mode (the shared KV buffer)."""
    env = {"NUM_PARALLEL": str(slots)} if slots else {}
    d = Daemon(models, tmp, CONTEXT_LENGTH="4096", **env)
    try:
        d.post("/api/generate", {"model": model})
        shown = d.get("/api/ps").json()["models"][0]
        size, cap = int(shown["size"]), int(shown.get("size_cap", shown["size"]))
        slots = slots or int(shown.get("slots_cap", 1))
        [pid] = runner_pids(d.proc.pid)
        idle = rss(pid)
        d.post("/api/embed", {"model": model, "input": ["hello world"] * 4})
        threads = [threading.Thread(target=d.post, args=("/api/chat", {
            "model": model, "stream": False, "format": SCHEMA,
            "messages": [{"role": "user", "content": "A city as JSON."}],
            "options": {"num_predict": 24, "temperature": 0}})) for _ in range(slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.5)
        busy = rss(pid)
        grown = int(d.get("/api/ps").json()["models"][0]["size"])
    finally:
        d.stop()
    return {"model": model, "slots": slots, "ps size": size, "rss idle": idle,
            "rss after": busy, "ps after": grown, "cap": cap, "auto": not env}


def load_paths(models: Path, tmp: Path, model: str, other: str) -> dict[str, float]:
    """load_duration of `model` on each way a load happens to a running daemon (the
    preload by `corral run` is the cold start's)."""
    def loaded(d: Daemon, name: str, **extra: Any) -> float:
        r = d.post("/api/generate", {"model": name, "prompt": "hi", "stream": False,
                                     "options": {"num_predict": 1}, **extra}).json()
        return float(r["load_duration"]) / 1e9

    out: dict[str, float] = {}
    d = Daemon(models, tmp / "paths", MAX_LOADED_MODELS="1")
    try:
        out["first request"] = loaded(d, model, keep_alive="1s")
        wait_until(lambda: not d.get("/api/ps").json()["models"], 30)
        out["after keep-alive"] = loaded(d, model)
        loaded(d, other)  # one model at a time: this evicts the first
        out["after eviction"] = loaded(d, model)
    finally:
        d.stop()
    return out


# ---- report ---------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cold-runs", type=int, default=20,
                        help="cold `corral run smollm2:135m hi` to time (default 20)")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.cold_runs < 1:
        parser.error("--cold-runs must be at least 1")
    with tempfile.TemporaryDirectory() as raw:
        tmp = Path(raw)
        models = store_view(tmp)
        colds = {CHAT_NAME: cold_runs(models, tmp, CHAT_NAME, args.cold_runs),
                 STARTER_NAME: cold_start(models, tmp, STARTER_NAME)}
        cold = colds[CHAT_NAME]
        paths = {m: {"corral run preload": colds[m]["load_duration"],
                     **load_paths(models, tmp / m.replace(":", "-"), m, other)}
                 for m, other in ((CHAT_NAME, STARTER_NAME), (STARTER_NAME, CHAT_NAME))}
        d = Daemon(models, tmp / "warm")
        try:
            routes = {m: route_overhead(d, m, args.rounds) for m in (CHAT_NAME, STARTER_NAME)}
            n_models, tags = tags_with_100(d, args.rounds)
        finally:
            d.stop()
        memory = [] if args.skip_memory else [
            memory_case(models, tmp / f"mem{i}", m, s)
            for i, (m, s) in enumerate((m, s) for m in (CHAT_NAME, STARTER_NAME) for s in (0, 1))]
    report(cold, routes, n_models, tags, memory, paths)


def report(cold: dict[str, float], routes: dict[str, dict[str, float]], n_models: int,
           tags: float, memory: list[dict[str, Any]], paths: dict[str, dict[str, float]]
           ) -> None:
    lines = [f"## {dt.datetime.now():%Y-%m-%d %H:%M}: latency.py", "",
             f"Cold `corral run {CHAT_NAME} \"hi\"` with no daemon, from the command's start:",
             "", "| step | seconds | budget |", "|---|---|---|",
             f"| daemon listening | {cold['daemon listening']:.2f} | |",
             f"| model load_duration | {cold['load_duration']:.2f} | <= 1.0 |",
             f"| first token | {cold['first token']:.2f} | <= 1.5 |",
             f"| answer done | {cold['answer done']:.2f} | |", "",
             f"Of {cold['runs']:.0f} cold `corral run {CHAT_NAME} \"hi\"`, {cold['ended']:.0f} "
             f"ended within {COLD_LIMIT:.0f} s; the longest took "
             + (f"{cold['longest']:.2f} s." if cold["longest"] == cold["longest"]
                else f"longer than that ({cold['runs'] - cold['ended']:.0f} never ended)."),
             "",
             "Warm 1-token requests, median ms (native against the same request on /v1; "
             "budget <= 1.1x):", "",
             "| route | " + " | ".join(routes) + " |", "|---|" + "---|" * len(routes)]
    for name, twin in PAIRS.items():
        cells = [f"{r[name] * 1000:.0f} ({r[name] / r[twin]:.2f}x)" for r in routes.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append(f"| {twin} | " + " | ".join(f"{r[twin] * 1000:.0f}"
                                                for r in routes.values()) + " |")
    lines.append("| /api/show | " + " | ".join(f"{r['/api/show'] * 1000:.1f}"
                                               for r in routes.values()) + " |")
    lines += ["", f"`/api/tags` with {n_models} models: {tags * 1000:.1f} ms (budget <= 50)", ""]
    lines += ["load_duration, seconds, on every path a load happens (budget <= 1.0):", "",
              "| model | " + " | ".join(next(iter(paths.values()))) + " |",
              "|---|" + "---|" * len(next(iter(paths.values())))]
    for model, by_path in paths.items():
        lines.append(f"| {model} | " + " | ".join(f"{v:.2f}" for v in by_path.values()) + " |")
    lines.append("")
    if memory:
        lines += ["Runner resident memory against `ps` SIZE (num_ctx 4096 per slot; auto is "
                  "one KV buffer for every slot up to the cap, holding the pages its cells "
                  "wrote):", "",
                  "| model | mode | ps size idle MB | RSS idle MB | cap MB | ps size after MB | "
                  "RSS after embed + concurrent schema MB |", "|---|---|---|---|---|---|---|"]
        for m in memory:
            mode = f"auto (cap {m['slots']})" if m["auto"] else f"NUM_PARALLEL={m['slots']}"
            lines.append(f"| {m['model']} | {mode} | {m['ps size'] / 1e6:.0f} | "
                         f"{m['rss idle'] / 1e6:.0f} | {m['cap'] / 1e6:.0f} | "
                         f"{m['ps after'] / 1e6:.0f} | {m['rss after'] / 1e6:.0f} |")
        by = {(m["model"], m["auto"]): m["rss idle"] for m in memory}
        for model in dict.fromkeys(m["model"] for m in memory):
            if (model, True) in by and (model, False) in by:
                lines.append(f"\n{model}: idle RSS auto / NUM_PARALLEL=1 = "
                             f"{by[(model, True)] / by[(model, False)]:.2f}x")
        lines.append("")
    record(lines)


def record(lines: list[str]) -> None:
    """Print a run and append it to benchmarks/RESULTS.md."""
    text = "\n".join(lines) + "\n"
    print(text)
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
        f.write("\n" + text)


if __name__ == "__main__":
    main()
