"""Side by side on one machine: the queue cliff, and who avoids it.

Runs the same `corral bench` load (streaming `/v1/completions`, `ignore_eos`,
2 requests per client, at least 8 per level) at concurrency 1, 2, 4, 8, 16 against:

- llama-server with 4 slots, with 8 slots and `--kv-unified`, with 16 slots and
  `--kv-unified` (`-c 65536`: the tuned peer), and with 1 slot (Ollama's default);
- Corral in its default mode (one KV buffer the slots share, up to the memory fit),
  the same with `CORRAL_SPECULATIVE=off`, through Ollama's native `/api/generate`
  (`corral native`), and with elastic per-slot streams (`CORRAL_KV_POOL=off`, the
  default before issue 66: the layout's before and after in one run).

Then a burst of 16 streams at an idle Corral: when the last first token came against
when the first stream finished, and the slots before and after.

All with the starter model and the same threads, in one run of two passes (the
contenders in order, then in reverse, each contender's figures the mean of its two
sweeps: a shared host drifts by a tenth over minutes); prints TTFT
p50/p99 and aggregate tok/s per level, the issue's target ratios (against the
better llama-server picked on the other pass: compare_report.py), and appends
them to benchmarks/RESULTS.md. Also runs llama-bench (tg128, pp512) as the
engine floor, and benchmarks/rss_trace.py: the chat starter's RSS against its `ps`
size from a load through a burst of 16, every 100 ms.

    .venv/bin/python benchmarks/compare.py [--levels 1,2,4,8,16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corral.config import load_settings  # noqa: E402
from corral.registry.starter import STARTER_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from benchmarks.compare_report import merged, report  # noqa: E402

LEVELS = "1,2,4,8,16"
MIN_REQUESTS = 8  # per level (bench)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"Error: server at {url} exited with {proc.returncode}")
        try:
            # llama-server answers /health; Corral answers /.
            if any(httpx.get(url + path, timeout=2).status_code == 200 for path in ("/health", "/")):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"Error: {url} did not become healthy")


def append_results(lines: list[str]) -> None:
    """Print a run's report and append it to benchmarks/RESULTS.md."""
    text = "\n".join(lines)
    print(text)
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
        f.write(text + "\n")  # the next run's heading starts a line of its own


