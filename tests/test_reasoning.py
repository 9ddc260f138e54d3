"""Thinking and streamed tool calls with the real chat starter.

SmolLM2 neither thinks nor calls tools, so a model made from it gets a template that
declares both, and a GBNF `grammar` (a Corral extension, as in llama-server) makes the
real model write the exact shape; the streaming parsers then run on real tokens."""

from __future__ import annotations

import json
import math
from typing import Any, Iterator

import httpx
import ollama
import openai
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from corral.server.dialects.openai import think_of_effort
from tests.family_templates import CALLS, CITY as CITY_RULE, GPT_OSS

pytestmark = pytest.mark.model

CHAT = "smollm2:135m"
THINKER = "thinker"
TEMPLATE = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- if .Tools }}<|im_start|>system
Tools:{{ range .Tools }} {{ .Function.Name }}{{ end }}. Call one as <tool_call>{}</tool_call><|im_end|>
{{ end }}
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ if eq .Role "tool" }}[{{ .ToolName }} {{ .ToolCallID }}] {{ end }}{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ if .Think }}<think>{{ end }}"""
# The prompt ends inside <think> when thinking is on: the model closes it.
THOUGHT = 'root ::= [a-z]{3,8} " " [a-z]{3,8} "</think>" [A-Z] [a-z]{2,8} "."'
CALL = ('root ::= "Checking. <tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": '
        '{\\"city\\": \\"" [A-Z] [a-z]{2,6} "\\"}}</tool_call>"')
BROKEN = 'root ::= "<tool_call>not json at all</tool_call>"'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
GREEDY = {"temperature": 0, "seed": 3, "num_predict": 60}
HARMONY = "harmonious"
LONG = {**GREEDY, "num_predict": 200}  # harmony markers are many tokens to a small model
HARMONY_REPLY = CALLS["gpt-oss"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from tests.support import start_daemon

    d = start_daemon(starter_store, tmp_path_factory.mktemp("reasoning"), NUM_PARALLEL="2")
    ollama.Client(host=d.url).create(model=THINKER, from_=CHAT, template=TEMPLATE,
                                     parameters={"temperature": 0, "num_predict": 40})
    ollama.Client(host=d.url).create(model=HARMONY, from_=CHAT, template=GPT_OSS)
    yield d
    d.shutdown()


def chat_lines(d: Daemon, **body: Any) -> list[dict[str, Any]]:
    # THINKER's template thinks unless told not to (Ollama's default): off unless asked.
    with httpx.stream("POST", d.url + "/api/chat", timeout=120, json={
            "model": THINKER, "messages": ASK, "options": GREEDY, "think": False,
            **body}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line) for line in resp.iter_lines()]


def recording_client(d: Daemon) -> tuple[list[dict[str, Any]], ollama.Client]:
    """The official client, and the JSON bodies it sends (its httpx client's hook)."""
    sent: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content or b"{}"))
    return sent, ollama.Client(host=d.url, event_hooks={"request": [record]})


