"""`ps` tells what a model holds: `size` is the weights, the compute buffer, the KV
committed now and the prompt cache's RAM, within 20% of the runner's resident memory
whether it is idle or busy, in one shared KV buffer (the default) as in elastic per-slot
streams with their reserve made or grown; `size_cap` keeps the cap."""

from __future__ import annotations

import sys
import threading
from typing import Any

import httpx
import pytest

from corral.registry.store import Store
from corral.runner.client import RunnerProcess
from corral.runner.wire import LoadReport
from corral.server.daemon import Daemon
from corral.server.residency.resident import Resident
from tests.support import DaemonFactory, wait_for

MODEL = "smollm2:135m"
MiB = 1 << 20


def test_held_counts_the_kv_committed_where_it_lives() -> None:
    # On the CPU: everything in RAM; at the cap's KV it is the load's `size`.
    cpu = LoadReport(weights=100, kv=1600, compute=70, layers=30, size=1770)
    assert cpu.held(1600) == (1770, 0, 0)
    assert cpu.held(100, cache=5) == (275, 0, 0)
    # Fully offloaded: the KV not held is the GPU's, and the model stays all in VRAM;
    # the prompt cache is host RAM.
    gpu = LoadReport(weights=100, kv=1600, compute=70, gpu_layers=30, layers=30, size=1770,
                     size_vram=1770)
    assert gpu.held(1600) == (1770, 1770, 0)
    assert gpu.held(100) == (270, 270, 0)
    assert gpu.held(100, cache=5) == (275, 270, 0)
    # Half the layers offloaded: half of the KV not held comes off the VRAM.
    half = LoadReport(weights=100, kv=1600, compute=70, gpu_layers=15, layers=30, size=1770,
                      size_vram=850)
    assert half.held(100) == (270, 100, 0)
    # Offloaded to a GPU and RPC workers alike: each gives back its share.
    rpc = LoadReport(weights=100, kv=1600, compute=70, gpu_layers=15, layers=30, size=1770,
                     size_vram=425, size_rpc=425)
    assert rpc.held(100) == (270, 50, 50)
    # Two contexts at once for a moment (a build): more than the cap, never negative.
    assert half.held(1700) == (1870, 850, 0)
    assert LoadReport().held(0) == (0, 0, 0)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def _entry(d: Daemon) -> Resident:
    [entry] = d.services.scheduler.running()
    return entry


def _shown(d: Daemon) -> tuple[dict[str, Any], int]:
    """The model's ps entry, with its health checked first (with the watch's deadline,
    longer than ps' own), and the runner's RSS then."""
    entry = _entry(d)
    d.services.scheduler.watch_once()
    [model] = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    assert isinstance(entry.runner, RunnerProcess)
    return model, _rss(entry.runner.pid)


def _check(d: Daemon, state: str) -> dict[str, Any]:
    model, rss = _shown(d)
    size, cap = model["size"], model["size_cap"]
    assert abs(size - rss) <= rss // 5, \
        f"{state}: ps says {size / MiB:.0f} MiB, the runner holds {rss / MiB:.0f} MiB"
    assert cap >= size and model["size_vram"] == 0
    return model


def _generate(d: Daemon, prompt: str, n: int = 8) -> None:
    r = httpx.post(d.url + "/api/generate", timeout=300, json={
        "model": MODEL, "prompt": prompt, "stream": False,
        "options": {"num_predict": n, "temperature": 0, "seed": 1}})
    assert r.status_code == 200, r.text


def _burst(one: Any, n: int) -> None:
    burst = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in burst:
        t.start()
    for t in burst:
        t.join(timeout=300)


def _reserve_made(d: Daemon) -> bool:
    d.services.scheduler.watch_once()
    health = _entry(d).health
    return health is not None and health.reserve_streams > 0


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ps_size_follows_resident_memory_in_elastic_streams(
        starter_store: Store, daemon_factory: DaemonFactory) -> None:
    # Elastic KV up to 8 slots of 2,048 tokens: ~45 MiB of KV each, 360 MiB at the cap.
    d = daemon_factory(starter_store, NUM_PARALLEL="0", MAX_SLOTS="8",
                       CONTEXT_LENGTH="2048", KV_POOL="off")
    r = httpx.post(d.url + "/api/generate", json={"model": MODEL}, timeout=300)
    assert r.status_code == 200, r.text
    loaded = _check(d, "idle after load")
    assert loaded["slots"] == 1 and loaded["slots_cap"] == 8
    assert loaded["size_cap"] > loaded["size"] + 300 * MiB  # seven slots' KV to grow into

    _generate(d, "Hi")  # the cap's context is made at the first rest after serving
    wait_for(lambda: _reserve_made(d), timeout=120)
    made = _check(d, "with the reserve made")
    assert made["size_cap"] == loaded["size_cap"] + made["prompt_cache"]["bytes"]

    done: list[int] = []

    def one(i: int) -> None:
        _generate(d, f"Tell me story number {i}.", 16)
        done.append(i)

    _burst(one, 4)
    assert sorted(done) == [0, 1, 2, 3]
    grown = _check(d, "grown")
    # Grown onto the reserve: eight streams, of which only the cells written are held.
    assert grown["slots"] == 8 and grown["size"] < grown["size_cap"] - 200 * MiB
    # The shrunk state is checked on the engine (test_reserve): the daemon's runner
    # shrinks only after 30 s quiet, and no setting reaches that window.


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ps_size_follows_resident_memory_in_the_shared_buffer(
        starter_store: Store, daemon_factory: DaemonFactory) -> None:
    # The default: one buffer for 8 slots of 2,048 tokens (360 MiB of KV), made at the
    # load, of which only the pages its cells write are held.
    d = daemon_factory(starter_store, NUM_PARALLEL="0", MAX_SLOTS="8",
                       CONTEXT_LENGTH="2048")
    r = httpx.post(d.url + "/api/generate", json={"model": MODEL}, timeout=300)
    assert r.status_code == 200, r.text
    loaded = _check(d, "idle after load")
    assert loaded["slots"] == 8 and loaded["slots_cap"] == 8
    assert loaded["size_cap"] > loaded["size"] + 300 * MiB  # none of it written yet
    done: list[int] = []

    def one(i: int) -> None:
        _generate(d, f"Tell me story number {i}. " * 40, 16)  # ~300 cells each
        done.append(i)

    _burst(one, 8)
    assert sorted(done) == list(range(8))
    busy = _check(d, "after a burst")
    assert busy["slots"] == 8 and busy["size"] > loaded["size"] + 20 * MiB
    assert busy["size"] < busy["size_cap"] - 200 * MiB
