"""Prometheus text-format metrics per model: requests, tokens, TTFT and TPOT histograms."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Iterable

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.generated_tokens: dict[str, int] = defaultdict(int)
        self.ttft_hist: dict[str, _Histogram] = {}
        self.tpot_hist: dict[str, _Histogram] = {}

    def request(self, model: str, status: str) -> None:
        with self.lock:
            self.requests[(model, status)] += 1

    def tokens(self, model: str, prompt: int, generated: int, eval_ns: int) -> None:
        with self.lock:
            self.prompt_tokens[model] += prompt
            self.generated_tokens[model] += generated
            if generated > 1:
                hist = self.tpot_hist.setdefault(model, _Histogram(TPOT_BUCKETS))
                hist.observe(eval_ns / 1e9 / (generated - 1))

    def ttft(self, model: str, seconds: float) -> None:
        with self.lock:
            self.ttft_hist.setdefault(model, _Histogram(TTFT_BUCKETS)).observe(seconds)

    def render(self, gauges: Callable[[], Iterable[tuple[str, dict[str, float]]]]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP corral_{name} {help_text}")
            out.append(f"# TYPE corral_{name} {kind}")

        with self.lock:
            family("requests_total", "counter", "Requests by model and status.")
            for (model, status), n in sorted(self.requests.items()):
                out.append(f'corral_requests_total{{model="{_label(model)}",status="{status}"}} {n}')
            family("prompt_tokens_total", "counter", "Prompt tokens evaluated.")
            for model, n in sorted(self.prompt_tokens.items()):
                out.append(f'corral_prompt_tokens_total{{model="{_label(model)}"}} {n}')
            family("generated_tokens_total", "counter", "Tokens generated.")
            for model, n in sorted(self.generated_tokens.items()):
                out.append(f'corral_generated_tokens_total{{model="{_label(model)}"}} {n}')
            for name, hists, help_text in (
                    ("time_to_first_token_seconds", self.ttft_hist, "Time to first token."),
                    ("time_per_output_token_seconds", self.tpot_hist, "Time per output token.")):
                family(name, "histogram", help_text)
                for model, h in sorted(hists.items()):
                    lab = f'model="{_label(model)}"'
                    for bound, count in zip(h.buckets, h.counts):
                        out.append(f'corral_{name}_bucket{{{lab},le="{bound}"}} {count}')
                    out.append(f'corral_{name}_bucket{{{lab},le="+Inf"}} {h.n}')
                    out.append(f"corral_{name}_sum{{{lab}}} {h.total}")
                    out.append(f"corral_{name}_count{{{lab}}} {h.n}")
        names = {"queue_depth": "Requests waiting for a slot.",
                 "busy_slots": "Slots decoding or prefilling.",
                 "slots": "Slots per loaded model.",
                 "kv_cells_used": "KV cache cells holding tokens.",
                 "kv_cells_reserved": "KV cache cells reserved.",
                 "sampled_tokens_total": "Tokens sampled since the model loaded, counted as "
                                         "they are made (a live rate; generated_tokens_total "
                                         "counts at each request's end).",
                 "preemptions_total": "Sequences preempted because the KV pool was full "
                                      "(pool mode), since the model loaded.",
                 "cache_bytes": "Host RAM the prompt cache holds.",
                 "cache_budget": "Host RAM the prompt cache may hold.",
                 "cache_entries": "Prompt cache entries in RAM.",
                 "cache_hits_total": "Prompts restored from the prompt cache.",
                 "cache_tokens_restored_total": "Prompt tokens restored from the prompt cache "
                                                "instead of evaluated.",
                 "cache_tokens_shared_total": "Prompt tokens copied from another running "
                                              "request's KV instead of evaluated.",
                 "cache_disk_bytes": "Disk the prompt cache's disk tier holds."}
        rows = list(gauges())
        for key, help_text in names.items():
            family(key, "counter" if key.endswith("_total") else "gauge", help_text)
            for model, values in rows:
                if key in values:
                    out.append(f'corral_{key}{{model="{_label(model)}"}} {values[key]}')
        return "\n".join(out) + "\n"
