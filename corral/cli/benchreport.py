"""Running a sweep with a progress bar, and the rich table of its results."""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from corral.cli.bench import BenchConfig, run_level, total_requests, warm_up
from corral.cli.benchmetrics import Summary


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f}"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def acceptance(s: Summary) -> str:
    """The acceptance rate of speculative decoding's drafts, with its counts."""
    rate = s.acceptance
    return "-" if rate is None else f"{100 * rate:.0f}% ({s.draft_accepted}/{s.drafted})"


def print_report(cfg: BenchConfig, levels: list[int]) -> list[Summary]:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a file or pipe gets the whole table
    err = Console(stderr=True)
    summaries = []
    warm_up(cfg)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task(f"bench {cfg.model}", total=total_requests(cfg, levels))
        for level in levels:
            summaries.append(run_level(cfg, level, lambda: progress.advance(task)))
    table = Table(title=f"{cfg.model} via {cfg.api} ({cfg.prompt_tokens} in / "
                        f"{cfg.max_tokens} out, {cfg.dataset})")
    drafted = any(s.drafted for s in summaries)  # speculative decoding: a column if any
    for col in ("conc", "ok/fail", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
                "TPOT mean", "ITL p50", "E2E p50", "server tok/s", "server pp tok/s", "peak",
                *(("accepted",) if drafted else ())):
        table.add_column(col, justify="right")
    for s in summaries:
        table.add_row(s.label, f"{s.completed}/{s.failed}", f"{s.request_throughput:.2f}",
                      f"{s.output_throughput:.1f}", _ms(s.ttft["mean"]), _ms(s.ttft["median"]),
                      _ms(s.ttft["p99"]), _ms(s.tpot["mean"]), _ms(s.itl["median"]),
                      _ms(s.e2e["median"]),
                      _rate(s.server_decode_rate), _rate(s.server_prompt_rate),
                      str(s.peak_concurrency), *((acceptance(s),) if drafted else ()))
    console.print(table)
    console.print("times in ms; TPOT is per request, ITL per token; server tok/s is "
                  "eval_count/eval_duration and server pp tok/s prompt_eval_count/"
                  "prompt_eval_duration (native API only), so a gap between 1/TPOT and server "
                  "tok/s is HTTP or scheduling overhead." + (
                      " accepted: drafted tokens the server accepted, of those it drafted "
                      "(speculative decoding)." if drafted else ""))
    for s in summaries:
        if cfg.dataset == "chat" and s.ttft_by_turn:
            turns = ", ".join(f"turn {t}: {v * 1000:.0f}" for t, v in s.ttft_by_turn.items())
            console.print(f"[{s.label}] TTFT p50 by turn (ms): {turns}")
    return summaries