def with_server(starter: Callable[[], tuple[str, subprocess.Popen[bytes]]],
                work: Callable[[str], Any]) -> Any:
    """Start a server, run `work` on its URL, and stop it whatever happened."""
    url, proc = starter()
    try:
        return work(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def bench(url: str, out: Path, args: argparse.Namespace, dataset: str = "random",
          levels: str = LEVELS, api: str = "openai") -> list[dict[str, Any]]:
    """One `corral bench` per level, each with at least MIN_REQUESTS requests (a level's
    clients send `--per-client` each, or more where that would be fewer): at one or two
    streams, two requests a client are a second or two of decoding, which one busy moment
    on a shared host moves by a tenth. The levels are saved together in `out`."""
    warm = {"model": STARTER_NAME, "prompt": "warm up", "max_tokens": 4}
    httpx.post(url + "/v1/completions", json=warm, timeout=300)
    swept: list[dict[str, Any]] = []
    for level in levels.split(","):
        per_client = max(args.per_client, -(-MIN_REQUESTS // int(level)))
        cmd = [sys.executable, "-c", "from corral.cli.main import main; main()", "bench",
               STARTER_NAME, "--api", api, "--base-url", url, "--concurrency", level,
               "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--dataset", dataset, "--seed", "1", "--json", str(out),
               "--per-client", str(per_client)]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=3600)
        swept += json.loads(out.read_text())["levels"]
    out.write_text(json.dumps({"levels": swept}))
    return swept


def start_corral(slots: int, num_ctx: int, threads: int, **extra: str
                 ) -> tuple[str, subprocess.Popen[bytes]]:
    """Corral with `slots` fixed slots, or 0 for its default (sized by memory)."""
    port = free_port()
    env = dict(os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_NUM_PARALLEL=str(slots),
               CORRAL_CONTEXT_LENGTH=str(num_ctx), CORRAL_KEEP_ALIVE="-1", CORRAL_NOPRUNE="1",
               **{f"CORRAL_{k}": v for k, v in extra.items()})
    proc = subprocess.Popen([sys.executable, "-c", "from corral.cli.main import main; main()", "serve"],
                            cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    # num_thread is a load option: pin it so every contender uses the same threads.
    httpx.post(url + "/api/generate", timeout=300, json={
        "model": STARTER_NAME, "options": {"num_thread": threads, "num_ctx": num_ctx}})
    return url, proc


def serve_gguf(gguf: Path, model: str, tmp: Path, root: Path = ROOT, **env: str
               ) -> tuple[str, subprocess.Popen[bytes]]:
    """A daemon over an empty store under `tmp`, with `gguf` created in it as `model`
    (as a user's `create` from a file does); CORRAL_ settings from `env`; the package
    of the checkout at `root`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "corral.server"], cwd=root, env=dict(
        os.environ, CORRAL_HOST=f"127.0.0.1:{port}", CORRAL_MODELS=str(tmp / "models"),
        CORRAL_KEEP_ALIVE="-1", **{f"CORRAL_{k}": v for k, v in env.items()}),
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        import ollama

        client = ollama.Client(host=url)
        client.create(model=model, files={gguf.name: client.create_blob(gguf)})
    except BaseException:
        proc.terminate()
        proc.wait(60)
        raise
    return url, proc


def llama_server_binaries() -> Path:
    """The pinned llama-server's folder, built once (benchmarks/build_llama_server.sh)."""
    build = subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_server.sh")],
                           capture_output=True, text=True, check=True)
    return Path(build.stdout.strip().splitlines()[-1])


def start_llama_server(binaries: Path, model: Path, slots: int, num_ctx: int, threads: int,
                       *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(binaries))
    proc = subprocess.Popen([str(binaries / "llama-server"), "-m", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--parallel", str(slots),
                             "-c", str(num_ctx * slots), "-t", str(threads), "-tb", str(threads),
                             "--cont-batching", *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return url, proc


def llama_bench(binaries: Path, model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(binaries / "llama-bench"), "-m", str(model), "-t", str(threads),
                          "-p", "512", "-n", "128", "-o", "json"], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=str(binaries)), timeout=1800)
    rows = json.loads(out.stdout or "[]")
    result = {}
    for row in rows:
        kind = f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row['n_gen']}"
        result[kind] = float(row["avg_ts"])
    return result


def contenders(args: argparse.Namespace, binaries: Path, model: Path, threads: int
               ) -> list[tuple[str, Callable[[], tuple[str, subprocess.Popen[bytes]]]]]:
    ctx = args.num_ctx
    return [
        ("llama-server 4", lambda: start_llama_server(binaries, model, 4, ctx, threads)),
        ("llama-server 8 unified", lambda: start_llama_server(binaries, model, 8, ctx, threads,
                                                              "--kv-unified")),
        ("llama-server 16 unified", lambda: start_llama_server(binaries, model, 16, ctx,
                                                               threads, "--kv-unified")),
        ("llama-server 1", lambda: start_llama_server(binaries, model, 1, ctx, threads)),
        ("corral", lambda: start_corral(0, ctx, threads)),
        ("corral spec off", lambda: start_corral(0, ctx, threads, SPECULATIVE="off")),
        # The same daemon through Ollama's /api/generate: the native route's cost.
        ("corral native", lambda: start_corral(0, ctx, threads)),
        ("corral streams", lambda: start_corral(0, ctx, threads, KV_POOL="off")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=LEVELS)
    parser.add_argument("--num-ctx", type=int, default=4096)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--passes", type=int, default=2,
                        help="sweeps of every contender, in alternating order")
    parser.add_argument("--only", default="", help="comma-separated contender names")
    parser.add_argument("--reuse", action="store_true",
                        help="take a contender's sweep from benchmarks/.out if one is there")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    model = starter_model_path(Store(load_settings().models))
    if model is None:
        raise SystemExit("Error: the starter model is not installed; run ./install.sh")
    binaries = llama_server_binaries()
    work = ROOT / "benchmarks" / ".out"
    work.mkdir(exist_ok=True)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    chosen = [(lb, st) for lb, st in contenders(args, binaries, model, threads)
              if not only or lb in only]
    # Forward, then backward: a host that slows or speeds up through the run (a shared
    # one does, by a tenth over minutes) favours neither the first contenders nor the last.
    sweeps: dict[str, list[list[dict[str, Any]]]] = {lb: [] for lb, _ in chosen}
    for n in range(args.passes):
        for label, starter in (chosen if n % 2 == 0 else chosen[::-1]):
            saved = work / f"{label.replace(' ', '-')}-{n}.json"
            if args.reuse and saved.exists():  # a sweep an interrupted run already made
                sweeps[label].append(list(json.loads(saved.read_text())["levels"]))
                continue
            url, proc = starter()
            try:
                sweeps[label].append(bench(
                    url, saved, args, levels=args.levels,
                    api="native" if label.endswith("native") else "openai"))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    results = {lb: merged(runs) for lb, runs in sweeps.items()}
    floor = llama_bench(binaries, model, threads)
    append_results(report(args, threads, results, floor, burst_from_idle(args, threads),
                          MIN_REQUESTS))
    rss_over_time()


def rss_over_time() -> None:
    """The chat starter's runner RSS against `ps` size from its load through a burst
    (benchmarks/rss_trace.py), appended beside the sweep."""
    import rss_trace

    trace = argparse.Namespace(label="corral default", model=rss_trace.CHAT_NAME, every=0.1,
                               first=3, pause=2.0, burst=16, idle=3.0, tokens=64)
    append_results(rss_trace.report(rss_trace.run(trace), trace).splitlines())


def burst_from_idle(args: argparse.Namespace, threads: int) -> dict[str, float]:
    """16 streams at once at an idle Corral: the last first token against the first
    finish, and the slots before and after (with elastic streams, a growth step)."""
    url, proc = start_corral(0, args.num_ctx, threads)
    firsts: list[float] = []
    ends: list[float] = []
    body = {"model": STARTER_NAME, "prompt": "Once upon a time", "stream": True,
            "max_tokens": args.max_tokens, "ignore_eos": True}

    # One pooled client, as SDKs keep: a client built per stream costs ~40 ms of CPU
    # (its TLS context) on the cores the server is using, inside every first token.
    http = httpx.Client(timeout=600, trust_env=False,
                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))

    def stream() -> None:
        first = True
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if first and line.startswith("data: {") and '"text": ""' not in line:
                    firsts.append(time.perf_counter())
                    first = False
        ends.append(time.perf_counter())

    import threading

    try:
        slots_before = httpx.get(url + "/api/ps").json()["models"][0].get("slots", 0)
        t0 = time.perf_counter()
        workers = [threading.Thread(target=stream) for _ in range(16)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        after = httpx.get(url + "/api/ps").json()["models"][0].get("slots", 0)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"slots before": float(slots_before), "slots after": float(after),
            "last first token": max(firsts) - t0, "first finish": min(ends) - t0,
            "ttft p50": sorted(firsts)[len(firsts) // 2] - t0}


if __name__ == "__main__":
    main()