def render(d: Daemon, body: dict[str, Any]) -> dict[str, Any]:
    """The prompt the daemon renders for a request body (POST /corral/render)."""
    r = httpx.post(d.url + "/corral/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_thinking_streams_apart_from_the_answer(daemon: Daemon) -> None:
    lines = chat_lines(daemon, think=True, grammar=THOUGHT)
    kinds = [("thinking" if m["message"].get("thinking") else "content")
             for m in lines[:-1] if m["message"].get("thinking") or m["message"]["content"]]
    assert kinds and kinds[0] == "thinking" and "content" in kinds
    assert kinds == sorted(kinds, key=lambda k: k != "thinking")  # thinking first, then answer
    thinking = "".join(m["message"].get("thinking", "") for m in lines)
    content = "".join(m["message"]["content"] for m in lines)
    assert thinking.count(" ") == 1 and "<" not in thinking
    assert content.endswith(".") and "think>" not in content
    whole = httpx.post(daemon.url + "/api/chat", timeout=120, json={
        "model": THINKER, "messages": ASK, "options": GREEDY, "think": True,
        "grammar": THOUGHT, "stream": False}).json()
    assert whole["message"]["thinking"] == thinking and whole["message"]["content"] == content
    sent, client = recording_client(daemon)
    generated = client.generate(model=THINKER, prompt="Weather?", think="medium", options=GREEDY)
    # The official client sends the level, and it reaches the template as .Think: the
    # prompt the daemon renders for that very body opens <think>.
    assert sent[-1]["think"] == "medium" and generated.done
    shown = render(daemon, sent[-1])
    assert shown["prompt"].endswith("<|im_start|>assistant\n<think>") and shown["thinking_open"]


def test_generate_splits_thinking_too(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=120, json={
        "model": THINKER, "prompt": "Weather?", "think": True, "grammar": THOUGHT,
        "stream": False, "options": GREEDY}).json()
    assert r["thinking"] and r["response"].endswith(".") and "think>" not in r["response"]


def test_think_refusals(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": CHAT, "messages": ASK, "think": True})
    assert r.status_code == 400 and r.json()["error"] == f'"{CHAT}" does not support thinking'
    r = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": THINKER, "messages": ASK, "think": "extreme"})
    assert r.status_code == 400 and "invalid think value" in r.json()["error"]
    assert '"max"' in r.json()["error"]  # the message lists every level
    off = chat_lines(daemon, think=False, grammar='root ::= "Sunny" " today."')
    assert "".join(m["message"]["content"] for m in off) == "Sunny today."
    assert not any(m["message"].get("thinking") for m in off)


def test_tool_call_streams_as_soon_as_it_is_complete(daemon: Daemon) -> None:
    lines = chat_lines(daemon, tools=TOOLS, grammar=CALL)
    calls = [i for i, m in enumerate(lines) if m["message"].get("tool_calls")]
    text = [i for i, m in enumerate(lines) if m["message"]["content"]]
    assert len(calls) == 1 and text and max(text) < calls[0] < len(lines) - 1
    assert "".join(lines[i]["message"]["content"] for i in text) == "Checking. "
    [call] = lines[calls[0]]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["function"]["arguments"]) == {"city"}
    assert lines[-1]["done"] is True
    sent, client = recording_client(daemon)
    reply = client.chat(model=THINKER, messages=ASK, tools=TOOLS, options=GREEDY)
    # The official client's tools reach the template, and its typed reply reads ours.
    assert [t["function"]["name"] for t in sent[-1]["tools"]] == ["get_weather"]
    shown = render(daemon, sent[-1])
    assert shown["tools"] == ["get_weather"] and "Tools: get_weather." in shown["prompt"]
    assert reply.done and reply.message.role == "assistant"


def test_malformed_call_text_is_content(daemon: Daemon) -> None:
    lines = chat_lines(daemon, tools=TOOLS, grammar=BROKEN)
    assert "".join(m["message"]["content"] for m in lines) == \
        "<tool_call>not json at all</tool_call>"
    assert not any(m["message"].get("tool_calls") for m in lines)


def test_openai_deltas_carry_reasoning_and_call_pieces(daemon: Daemon) -> None:
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    stream = oai.chat.completions.create(model=THINKER, messages=ASK, stream=True, tools=TOOLS,
                                         temperature=0, seed=3, max_tokens=60,
                                         reasoning_effort="none", extra_body={"grammar": CALL})
    deltas = [c.choices[0] for c in stream if c.choices]
    [call] = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert call.index == 0 and call.id and call.type == "function"
    assert call.function is not None and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments or "")) == {"city"}
    assert deltas[-1].finish_reason == "tool_calls"
    thought = oai.chat.completions.create(model=THINKER, messages=ASK, temperature=0, seed=3,
                                          max_tokens=60, reasoning_effort="low",
                                          extra_body={"grammar": THOUGHT})
    message = thought.choices[0].message
    assert (message.model_extra or {}).get("reasoning") and message.content
    assert "think>" not in message.content
    bad = httpx.post(daemon.url + "/v1/chat/completions", timeout=60, json={
        "model": THINKER, "messages": ASK, "reasoning_effort": "ultra"})
    assert bad.status_code == 400 and "invalid reasoning value" in bad.json()["error"]["message"]


