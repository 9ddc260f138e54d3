"""The prompt cache through the real daemon: two conversations alternating on one slot
restore their prompts, the APIs count restored tokens as cached, ps, show and /metrics
report the cache, and with the disk tier a conversation stays warm across an unload."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest

from corral.registry.store import Store
from tests.support import DaemonFactory, wait_for

pytestmark = pytest.mark.model

MODEL = "gemma3:270m-base"
DOC_A = "The river rises in the northern hills, where snow melts each spring. " * 20
DOC_B = "A baker wakes before dawn and shapes the dough that rose overnight. " * 20


def complete(url: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "seed": 1})
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"])


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def loaded(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/api/ps", timeout=30).json()["models"])


def test_alternating_conversations_and_an_unload_stay_warm(starter_store: Store,
                                                           daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NUM_PARALLEL="1", CACHE_RAM="256MiB",
                       CACHE_DISK="256MiB")
    first_a, first_b = complete(d.url, DOC_A), complete(d.url, DOC_B)
    assert cached(first_a) == 0 and cached(first_b) <= 1  # B shares only the BOS token
    # One slot: B took it from A, so A's second turn restores A from the cache.
    second_a = complete(d.url, DOC_A + "Where does it rise?")
    assert cached(second_a) >= first_a["prompt_tokens"] - 1
    [model] = loaded(d.url)
    stats = model["prompt_cache"]
    assert stats["hits"] == 1 and stats["entries"] >= 1 and 0 < stats["bytes"] <= 256 << 20
    assert stats["tokens_restored"] == cached(second_a)
    assert model["size"] >= stats["bytes"]  # nothing the model holds is missing from ps
    show = httpx.post(d.url + "/api/show", json={"model": MODEL}, timeout=30).json()
    assert show["prompt_cache"]["hits"] == 1
    metrics = {(sample.name, sample.labels.get("model")): sample.value
               for family in text_string_to_metric_families(
                   httpx.get(d.url + "/metrics", timeout=30).text)
               for sample in family.samples}
    assert metrics[("corral_cache_hits_total", MODEL)] == 1
    assert metrics[("corral_cache_tokens_restored_total", MODEL)] == cached(second_a)

    # Unloaded: the runner writes what it held to the disk tier, and the next load finds it.
    r = httpx.post(d.url + "/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=60)
    assert r.json()["done_reason"] == "unload"
    wait_for(lambda: not loaded(d.url), timeout=60)
    third_a = complete(d.url, DOC_A + "Where does it rise? And where does it end?")
    assert cached(third_a) >= second_a["prompt_tokens"] - 1
