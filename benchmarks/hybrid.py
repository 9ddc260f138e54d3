"""Prompt reuse on memories that cannot be cut back: Corral against llama-server with
its defaults.

A hybrid memory (recurrent layers beside attention: LFM2, Qwen3.5, Nemotron-H) cannot be
cut back to an earlier position, and neither can a sliding-window cache of the window's
size once a prompt has left the window, so a prompt that keeps less of a slot than it
holds is read again unless the server kept a checkpoint (issue 67). `--model hybrid`: a
random LFM2 of the `bench` shape (tests/hybrid_model.py: ten layers, 512 wide, Q8_0, the
chat starter's vocabulary and ChatML template) through `/v1/chat/completions`, a
context of 8,192; `--model swa`: the base starter (Gemma 3 270M, a window of 512) through
`/v1/completions` with the messages joined (it has no chat template), a context of
32,768 and chats four times as long. One slot each, greedy, `max_tokens` 1 (the time is
the time to the first token):

- a new chat of five turns of about 300 tokens each, read whole (the prefill's speed);
- regenerate: the same messages again;
- edit the last message;
- the next turn of the chat;
- back to it after another chat took the one slot, a turn further;
- that chat a turn further again after an unload (Corral with its disk tier on; a new
  llama-server, which keeps no prompt cache on disk by itself).

The two servers run side by side and take each request in turn (the other order every
other round), so that a machine whose speed drifts over the run moves both alike.
Times are wall-clock medians of ROUNDS, and the tokens each server read
(`usage.prompt_tokens` less what it says it reused); then each server's resident memory
after the rounds (Corral's daemon and runner together). Prints the table and appends it
to benchmarks/RESULTS.md. `--corral-root` serves Corral from another checkout (a
before-and-after run).

    .venv/bin/python benchmarks/hybrid.py [--model hybrid|swa] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import llama_server_binaries, serve_gguf, start_llama_server  # noqa: E402
from latency import rss, runner_pids  # noqa: E402

from corral.config import load_settings  # noqa: E402
from corral.process import physical_cores  # noqa: E402
from corral.registry.starter import CHAT_NAME, STARTER_NAME, starter_model_path  # noqa: E402
from corral.registry.store import Store  # noqa: E402
from tests.hybrid_model import SHAPES, write_hybrid  # noqa: E402

MODEL = "bench-hybrid"
ROUNDS = 11  # a 30 ms request moves by several ms between rounds (a median of five moved 0.85-1.21x)
# A pause after each request, as a user's or a tool's between turns: what a server does
# after a response (Corral decodes again a prompt token it took back from a request for
# one token) then runs neither beside the other server's timed request, on the same
# cores, nor before its own next one.
PAUSE = 0.1


@dataclass(frozen=True)
class Bench:
    num_ctx: int
    turns: int  # of a chat, each about 300 words
    chat: bool  # /v1/chat/completions (else /v1/completions, the messages joined)


BENCHES = {"hybrid": Bench(8192, 5, True), "swa": Bench(32768, 20, False)}
WORDS = ("river stone lamp orchard winter copper ladder signal harbor violet engine "
         "meadow canvas thunder pocket silver garden candle market feather").split()


BENCH = BENCHES["hybrid"]
MEMORY = "resident memory after"


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(seed: int, turns: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": text(rng, 200)}]
    for _ in range(turns):
        messages += [{"role": "user", "content": text(rng, 150)},
                     {"role": "assistant", "content": text(rng, 150)}]
    return messages[:-1]  # ends with a user message


def ask(client: httpx.Client, messages: list[dict[str, str]]) -> tuple[float, int, int]:
    """Seconds to the first token, prompt tokens, and of them reused. One client and
    its kept-alive connection for every request: a new httpx client costs ~30 ms (its
    TLS context), which would hide a server's own overhead."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    if BENCH.chat:
        route, body["messages"] = "/v1/chat/completions", messages
    else:
        route, body["prompt"] = "/v1/completions", "\n\n".join(m["content"] for m in messages)
    t0 = time.perf_counter()
    r = client.post(route, timeout=600, json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return seconds, usage["prompt_tokens"], cached


@dataclass
class Server:
    """One contender, started: its URL, how to unload and load it again (a new URL for
    a new llama-server), how much memory it holds, and how to stop it."""

    url: str
    restart: Callable[[], str]
    memory: Callable[[], int]
    stop: Callable[[], None]


Results = dict[str, tuple[float, int, int]]


def workloads(servers: list[Server]) -> list[Results]:
    """Each workload's median time for each server, its prompt tokens and those reused
    (the last round's); each server's memory after them (as a time: bytes, no tokens);
    then the last chat a turn further once more, after each server's `restart`. The
    servers run side by side and take each request in turn (in the other order every
    other round): a machine whose speed drifts over a run moves both alike."""
    clients = [httpx.Client(base_url=s.url) for s in servers]
    try:
        outs, last = _rounds(clients)
    finally:
        for c in clients:
            c.close()
    resumed = last + [{"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "and after that?"}]
    for server, out in zip(servers, outs):
        out[MEMORY] = (float(server.memory()), 0, 0)
        with httpx.Client(base_url=server.restart()) as client:
            out["resumed after an unload"] = ask(client, resumed)
    return outs


def _rounds(clients: list[httpx.Client]) -> tuple[list[Results], list[dict[str, str]]]:
    out: list[dict[str, list[tuple[float, int, int]]]] = [{} for _ in clients]
    back: list[dict[str, str]] = []
    for r in range(ROUNDS):
        order = list(enumerate(clients))[::1 if r % 2 == 0 else -1]

        def each(name: str | None, messages: list[dict[str, str]]) -> None:
            for i, client in order:
                got = ask(client, messages)
                time.sleep(PAUSE)
                if name is not None:
                    out[i].setdefault(name, []).append(got)

        a, b = chat(100 + r, BENCH.turns), chat(200 + r, BENCH.turns)
        each("a new chat", a)  # each slot holds it after
        each("regenerate", a)
        edited = a[:-1] + [{"role": "user", "content": a[-1]["content"] + " and one more"}]
        each("edit the last message", edited)
        extended = a + [{"role": "assistant", "content": "ok"},
                        {"role": "user", "content": text(random.Random(r), 150)}]
        each("the next turn", extended)
        each(None, b)  # another chat takes the slot
        back = extended + [{"role": "assistant", "content": "ok"},
                           {"role": "user", "content": "and then?"}]
        each("back to the first chat", back)
    return [{k: (statistics.median(x[0] for x in v), v[-1][1], v[-1][2])
             for k, v in o.items()} for o in out], back


def corral(gguf: Path, tmp: Path, threads: int, root: Path) -> Server:
    """One slot, and the disk tier on: an unload writes the slot and RAM cache there."""
    url, proc = serve_gguf(gguf, MODEL, tmp, root, CONTEXT_LENGTH=str(BENCH.num_ctx),
                           NUM_PARALLEL="1", CACHE_DISK="2GiB")
    load = {"model": MODEL, "options": {"num_thread": threads, "num_ctx": BENCH.num_ctx}}

    def unload_and_load() -> str:
        httpx.post(url + "/api/generate", timeout=300, json={"model": MODEL, "keep_alive": 0})
        deadline = time.monotonic() + 120
        while httpx.get(url + "/api/ps", timeout=30).json()["models"]:
            if time.monotonic() > deadline:
                raise SystemExit("Error: the model did not unload within 120 s")
            time.sleep(0.1)
        httpx.post(url + "/api/generate", timeout=300, json=load)
        return url

    def stop() -> None:
        proc.terminate()
        proc.wait(60)

    httpx.post(url + "/api/generate", timeout=300, json=load)
    return Server(url, unload_and_load,
                  lambda: rss(proc.pid) + sum(map(rss, runner_pids(proc.pid))), stop)


def llama_server(binaries: Path, gguf: Path, threads: int) -> Server:
    """With its defaults; "resumed" is a new server (it keeps no prompt cache on disk
    unless a client saves and restores slots by hand)."""
    procs = []

    def start() -> str:
        url, proc = start_llama_server(binaries, gguf, 1, BENCH.num_ctx, threads, "--jinja")
        procs.append(proc)
        return url

    def restart() -> str:
        stop()
        return start()

    def stop() -> None:
        procs[-1].terminate()
        procs[-1].wait(60)

    return Server(start(), restart, lambda: rss(procs[-1].pid), stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(BENCHES), default="hybrid")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--corral-root", type=Path, default=ROOT)
    args = parser.parse_args()
    global BENCH
    BENCH = BENCHES[args.model]
    threads = args.threads or physical_cores()
    store = Store(load_settings().models)
    chat_gguf = starter_model_path(store, CHAT_NAME)
    base_gguf = starter_model_path(store, STARTER_NAME)
    if chat_gguf is None or base_gguf is None:
        raise SystemExit("Error: the starters are not installed; run ./install.sh")
    binaries = llama_server_binaries()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = base_gguf if args.model == "swa" else write_hybrid(
            chat_gguf, Path(tmp) / "bench-hybrid.gguf", shape=SHAPES["bench"])
        servers = [llama_server(binaries, gguf, threads)]
        try:
            servers.append(corral(gguf, Path(tmp), threads, args.corral_root))
            theirs, ours = workloads(servers)
        finally:
            for server in servers:
                server.stop()
    lines = [f"{'workload':26} {'llama-server':>22} {'corral':>22} {'ratio':>6}"]
    for name, (t, n, cached) in theirs.items():
        o, on, ocached = ours[name]
        if name == MEMORY:
            lines.append(f"{name:26} {t / 2**20:10.0f} MiB{'':8} {o / 2**20:10.0f} MiB"
                         f"{'':8} {o / t:5.2f}x")
            continue
        lines.append(f"{name:26} {t:7.3f} s {cached:5d}/{n:<5d} {o:7.3f} s {ocached:5d}/{on:<5d}"
                     f" {o / t:5.2f}x")
    report(args.model, threads, args.corral_root, lines)


def report(model: str, threads: int, root: Path, lines: list[str]) -> None:
    text_ = "\n".join(lines)
    print(text_)
    what = ("the base starter (Gemma 3 270M, a window of 512), a context of 32,768"
            if model == "swa" else "random LFM2 `bench` shape")
    served = "" if root == ROOT else f", Corral from {root}"
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as out:
        out.write(f"\n## hybrid.py --model {model} ({dt.date.today()}, {threads} threads, "
                  f"{what}, one slot{served}; time to the first token, tokens "
                  f"reused/prompt, ratio corral/llama-server)\n\n```\n{text_}\n```\n")


if __name__ == "__main__":
    main()