def test_max_is_the_highest_level_a_template_knows(daemon: Daemon) -> None:
    # Ollama's newest level: a template that knows levels (gpt-oss's) is told "high".
    shown = render(daemon, {"model": HARMONY, "messages": ASK, "think": "max"})
    assert shown["think"] == "high" and "Reasoning: high" in shown["prompt"]
    assert think_of_effort("max") == "high" and think_of_effort("none") is False
    for effort in ("max", "none"):
        r = httpx.post(daemon.url + "/v1/chat/completions", timeout=60, json={
            "model": HARMONY, "messages": ASK, "reasoning_effort": effort, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_tool_call_id_names_the_tool_for_the_template(daemon: Daemon) -> None:
    turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]

    def prompt_tokens(call_id: str) -> int:
        r = httpx.post(daemon.url + "/v1/chat/completions", timeout=60, json={
            "model": THINKER, "max_tokens": 1, "temperature": 0, "messages": [
                *turn, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    # The template prints "[<tool name> <call id>]": an id that names no call leaves the
    # name empty, so the prompt is shorter by the name's tokens and the id's.
    assert prompt_tokens("call_abc123") > prompt_tokens("x")


def test_logprobs_on_every_api(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=120, json={
        "model": CHAT, "prompt": "The capital of France is", "raw": True, "stream": False,
        "logprobs": True, "top_logprobs": 3, "options": {**GREEDY, "num_predict": 8}}).json()
    entries = r["logprobs"]
    assert "".join(e["token"] for e in entries) == r["response"] and len(entries) == 8
    for e in entries:  # greedy: the chosen token is the most likely one, from the same logits
        tops = e["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == e["token"]
        assert abs(tops[0]["logprob"] - e["logprob"]) < 1e-6 and e["logprob"] <= 0
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert 0 < sum(math.exp(t["logprob"]) for t in tops) <= 1 + 1e-6  # a distribution's
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    streamed = chat_lines(daemon, logprobs=True, top_logprobs=1,
                          options={**GREEDY, "num_predict": 6})
    tokens = [e for m in streamed for e in m.get("logprobs", [])]
    assert "".join(e["token"] for e in tokens) == "".join(m["message"]["content"]
                                                          for m in streamed)
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    chat = oai.chat.completions.create(model=CHAT, messages=ASK, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 for c in content)
    legacy = oai.completions.create(model=CHAT, prompt="The capital of France is",
                                    temperature=0, max_tokens=5, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == legacy.choices[0].text
    assert len(lp.token_logprobs or []) == 5
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs or [])
    bad = httpx.post(daemon.url + "/api/generate", timeout=60, json={
        "model": CHAT, "prompt": "x", "logprobs": True, "top_logprobs": 21})
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]


def test_harmony_channels(daemon: Daemon) -> None:
    lines = []
    with httpx.stream("POST", daemon.url + "/api/chat", timeout=120, json={
            "model": HARMONY, "messages": ASK, "tools": TOOLS, "options": LONG,
            "grammar": HARMONY_REPLY}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [json.loads(line) for line in resp.iter_lines()]
    thinking = "".join(m["message"].get("thinking", "") for m in lines)
    calls = [c for m in lines for c in m["message"].get("tool_calls", [])]
    assert thinking.isalpha() and "".join(m["message"]["content"] for m in lines) == ""
    [call] = calls
    assert call["function"]["name"] == "get_weather"
    assert set(call["function"]["arguments"]) == {"city"}


def test_cli_thinking_piped(daemon: Daemon) -> None:
    import os
    import subprocess
    import sys

    host, port = daemon.address
    env = dict(os.environ, CORRAL_HOST=f"{host}:{port}")
    cli = [sys.executable, "-c", "from corral.cli.launch import main; main()", "run", THINKER]

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *flags, "Hi"], capture_output=True, text=True, env=env,
                              timeout=120, input="")

    shown = run("--think")  # piped: thinking only because it was asked for
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Thinking...\n") and "\x1b[" not in shown.stdout
    hidden = run("--think", "--hidethinking")
    assert hidden.returncode == 0 and "Thinking..." not in hidden.stdout
    bad = run("--think=loud")
    assert bad.returncode == 1 and bad.stderr.startswith("Error: invalid value for --think")


def test_grammar_refusals(daemon: Daemon) -> None:
    both = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": THINKER, "messages": ASK, "grammar": 'root ::= "x"', "format": "json"})
    assert both.status_code == 400 and "not both" in both.json()["error"]
    huge = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": THINKER, "messages": ASK, "grammar": 'root ::= "' + "x" * 70000 + '"'})
    assert huge.status_code == 400 and "CORRAL_MAX_GRAMMAR_BYTES" in huge.json()["error"]
    ok = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": THINKER, "messages": ASK, "grammar": "root ::= [a-z", "stream": False})
    assert ok.status_code == 400 and "invalid grammar" in ok.json()["error"]


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "mistral", "gpt-oss"])
def test_each_familys_call_syntax_through_the_ollama_client(daemon: Daemon, family: str) -> None:
    from tests.family_templates import TEMPLATES, THINKS

    client = ollama.Client(host=daemon.url)
    name = f"family-{family.replace('.', '-')}"
    client.create(model=name, from_=CHAT, template=TEMPLATES[family])
    parts = list(client.chat(model=name, messages=ASK, tools=TOOLS, stream=True,
                             think=THINKS[family],
                             options={**LONG, "grammar": CALLS[family]}))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    [call] = calls
    assert call.function.name == "get_weather" and set(call.function.arguments) == {"city"}
    thinking = "".join(p.message.thinking or "" for p in parts)
    assert bool(thinking) == (family in ("qwen3", "gpt-oss"))
    assert "".join(p.message.content for p in parts).strip() == ""
    turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]
    answer = client.chat(model=name, messages=turn, tools=TOOLS, options={**GREEDY,
                                                                          "num_predict": 4})
    assert answer.done and answer.message.role == "assistant"


def test_cli_thinking_on_a_terminal(daemon: Daemon, tmp_path: Any) -> None:
    import os
    import sys

    import pexpect

    host, port = daemon.address
    env = dict(os.environ, CORRAL_HOST=f"{host}:{port}", XDG_STATE_HOME=str(tmp_path))
    env.pop("NO_COLOR", None)
    cli = ["-c", "from corral.cli.launch import main; main()", "run", THINKER]
    once = pexpect.spawn(sys.executable, [*cli, "--think", "Hi"], env=env, encoding="utf-8",
                         timeout=120, dimensions=(40, 100))
    once.expect(pexpect.EOF)
    once.close()
    assert once.exitstatus == 0
    assert "\x1b[2mThinking...\n" in once.before.replace("\r\n", "\n")  # dimmed, first
    repl = pexpect.spawn(sys.executable, cli, env=env, encoding="utf-8", timeout=120,
                         dimensions=(40, 100))
    repl.expect(">>> ")
    repl.sendline("/set think high")
    repl.expect("Set 'think' mode.")
    repl.expect(">>> ")
    repl.sendline("/set nothink")
    repl.expect("Set 'nothink' mode.")
    repl.expect(">>> ")
    repl.sendline("/bye")
    repl.expect(pexpect.EOF)


def test_no_think_sent_means_a_thinking_model_thinks(daemon: Daemon) -> None:
    """Ollama's default (Hugging Face's templates mostly agree): on for a model whose
    template can think, untouched for one that cannot; an explicit value always wins."""
    def rendered(model: str, **extra: Any) -> dict[str, Any]:
        r = httpx.post(daemon.url + "/corral/render", timeout=60,
                       json={"model": model, "messages": ASK, **extra})
        assert r.status_code == 200, r.text
        return dict(r.json())

    default = rendered(THINKER)
    assert default["think"] is True and default["thinking_open"]
    assert default["prompt"].endswith("<think>")
    off = rendered(THINKER, think=False)
    assert off["think"] is False and not off["prompt"].endswith("<think>")
    assert rendered(CHAT)["think"] is None  # the chat starter cannot think


EDGES = {  # (family, forced reply, calls expected, text that must not be content)
    "mistral-close": ("mistral", 'root ::= "[TOOL_CALLS][{\\"name\\": \\"get_weather\\", '
                      '\\"arguments\\": {" ' + CITY_RULE + ' "}}][/TOOL_CALLS]"', 1, "[/TOOL_CALLS]"),
    "qwen-unclosed": ("qwen3", 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", '
                      '\\"arguments\\": {" ' + CITY_RULE + ' "}}\\n</tool_call><tool_call>{\\"name\\": '
                      '\\"get_weather\\", \\"arguments\\": {" ' + CITY_RULE + ' "}}"', 2, "<tool_call>"),
    "llama-later-json": ("llama3.1", 'root ::= "{\\"name\\": \\"jeff\\"}{\\"name\\": \\"get_weather'
                         '\\", \\"parameters\\": {" ' + CITY_RULE + ' "}}"', 0, None),
}


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("api", ["native", "v1"])
def test_ollamas_edge_cases_on_real_tokens(daemon: Daemon, edge: str, api: str) -> None:
    """The parser's edge cases where Corral now follows Ollama, on real tokens forced by a
    grammar, streamed (native) and whole (/v1)."""
    from tests.family_templates import TEMPLATES

    family, grammar, n_calls, never = EDGES[edge]
    name = f"edge-{family.replace('.', '-')}"
    ollama.Client(host=daemon.url).create(model=name, from_=CHAT, template=TEMPLATES[family])
    if api == "native":
        lines = chat_lines(daemon, model=name, tools=TOOLS, grammar=grammar, options=LONG)
        calls = [c for m in lines for c in m["message"].get("tool_calls") or []]
        content = "".join(m["message"]["content"] for m in lines)
    else:
        r = httpx.post(daemon.url + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": ASK, "tools": TOOLS, "grammar": grammar,
            "reasoning_effort": "none", "temperature": 0, "max_tokens": 200}).json()
        message = r["choices"][0]["message"]
        calls, content = message.get("tool_calls") or [], message["content"] or ""
    assert len(calls) == n_calls, (content, calls)
    if never is not None:
        assert never not in content
    if n_calls == 0:
        assert content.startswith('{"name": "jeff"}') and "get_weather" in content
