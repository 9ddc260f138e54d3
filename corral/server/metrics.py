"""/metrics in Prometheus' text format, through prometheus-client: per model, requests
by status, tokens (speculative decoding's drafted and accepted ones too), and TTFT and
TPOT histograms, counted as requests end; and what each loaded runner reports (slots,
queue, KV cells, the prompt cache), read when the page is scraped.

prometheus-client takes a tenth of a second to import (its exposition module brings
http.server), so the daemon makes its Metrics after a preloaded model has started
loading, beside the HTTP stack."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
# generate_latest writes the classic text format; name its version rather than the
# library's newest (which some scrapers do not know yet).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# What a runner reports, by the name it takes here (a `_total` name is a counter).
RUNNER_FAMILIES = {
    "queue_depth": "Requests waiting for a slot.",
    "busy_slots": "Slots decoding or prefilling.",
    "slots": "Slots per loaded model.",
    "kv_cells_used": "KV cache cells holding tokens.",
    "kv_cells_reserved": "KV cache cells reserved.",
    "sampled_tokens_total": "Tokens sampled since the model loaded, counted as they are "
                            "made (a live rate; generated_tokens_total counts at each "
                            "request's end).",
    "preemptions_total": "Sequences preempted because the KV pool was full (pool mode), "
                         "since the model loaded.",
    "cache_bytes": "Host RAM the prompt cache holds.",
    "cache_budget": "Host RAM the prompt cache may hold.",
    "cache_entries": "Prompt cache entries in RAM.",
    "cache_hits_total": "Prompts restored from the prompt cache.",
    "cache_tokens_restored_total": "Prompt tokens restored from the prompt cache instead "
                                   "of evaluated.",
    "cache_tokens_shared_total": "Prompt tokens copied from another running request's KV "
                                 "instead of evaluated.",
    "cache_disk_bytes": "Disk the prompt cache's disk tier holds.",
}

Gauges = Callable[[], Iterable[tuple[str, dict[str, float]]]]


class _Runners(Collector):
    """The loaded runners' own figures, asked for at each scrape."""

    def __init__(self, gauges: Gauges) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows = list(self.gauges())
        for key, help_text in RUNNER_FAMILIES.items():
            family: CounterMetricFamily | GaugeMetricFamily
            if key.endswith("_total"):
                family = CounterMetricFamily(f"corral_{key}", help_text, labels=["model"])
            else:
                family = GaugeMetricFamily(f"corral_{key}", help_text, labels=["model"])
            for model, values in rows:
                if key in values:
                    family.add_metric([model], values[key])
            yield family


class Metrics:
    def __init__(self, gauges: Gauges = lambda: ()) -> None:
        prometheus_client.disable_created_metrics()  # no `_created` series beside each
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("corral_requests", "Requests by model and status.",
                                 ["model", "status"], registry=self.registry)
        self._prompt = Counter("corral_prompt_tokens", "Prompt tokens evaluated.", ["model"],
                               registry=self.registry)
        self._generated = Counter("corral_generated_tokens", "Tokens generated.", ["model"],
                                  registry=self.registry)
        self._drafted = Counter("corral_draft_tokens", "Tokens drafted by speculative "
                                "decoding and verified.", ["model"], registry=self.registry)
        self._accepted = Counter("corral_draft_accepted_tokens", "Drafted tokens accepted "
                                 "(each is also a generated token).", ["model"],
                                 registry=self.registry)
        self._ttft = Histogram("corral_time_to_first_token_seconds", "Time to first token.",
                               ["model"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram("corral_time_per_output_token_seconds",
                               "Time per output token.", ["model"], buckets=TPOT_BUCKETS,
                               registry=self.registry)
        self.registry.register(_Runners(gauges))

    def request(self, model: str, status: str) -> None:
        self._requests.labels(model, status).inc()

    def tokens(self, model: str, prompt: int, generated: int, eval_ns: int) -> None:
        self._prompt.labels(model).inc(prompt)
        self._generated.labels(model).inc(generated)
        if generated > 1:
            self._tpot.labels(model).observe(eval_ns / 1e9 / (generated - 1))

    def drafts(self, model: str, drafted: int, accepted: int) -> None:
        self._drafted.labels(model).inc(drafted)
        self._accepted.labels(model).inc(accepted)

    def ttft(self, model: str, seconds: float) -> None:
        self._ttft.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
