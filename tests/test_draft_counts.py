"""Speculative decoding's counts, from the runner's done line to every place they show:
the native final object, OpenAI's and the Responses API's `timings` (llama-server's),
/infill's, /metrics, `corral bench` and `corral run --verbose`.

The engine fills the counts; here a runner that answers with set counts (the daemon's
own runner seam, `runner_factory`) carries them through a real daemon, the renderers are
fed a Finished directly, and one test on the chat starter checks the shape the engine
gives, whatever it drafted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from corral.api.wire import parse
from corral.api.wire.infill import InfillRequest
from corral.cli.benchmetrics import RequestResult, calculate
from corral.cli.benchreport import acceptance
from corral.cli.tables import verbose_stats
from corral.registry.store import Store
from corral.runner.loadconfig import LoadConfig
from corral.runner.wire import (CompletionJob, DoneLine, Health, LoadReport, TokenLine,
                                read_line)
from corral.server.daemon import Daemon
from corral.server.dialects.infill import Answer, Limits
from corral.server.dialects.native import Lines
from corral.server.dialects.openai import ChatChunks, TextChunks
from corral.server.dialects.responses import Items
from corral.server.pipeline.request import Finished
from tests.gguf_files import write_tiny_gguf
from tests.support import start_daemon

DONE = DoneLine(prompt_tokens=12, prompt_eval_count=9, prompt_eval_duration=3_000_000,
                eval_count=20, eval_duration=40_000_000, draft_count=16,
                draft_accepted_count=11)
FINAL = Finished(prompt_tokens=12, cached_tokens=3, eval_count=20,
                 prompt_eval_duration=3_000_000, eval_duration=40_000_000, draft_count=16,
                 draft_accepted_count=11)


def test_a_done_line_carries_the_counts_across_the_wire() -> None:
    assert read_line(json.loads(json.dumps(DONE.to_json()))) == DONE
    older = {k: v for k, v in DONE.to_json().items() if not k.startswith("draft")}
    assert read_line(older) == DoneLine(**{**DONE.__dict__, "draft_count": 0,
                                           "draft_accepted_count": 0})


def test_the_native_final_object_names_them_after_eval_duration() -> None:
    for chat in (True, False):
        final = Lines("m", chat=chat).whole(iter([FINAL]))
        assert (final["draft_count"], final["draft_accepted_count"]) == (16, 11)
        keys = list(final)
        assert keys.index("eval_duration") + 1 == keys.index("draft_count")
    nothing = Lines("m", chat=True).whole(iter([Finished(eval_count=3)]))
    assert (nothing["draft_count"], nothing["draft_accepted_count"]) == (0, 0)


def drafts(timings: Mapping[str, Any]) -> tuple[int, int]:
    return timings["draft_n"], timings["draft_n_accepted"]


def sse(frames: Iterator[bytes]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        data = frame.decode().split("data: ", 1)[1].strip()
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


def test_openai_objects_carry_llama_servers_timings_and_the_sdk_reads_them() -> None:
    chat = ChatCompletion.model_validate(ChatChunks("m", False).whole(iter([FINAL])))
    assert chat.usage is not None and chat.usage.completion_tokens == 20
    assert drafts(chat.model_extra["timings"]) == (16, 11)  # type: ignore[index]
    text = Completion.model_validate(TextChunks("m", False, False).whole(iter([FINAL])))
    assert drafts(text.model_extra["timings"]) == (16, 11)  # type: ignore[index]
    timings = ChatChunks("m", False).whole(iter([FINAL]))["timings"]
    assert timings["predicted_n"] == 20 and timings["prompt_n"] == 9
    assert timings["cache_n"] == 3 and timings["predicted_per_second"] == pytest.approx(500)


def test_a_stream_puts_them_on_its_last_chunk_as_llama_server_does() -> None:
    for usage in (False, True):
        for chunks in (sse(ChatChunks("m", usage).frames(iter([FINAL]))),
                       sse(TextChunks("m", usage, False).frames(iter([FINAL])))):
            assert drafts(chunks[-1]["timings"]) == (16, 11)
            assert not any("timings" in c for c in chunks[:-1])
            assert ("usage" in chunks[-1]) is usage
    for chunk in sse(ChatChunks("m", True).frames(iter([FINAL]))):
        ChatCompletionChunk.model_validate(chunk)


def test_n_choices_sum_their_drafts() -> None:
    second = Finished(index=1, eval_count=5, eval_duration=1, draft_count=4,
                      draft_accepted_count=1)
    whole = ChatChunks("m", False).whole(iter([FINAL, second]))
    assert drafts(whole["timings"]) == (20, 12) and whole["timings"]["predicted_n"] == 25
    ends = [c for c in sse(ChatChunks("m", False).frames(iter([FINAL, second])))
            if "timings" in c]
    assert [drafts(c["timings"]) for c in ends] == [(16, 11), (4, 1)]  # each choice its own


def test_the_responses_api_carries_them_whole_and_on_response_completed() -> None:
    whole = Items("m", None, []).whole(iter([FINAL]))
    assert drafts(whole["timings"]) == (16, 11)
    events = sse(Items("m", None, []).frames(iter([FINAL])))
    assert events[-1]["type"] == "response.completed"
    assert drafts(events[-1]["timings"]) == (16, 11)
    assert not any("timings" in e for e in events[:-1])


def test_infill_adds_them_to_its_timings() -> None:
    wire = parse(InfillRequest, {"input_prefix": "a", "input_suffix": "b"})
    final = Answer("m", wire, Limits(0, 0)).whole(iter([FINAL]))
    assert drafts(final["timings"]) == (16, 11) and final["timings"]["predicted_n"] == 20


def test_verbose_stats_show_the_drafts_only_when_there_were_some() -> None:
    final = {"eval_count": 20, "eval_duration": 40_000_000, "draft_count": 16,
             "draft_accepted_count": 11}
    lines = verbose_stats(final).splitlines()
    assert lines[-3:] == ["draft count:          16 token(s)",
                          "draft accepted:       11 token(s)",
                          "acceptance rate:      68.75%"]
    plain = verbose_stats({**final, "draft_count": 0, "draft_accepted_count": 0})
    assert "draft" not in plain and "eval rate" in plain
    assert "draft" not in verbose_stats({"eval_count": 3})  # a server that sends none


def test_bench_sums_the_drafts_into_an_acceptance_rate() -> None:
    def one(drafted: int, accepted: int) -> RequestResult:
        return RequestResult(start=0.0, chunk_times=[0.1, 0.2], end=0.3, output_tokens=2,
                             drafted=drafted, draft_accepted=accepted)

    s = calculate("1", [one(10, 6), one(6, 2), one(0, 0)], duration=1.0)
    assert (s.drafted, s.draft_accepted) == (16, 8) and s.acceptance == pytest.approx(0.5)
    none = calculate("1", [one(0, 0)], duration=1.0)
    assert none.drafted == 0 and none.acceptance is None
    assert (acceptance(s), acceptance(none)) == ("50% (8/16)", "-")  # the table's cell


class CountingRunner:
    """A runner that answers every completion with one token and DONE's counts."""

    def __init__(self, config: LoadConfig) -> None:
        self.config, self.report = config, LoadReport(slots=2, num_ctx=1024)

    def start(self, timeout: float) -> LoadReport:
        return self.report

    def completion(self, job: CompletionJob) -> Iterator[TokenLine | DoneLine]:
        yield TokenLine("ok")
        yield DONE

    def health(self, timeout: float = 5.0) -> Health:
        return Health(slots=2, slots_cap=2)

    def stop(self, timeout: float = 10.0) -> None: ...
    def end(self) -> None: ...
    def alive(self) -> bool: return True
    def cancel(self, job_id: str) -> None: ...
    def set_threads(self, n: int) -> None: ...
    def clear_cache(self) -> None: ...


