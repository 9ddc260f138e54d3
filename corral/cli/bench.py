"""`corral bench`: load a server the way users do and measure it as vLLM does.

Closed loop (`--concurrency 1,2,4`: that many clients, each sending its next
request when the last one ends) or open loop (`--request-rate R`: Poisson
arrivals, capped by `--max-concurrency`). Works against any Ollama- or
OpenAI-compatible server through `--base-url`.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Callable

import httpx

from corral.cli.benchmetrics import RequestResult, Summary, calculate
from corral.errors import CorralError

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river house music "
         "garden window story light paper water money game table morning evening").split()
TURNS = 5


@dataclass
class BenchConfig:
    model: str
    base_url: str
    api: str = "native"
    requests: int = 0  # per level; 0 means per_client x concurrency
    per_client: int = 4
    prompt_tokens: int = 32
    max_tokens: int = 64
    dataset: str = "random"
    seed: int = 0
    request_rate: float = 0.0
    max_concurrency: int = 0


def random_prompt(rng: random.Random, n_tokens: int) -> str:
    # Common English words are about one token each for the usual tokenizers.
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens)))


def _body(cfg: BenchConfig, prompt: str | None, messages: list[dict[str, str]] | None,
          seed: int) -> tuple[str, dict[str, Any]]:
    if cfg.api == "openai":
        common = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0.8,
                  "seed": seed, "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": True}
        if messages is not None:
            return "/v1/chat/completions", {**common, "messages": messages}
        return "/v1/completions", {**common, "prompt": prompt}
    options = {"num_predict": cfg.max_tokens, "seed": seed, "ignore_eos": True, "stop": []}
    if messages is not None:
        return "/api/chat", {"model": cfg.model, "messages": messages, "options": options}
    return "/api/generate", {"model": cfg.model, "prompt": prompt, "raw": True,
                             "options": options}


def _text_of(api: str, obj: dict[str, Any]) -> str:
    if api == "openai":
        choices = obj.get("choices") or [{}]
        choice = choices[0]
        return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return str(obj.get("response") or (obj.get("message") or {}).get("content") or "")


def send(http: httpx.Client, cfg: BenchConfig, prompt: str | None,
         messages: list[dict[str, str]] | None, seed: int, turn: int = 0
         ) -> tuple[RequestResult, str]:
    """One streamed request, timed on the client; returns the result and the reply text."""
    path, body = _body(cfg, prompt, messages, seed)
    result = RequestResult(start=time.perf_counter(), turn=turn)
    text: list[str] = []
    try:
        resp = _open(http, http.build_request("POST", path, json=body), result)
        try:
            _read(resp, cfg, result, text)
        finally:
            resp.close()
        result.end = time.perf_counter()
        if not result.output_tokens:
            result.output_tokens = len(result.chunk_times)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.end = time.perf_counter()
        result.success, result.error = False, str(exc)
    return result, "".join(text)


def _open(http: httpx.Client, request: httpx.Request, result: RequestResult) -> httpx.Response:
    """The response, its body still to read. A request that got nothing back, not even a
    status, because the pooled connection it went out on was being closed, is sent once
    more on a new connection and timed from then. (llama-server closes the connection
    after each streamed reply while it says `Keep-Alive`, so the pool may hand it out
    before the close arrives: in compare.py's runs one or two requests in eight failed
    that way at one stream.)"""
    try:
        return http.send(request, stream=True)
    except httpx.RemoteProtocolError:
        result.start = time.perf_counter()
        return http.send(request, stream=True)


def _read(resp: httpx.Response, cfg: BenchConfig, result: RequestResult,
          text: list[str]) -> None:
    """Read one streamed reply into `result` and `text`."""
    if resp.status_code >= 400:
        resp.read()
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    for line in resp.iter_lines():
        if not line:
            continue
        if cfg.api == "openai":
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            line = line[6:]
        obj = json.loads(line)
        if "error" in obj:
            raise RuntimeError(str(obj["error"]))
        piece = _text_of(cfg.api, obj)
        if piece:
            result.chunk_times.append(time.perf_counter())
            text.append(piece)
        _counts(result, obj)


def _counts(result: RequestResult, obj: dict[str, Any]) -> None:
    """The token counts and durations a reply's chunk carries, where it carries them."""
    usage, timings = obj.get("usage"), obj.get("timings")
    if usage:
        result.output_tokens = int(usage.get("completion_tokens", 0))
        result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    if timings:  # llama-server's (and Corral's) speculative decoding counts
        result.drafted = int(timings.get("draft_n", 0))
        result.draft_accepted = int(timings.get("draft_n_accepted", 0))
    if obj.get("done"):
        result.output_tokens = int(obj.get("eval_count", 0))
        result.prompt_tokens = int(obj.get("prompt_eval_count", 0))
        result.server_eval_count = result.output_tokens
        result.server_eval_ns = int(obj.get("eval_duration", 0))
        result.server_prompt_count = result.prompt_tokens
        result.server_prompt_ns = int(obj.get("prompt_eval_duration", 0))
        result.drafted = int(obj.get("draft_count", 0))
        result.draft_accepted = int(obj.get("draft_accepted_count", 0))


