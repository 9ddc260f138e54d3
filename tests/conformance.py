"""The four APIs side by side, for the conformance suite: how each is asked, how each
streams, and what its error looks like. Raw HTTP, so the shapes are checked as sent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    # (model, user text, stream, extra fields) -> body
    body: Callable[[str, str, bool, dict[str, Any]], dict[str, Any]]
    sse: bool  # server-sent events, or NDJSON lines (native)

    def post(self, url: str, model: str, prompt: str = "Hi", stream: bool = False,
             timeout: float = 120, **extra: Any) -> httpx.Response:
        return httpx.post(url + self.path, json=self.body(model, prompt, stream, extra),
                          timeout=timeout)

    def error_message(self, resp: httpx.Response) -> str:
        """The message of an error response, checked against this API's shape."""
        body = resp.json()
        if self.name == "native":
            assert set(body) == {"error"} and isinstance(body["error"], str), body
            return str(body["error"])
        if self.name == "anthropic":
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            return str(body["error"]["message"])
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
        return str(body["error"]["message"])

    def frames(self, resp: httpx.Response) -> Iterator[Any]:
        """Each streamed event's JSON (`[DONE]` as the string), in order."""
        for line in resp.iter_lines():
            if not line:
                continue
            if not self.sse:
                yield json.loads(line)
            elif line.startswith("data: "):
                yield line[6:] if line == "data: [DONE]" else json.loads(line[6:])

    def is_error_frame(self, frame: Any) -> bool:
        if not isinstance(frame, dict):
            return False
        if self.name == "native":
            return set(frame) == {"error"}
        if self.name == "anthropic":
            return frame.get("type") == "error" and "message" in frame.get("error", {})
        if self.name == "responses":
            return frame.get("type") == "error" and bool(frame.get("message"))
        return "error" in frame and "message" in frame["error"]


def _native(model: str, text: str, stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
    options = {"temperature": 0, "num_predict": extra.pop("max_tokens", 40),
               **extra.pop("options", {})}
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream,
            "options": options, **extra}


def _chat(model: str, text: str, stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream,
            "temperature": 0, "max_tokens": 40, **extra}


def _anthropic(model: str, text: str, stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream,
            "temperature": 0, "max_tokens": 40, **extra}


def _responses(model: str, text: str, stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
    if "max_tokens" in extra:
        extra["max_output_tokens"] = extra.pop("max_tokens")
    return {"model": model, "input": text, "stream": stream, "temperature": 0,
            "max_output_tokens": 40, **extra}


APIS = [Api("native", "/api/chat", _native, sse=False),
        Api("openai", "/v1/chat/completions", _chat, sse=True),
        Api("anthropic", "/v1/messages", _anthropic, sse=True),
        Api("responses", "/v1/responses", _responses, sse=True)]
BY_NAME = {api.name: api for api in APIS}

# Values each API's documentation refuses; every one must be a 400 in that API's shape.
BAD_VALUES: list[tuple[str, dict[str, Any]]] = [
    ("native", {"logprobs": "yes"}),
    ("native", {"logprobs": 3}),
    ("native", {"stream": "yes"}),
    ("native", {"top_logprobs": 21}),
    ("native", {"think": "maybe"}),
    ("openai", {"stream": "yes"}),
    ("openai", {"temperature": 5}),
    ("openai", {"n": 0}),
    ("openai", {"max_tokens": -1}),
    ("openai", {"tool_choice": "bogus"}),
    ("openai", {"response_format": {"type": "bogus"}}),
    ("openai", {"stop": 3}),
    ("anthropic", {"stream": "yes"}),
    ("anthropic", {"stop_sequences": "x"}),
    ("anthropic", {"temperature": 99}),
    ("anthropic", {"tool_choice": {"type": "bogus"}}),
    ("anthropic", {"thinking": {"type": "maybe"}}),
    ("anthropic", {"max_tokens": 0}),
    ("responses", {"max_output_tokens": -1}),
    ("responses", {"max_output_tokens": 0}),
    ("responses", {"stream": "yes"}),
    ("responses", {"instructions": {"text": "be brief"}}),
    ("responses", {"text": {"format": {"type": "bogus"}}}),
    ("responses", {"tool_choice": {"type": "function"}}),
]


def weather_tool(api: str) -> dict[str, Any]:
    """The same tool in each API's shape; a bounded city keeps a forced call short."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    if api == "anthropic":
        return {"name": "get_weather", "description": "Weather in a city",
                "input_schema": schema}
    if api == "responses":
        return {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": schema}
    return {"type": "function", "function": {"name": "get_weather",
                                             "description": "Weather in a city",
                                             "parameters": schema}}
