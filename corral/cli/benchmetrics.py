"""Serving metrics exactly as vLLM defines them, from client-side timestamps.

TTFT: request start to the first chunk with text. ITL: gaps between later
chunks with text (token-weighted: pooled over all requests). TPOT: per request,
(E2E - TTFT) / (output tokens - 1) (request-weighted). E2E: start to the last
chunk. Throughputs divide by the wall duration, ramp-up and drain included.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestResult:
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    success: bool = True
    error: str = ""
    server_eval_count: int = 0
    server_eval_ns: int = 0
    server_prompt_count: int = 0
    server_prompt_ns: int = 0
    drafted: int = 0  # speculative decoding's tokens drafted, as the server reports them
    draft_accepted: int = 0
    turn: int = 0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    return {"mean": sum(values) / len(values), "median": percentile(values, 50),
            "p99": percentile(values, 99)}


def peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@dataclass
class Summary:
    label: str
    completed: int
    failed: int
    duration: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    peak_concurrency: int
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    server_decode_rate: float  # eval_count / eval_duration, averaged per request
    server_prompt_rate: float
    ttft_by_turn: dict[int, float] = field(default_factory=dict)
    drafted: int = 0  # speculative decoding, summed over the requests
    draft_accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted tokens; None when nothing was drafted."""
        return self.draft_accepted / self.drafted if self.drafted else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Summary":
        doc = dict(doc)
        doc["ttft_by_turn"] = {int(k): v for k, v in doc.get("ttft_by_turn", {}).items()}
        return cls(**doc)


def _rate(count: int, ns: int) -> float | None:
    return count / (ns / 1e9) if count and ns else None


def calculate(label: str, results: list[RequestResult], duration: float) -> Summary:
    ok = [r for r in results if r.success]
    rates = [x for x in (_rate(r.server_eval_count, r.server_eval_ns) for r in ok) if x]
    prompt_rates = [x for x in (_rate(r.server_prompt_count, r.server_prompt_ns) for r in ok)
                    if x]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    out_tokens = sum(r.output_tokens for r in ok)
    return Summary(
        label=label, completed=len(ok), failed=len(results) - len(ok), duration=duration,
        input_tokens=sum(r.prompt_tokens for r in ok), output_tokens=out_tokens,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        output_throughput=out_tokens / duration if duration > 0 else 0.0,
        peak_concurrency=peak_concurrency(ok),
        ttft=summarize([r.ttft for r in ok if r.ttft is not None]),
        tpot=summarize([t for t in (r.tpot for r in ok) if t is not None]),
        itl=summarize([gap for r in ok for gap in r.itl]),
        e2e=summarize([r.e2e for r in ok]),
        server_decode_rate=sum(rates) / len(rates) if rates else math.nan,
        server_prompt_rate=sum(prompt_rates) / len(prompt_rates) if prompt_rates else math.nan,
        ttft_by_turn={t: percentile(v, 50) for t, v in sorted(by_turn.items())},
        drafted=sum(r.drafted for r in ok), draft_accepted=sum(r.draft_accepted for r in ok),
    )
