"""One conformance suite for the four APIs: every scenario runs through native
/api/chat, /v1/chat/completions, /v1/messages and /v1/responses, each checked in its
own shape. The policy under test is one for all: a failure before the first token is a
real status in the API's error shape; after it, the API's in-stream error event."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from corral.registry.create import CreateRequest, create_model
from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.conformance import APIS, BAD_VALUES, BY_NAME, Api, weather_tool
from tests.support import DaemonFactory, start_daemon, wait_for
from tests.test_reasoning import TEMPLATE

pytestmark = pytest.mark.model

CHAT = "smollm2:135m"  # its ChatML template declares no tools
TOOLY = "tooly"  # the same weights under a template with tools: <tool_call> calls
NAMES = [api.name for api in APIS]


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(starter_store, tmp_path_factory.mktemp("conformance"), NUM_PARALLEL="2")
    create_model(d.store, CreateRequest(model=TOOLY, from_=CHAT, template=TEMPLATE))
    yield d
    d.shutdown()


def _runner_pid(d: Daemon, model: str = CHAT) -> int:
    pids = [m.runner.pid for m in d.scheduler.loaded.values()
            if m.runner is not None and m.record.name.display() == model]
    assert len(pids) == 1, pids
    return int(pids[0])


@pytest.mark.parametrize("api", APIS, ids=NAMES)
def test_tools_on_a_model_without_tools_are_refused(daemon: Daemon, api: Api) -> None:
    r = api.post(daemon.url, CHAT, tools=[weather_tool(api.name)])
    assert r.status_code == 400
    assert "does not support tools" in api.error_message(r)


@pytest.mark.parametrize("name,fields", BAD_VALUES,
                         ids=[f"{n}-{next(iter(f))}" for n, f in BAD_VALUES])
def test_bad_values_are_400_in_the_apis_shape(daemon: Daemon, name: str,
                                              fields: dict[str, Any]) -> None:
    api = BY_NAME[name]
    r = api.post(daemon.url, CHAT, **fields)
    assert r.status_code == 400, r.text
    assert next(iter(fields)) in api.error_message(r)  # the message names the field


@pytest.mark.parametrize("api", APIS, ids=NAMES)
def test_a_broken_model_is_a_status_before_the_stream(daemon: Daemon, api: Api,
                                                      chat_gguf: Path) -> None:
    # A sound copy of the weights (one byte more, so a blob of its own), made a model,
    # and then cut short on disk, as a failed copy or a full disk would leave it.
    digest = daemon.store.write_blob_bytes(chat_gguf.read_bytes() + b"\0")[0]
    create_model(daemon.store, CreateRequest(model="truncated", files={"t.gguf": digest}))
    blob = daemon.store.blob_path(digest)
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 3])
    with httpx.stream("POST", daemon.url + api.path, timeout=120,
                      json=api.body("truncated", "Hi", True, {})) as resp:
        resp.read()
        assert resp.status_code == 500, resp.text
        assert "llama runner process has terminated" in api.error_message(resp)


def test_a_full_queue_is_503_on_every_stream(starter_store: Store,
                                             daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(starter_store, NUM_PARALLEL="1", MAX_QUEUE="1")
    assert httpx.post(d.url + "/api/generate", json={"model": CHAT}, timeout=120).is_success
    stop = threading.Event()
    long = {"model": CHAT, "prompt": "Once upon a time", "raw": True,
            "options": {"num_predict": 4000, "ignore_eos": True}}

    def block() -> None:  # streams until told to stop, then hangs up (which cancels it)
        with httpx.stream("POST", d.url + "/api/generate", json=long, timeout=120) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    blockers = [threading.Thread(target=block, daemon=True) for _ in range(2)]
    inflight = lambda: sum(m.inflight for m in d.scheduler.loaded.values())  # noqa: E731
    try:
        for n, blocker in enumerate(blockers, start=1):
            blocker.start()  # the first holds the only slot, the second waits in the queue
            wait_for(lambda: inflight() == n)
        for api in APIS:
            with httpx.stream("POST", d.url + api.path, timeout=30,
                              json=api.body(CHAT, "Hi", True, {})) as resp:
                resp.read()
                assert resp.status_code == 503 and resp.headers.get("retry-after"), api.name
                assert "maximum pending requests exceeded" in api.error_message(resp)
    finally:
        stop.set()
        for blocker in blockers:
            blocker.join(timeout=60)


@pytest.mark.parametrize("api", APIS, ids=NAMES)
def test_a_failure_after_the_first_token_is_the_streams_own_error(daemon: Daemon,
                                                                  api: Api) -> None:
    # A grammar keeps the model writing: it cannot end before the runner is killed.
    body = api.body(CHAT, "Tell me a long story.", True,
                    {"max_tokens": 400, "grammar": 'root ::= "la "{200}'})
    with httpx.stream("POST", daemon.url + api.path, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        frames = api.frames(resp)
        next(frames)
        os.kill(_runner_pid(daemon), signal.SIGKILL)  # the runner dies mid-stream
        rest = list(frames)
    assert rest and api.is_error_frame(rest[-1]), rest[-3:]
    assert "crashed and is loaded again" in json.dumps(rest[-1])  # it says what happened
    again = api.post(daemon.url, CHAT, max_tokens=4)  # the next request reloads and works
    assert again.status_code == 200, again.text


@pytest.mark.parametrize("api", APIS, ids=NAMES)
def test_usage_counts_the_whole_prompt_and_the_cached_part(daemon: Daemon, api: Api) -> None:
    text = f"Name three colours of the rainbow, please, in order ({api.name})."
    first, second = (api.post(daemon.url, CHAT, text, max_tokens=4).json() for _ in range(2))
    whole, cached = _usage(api.name, first), _usage(api.name, second)
    if api.name == "native":  # Ollama reports only what it evaluated
        assert 0 < cached[0] < whole[0]
        return
    assert whole[0] == cached[0] > 0 and cached[1] > 0 and cached[1] < cached[0]


def _usage(api: str, body: dict[str, Any]) -> tuple[int, int]:
    """(whole prompt, cached part) as each API reports them."""
    if api == "native":
        return body["prompt_eval_count"], 0
    u = body["usage"]
    if api == "openai":
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if api == "anthropic":
        return (u["input_tokens"] + u["cache_read_input_tokens"],
                u["cache_read_input_tokens"])
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


NO_THINKING: dict[str, dict[str, Any]] = {  # TOOLY's template thinks unless told not to
    "openai": {"reasoning_effort": "none"}, "anthropic": {"thinking": {"type": "disabled"}},
    "responses": {"reasoning": {"effort": "none"}}}
FORCED = {"openai": ["required", {"type": "function", "function": {"name": "get_weather"}}],
          "anthropic": [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
          "responses": ["required", {"type": "function", "name": "get_weather"}]}


@pytest.mark.parametrize("api,choice", [(a, c) for a, cs in FORCED.items() for c in cs],
                         ids=[f"{a}-{i}" for a, cs in FORCED.items() for i in range(len(cs))])
def test_tool_choice_forces_a_call(daemon: Daemon, api: str, choice: Any) -> None:
    r = BY_NAME[api].post(daemon.url, TOOLY, "Hello there!", max_tokens=80,
                          tools=[weather_tool(api)], tool_choice=choice, **NO_THINKING[api])
    assert r.status_code == 200, r.text
    body = r.json()
    if api == "openai":
        calls = body["choices"][0]["message"]["tool_calls"]
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    elif api == "anthropic":
        assert body["stop_reason"] == "tool_use"
        assert [b["name"] for b in body["content"] if b["type"] == "tool_use"] == ["get_weather"]
    else:
        assert [i["name"] for i in body["output"] if i["type"] == "function_call"] == [
            "get_weather"]


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_tool_choice_none_and_unknown_names(daemon: Daemon, api: str) -> None:
    none = {"anthropic": {"type": "none"}}.get(api, "none")
    r = BY_NAME[api].post(daemon.url, TOOLY, "Hi", max_tokens=30, tools=[weather_tool(api)],
                          tool_choice=none, grammar='root ::= "<tool_call>{}</tool_call>"',
                          **NO_THINKING[api])
    assert r.status_code == 200 and "<tool_call>" in r.text  # no tools: it stays text
    bogus = {"openai": {"type": "function", "function": {"name": "nope"}},
             "anthropic": {"type": "tool", "name": "nope"},
             "responses": {"type": "function", "name": "nope"}}[api]
    r = BY_NAME[api].post(daemon.url, TOOLY, "Hi", tools=[weather_tool(api)],
                          tool_choice=bogus)
    assert r.status_code == 400 and "nope" in BY_NAME[api].error_message(r)


def test_forced_calls_through_the_official_clients(daemon: Daemon) -> None:
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    out = oai.chat.completions.create(
        model=TOOLY, messages=[{"role": "user", "content": "Hi"}], temperature=0,
        max_tokens=80, tools=[weather_tool("openai")],  # type: ignore[list-item]
        reasoning_effort="none",
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = out.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    ant = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    # Newer SDKs send temperature only as an extra body field; TOOLY's template would think.
    greedy = {"temperature": 0, "thinking": {"type": "disabled"}}
    msg = ant.messages.create(model=TOOLY, max_tokens=80, extra_body=greedy,
                              messages=[{"role": "user", "content": "Hi"}],
                              tools=[weather_tool("anthropic")],  # type: ignore[list-item]
                              tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use"
    with ant.messages.stream(model=TOOLY, max_tokens=80, extra_body=greedy,
                             messages=[{"role": "user", "content": "Hi"}],
                             tools=[weather_tool("anthropic")],  # type: ignore[list-item]
                             tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"]


def test_langchain_structured_output_on_chat_anthropic(daemon: Daemon) -> None:
    from langchain_anthropic import ChatAnthropic
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """Weather in a city."""

        city: str = Field(max_length=12)

    llm = ChatAnthropic(model=TOOLY, anthropic_api_url=daemon.url,  # type: ignore[call-arg]
                        anthropic_api_key="unused", max_tokens=80,  # type: ignore[arg-type]
                        temperature=0, max_retries=0, default_request_timeout=120)
    result = llm.with_structured_output(Weather).invoke("What is the weather in Paris?")
    assert isinstance(result, Weather) and result.city


def prompt_tokens_evaluated(d: Daemon) -> float:
    """The daemon's count of prompt tokens the runners evaluated for CHAT (/metrics)."""
    for line in httpx.get(d.url + "/metrics").text.splitlines():
        if line.startswith("corral_prompt_tokens_total{") and f'model="{CHAT}"' in line:
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_count_their_prompt_once(daemon: Daemon, path: str, stream: bool) -> None:
    def ask(n: int) -> tuple[list[int], dict[str, Any]]:
        """Each choice's index as it finished, and the usage."""
        body: dict[str, Any] = {"model": CHAT, "n": n, "seed": 7, "max_tokens": 6,
                                "stream": stream, "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path
                    else {"prompt": "Once upon a time"})
        if not stream:
            r = httpx.post(daemon.url + path, json=body, timeout=120).json()
            assert all(c["finish_reason"] in ("stop", "length") for c in r["choices"])
            return sorted(c["index"] for c in r["choices"]), r["usage"]
        with httpx.stream("POST", daemon.url + path, json=body, timeout=120) as resp:
            frames = list(BY_NAME["openai"].frames(resp))
        assert frames[-1] == "[DONE]"
        done = sorted(c["index"] for f in frames[:-2] for c in f["choices"] if c["finish_reason"])
        return done, frames[-2]["usage"]

    _, one = ask(1)
    indexes, two = ask(2)
    assert indexes == [0, 1] and two["completion_tokens"] >= 2
    # The usage counts the prompt once, as for one choice: OpenAI bills it once.
    assert two["prompt_tokens"] == one["prompt_tokens"]
    assert two["total_tokens"] == two["prompt_tokens"] + two["completion_tokens"]