def _work_items(cfg: BenchConfig, concurrency: int, rng: random.Random) -> list[Any]:
    if cfg.dataset == "chat":
        users = cfg.requests // TURNS if cfg.requests else concurrency
        return [[random_prompt(rng, cfg.prompt_tokens) for _ in range(TURNS)]
                for _ in range(max(1, users))]
    n = cfg.requests or cfg.per_client * concurrency
    return [random_prompt(rng, cfg.prompt_tokens) for _ in range(n)]


def _run_item(http: httpx.Client, cfg: BenchConfig, item: Any, seed: int,
              done: Callable[[], None]) -> list[RequestResult]:
    if cfg.dataset != "chat":
        result, _ = send(http, cfg, item, None, seed)
        done()
        return [result]
    history: list[dict[str, str]] = []
    results = []
    for turn, user in enumerate(item, start=1):  # a conversation resends its history
        history.append({"role": "user", "content": user})
        result, reply = send(http, cfg, None, list(history), seed, turn)
        history.append({"role": "assistant", "content": reply})
        results.append(result)
        done()
    return results


def run_level(cfg: BenchConfig, concurrency: int, on_done: Callable[[], None]) -> Summary:
    """One sweep level: closed loop with `concurrency` clients, or open loop at a rate."""
    rng = random.Random(cfg.seed * 1000 + concurrency)
    items = _work_items(cfg, concurrency, rng)
    queue: Queue[tuple[int, Any]] = Queue()
    for i, item in enumerate(items):
        queue.put((i, item))
    results: list[RequestResult] = []
    lock = threading.Lock()
    gate = threading.Semaphore(cfg.max_concurrency or 1 << 30)
    http = httpx.Client(base_url=cfg.base_url, timeout=httpx.Timeout(600.0), trust_env=False,
                        limits=httpx.Limits(max_connections=256))

    def worker() -> None:
        while True:
            try:
                i, item = queue.get_nowait()
            except Empty:
                return
            out = _run_item(http, cfg, item, cfg.seed + i, on_done)
            with lock:
                results.extend(out)

    def open_loop() -> None:
        arrivals = random.Random(cfg.seed)
        threads = []
        for i, item in enumerate(items):
            time.sleep(arrivals.expovariate(cfg.request_rate))

            def one(i: int = i, item: Any = item) -> None:
                with gate:
                    out = _run_item(http, cfg, item, cfg.seed + i, on_done)
                with lock:
                    results.extend(out)
            t = threading.Thread(target=one)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    start = time.perf_counter()
    if cfg.request_rate > 0:
        open_loop()
        label = f"rate {cfg.request_rate:g}/s"
    else:
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        label = str(concurrency)
    duration = time.perf_counter() - start
    http.close()
    return calculate(label, results, duration)


def warm_up(cfg: BenchConfig) -> None:
    """One uncounted request, so a model load never lands in the first level's TTFT."""
    with httpx.Client(base_url=cfg.base_url, timeout=httpx.Timeout(600.0),
                      trust_env=False) as http:
        result, _ = send(http, BenchConfig(**{**cfg.__dict__, "max_tokens": 2}),
                         "warm up", None, cfg.seed)
    if not result.success:
        raise CorralError(f"the server did not answer a first request: {result.error}")


def total_requests(cfg: BenchConfig, levels: list[int]) -> int:
    if cfg.request_rate > 0:
        levels = [1]
    if cfg.dataset == "chat":
        return sum(max(1, (cfg.requests // TURNS if cfg.requests else c)) * TURNS for c in levels)
    return sum(cfg.requests or cfg.per_client * c for c in levels)


def save_json(path: Path, cfg: BenchConfig, summaries: list[Summary]) -> None:
    doc = {"config": cfg.__dict__, "levels": [s.to_json() for s in summaries]}
    path.write_text(json.dumps(doc, indent=2))


def plot(summaries: list[Summary], out_dir: Path) -> list[Path]:
    """Throughput and TTFT p50/p99 against concurrency, as PNGs (needs the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    xs = [s.label for s in summaries]
    paths = []
    for name, series, ylabel in (
            ("bench-throughput.png", [("output tok/s", [s.output_throughput for s in summaries])],
             "output tokens/s"),
            ("bench-ttft.png", [("TTFT p50", [s.ttft["median"] * 1000 for s in summaries]),
                                ("TTFT p99", [s.ttft["p99"] * 1000 for s in summaries])],
             "ms")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, ys in series:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