@pytest.fixture
def counting(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(None, tmp_path / "daemon", runner_factory=CountingRunner)  # type: ignore[arg-type]
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{d.url}/api/blobs/{digest}", content=data).status_code == 201
    r = httpx.post(f"{d.url}/api/create", json={
        "model": "tiny", "files": {"tiny.gguf": digest}, "stream": False,
        "template": "{{ range .Messages }}{{ .Content }}{{ end }}"})
    assert r.status_code == 200, r.text
    yield d
    d.shutdown()


def test_the_counts_reach_every_api_and_the_metrics(counting: Daemon) -> None:
    url, chat = counting.url, [{"role": "user", "content": "hi"}]
    native = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": chat,
                                                 "stream": False}, timeout=30).json()
    assert (native["draft_count"], native["draft_accepted_count"]) == (16, 11)
    generated = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "hi",
                                                        "stream": False}, timeout=30).json()
    assert (generated["draft_count"], generated["draft_accepted_count"]) == (16, 11)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    reply = client.chat.completions.create(model="tiny", messages=chat)  # type: ignore[arg-type]
    assert drafts(reply.model_extra["timings"]) == (16, 11)  # type: ignore[index]
    done = client.responses.create(model="tiny", input="hi")
    assert drafts(done.model_extra["timings"]) == (16, 11)  # type: ignore[index]
    page = httpx.get(url + "/metrics").text
    assert 'corral_draft_tokens_total{model="tiny:latest"} 64.0' in page
    assert 'corral_draft_accepted_tokens_total{model="tiny:latest"} 44.0' in page


def test_the_engines_counts_on_a_copy(daemon: Daemon) -> None:
    """The engine's counts on a workload that drafts for sure: the base starter copying a
    file (its n-gram drafts are mostly kept). Drafted tokens are counted whole, kept ones
    among them, on the native route and in OpenAI's timings alike; with speculation
    broken (no draft) this fails."""
    from tests.test_speculative import REPETITIVE

    options = {"num_predict": 64, "temperature": 0, "seed": 1}
    native = httpx.post(daemon.url + "/api/generate", json={
        "model": "gemma3:270m-base", "prompt": REPETITIVE, "raw": True, "stream": False,
        "options": options}, timeout=300).json()
    assert 0 < native["draft_accepted_count"] <= native["draft_count"]
    assert native["draft_accepted_count"] < native["eval_count"]
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x")
    reply = client.completions.create(model="gemma3:270m-base", prompt=REPETITIVE,
                                      max_tokens=64, temperature=0, seed=1)
    drafted, accepted = drafts(reply.model_extra["timings"])  # type: ignore[index]
    assert 0 < accepted <= drafted