def test_n_choices_evaluate_their_prompt_once(daemon: Daemon) -> None:
    # A prompt no slot holds a prefix of, long enough to be worth copying (32 tokens and
    # more, runner.engine.placer): the second choice branches from the first, or waits for
    # it to be computed, and prefills only the one token it must decode itself.
    prompt = "Quartz zebras juggle seventeen violet umbrellas beneath Kyoto's midnight tram. " * 8
    before = prompt_tokens_evaluated(daemon)
    r = httpx.post(daemon.url + "/v1/completions", timeout=120, json={
        "model": CHAT, "prompt": prompt, "n": 2, "max_tokens": 2, "seed": 7}).json()
    assert prompt_tokens_evaluated(daemon) - before <= r["usage"]["prompt_tokens"] + 1


def test_embedding_dimensions_on_v1(daemon: Daemon) -> None:
    full = httpx.post(daemon.url + "/v1/embeddings", timeout=120,
                      json={"model": CHAT, "input": "hello"}).json()["data"][0]["embedding"]
    cut = httpx.post(daemon.url + "/v1/embeddings", timeout=120,
                     json={"model": CHAT, "input": "hello", "dimensions": 8}).json()
    vector = cut["data"][0]["embedding"]
    assert len(full) > 8 and len(vector) == 8
    assert abs(sum(x * x for x in vector) - 1.0) < 1e-4  # normalised after the cut
