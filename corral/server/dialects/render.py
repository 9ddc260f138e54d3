"""POST /corral/render: the prompt a request would give the model, for every API's body.

A Corral extension, never part of an Ollama-shaped answer, as llama-server's
/apply-template is: a template mismatch, or where an image or a clip lands in the
prompt, can be read instead of inferred. It takes an /api/chat or /api/generate body,
an OpenAI chat body, an Anthropic messages body or a Responses body (`api` names which;
left out, the body's shape tells), and answers what the runner would tokenize.
`chat_template` (with `bos_token`, `eos_token`) tries a Jinja template in place of the
model's.
"""

from __future__ import annotations

from typing import Any, Callable

from corral.api.wire import parse
from corral.api.wire.anthropic import MessagesRequest
from corral.api.wire.manage import RenderExtras
from corral.api.wire.native import ChatRequest, GenerateRequest
from corral.api.wire.openai import ChatCompletionRequest
from corral.api.wire.responses import ResponsesRequest
from corral.server.dialects import anthropic, native, openai, responses
from corral.server.http import Handler, Request
from corral.server.pipeline.request import Task
from corral.server.pipeline.services import Services

# Block and part types only one API has: a body holding one is that API's.
_ANTHROPIC = {"image", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _api(body: dict[str, Any]) -> str:
    if "input" in body:
        return "responses"
    if "messages" not in body:
        return "ollama"  # /api/generate's
    if "system" in body:
        return "anthropic"
    kinds = {part.get("type") for m in body["messages"] if isinstance(m, dict)
             and isinstance(m.get("content"), list) for part in m["content"]
             if isinstance(part, dict)}
    if kinds & _ANTHROPIC:
        return "anthropic"
    return "openai" if kinds else "ollama"


def task_of(body: dict[str, Any], api: str | None) -> Task:
    """The request as its own route would read it."""
    api = api or _api(body)
    if api == "responses":
        return responses.parse_responses(parse(ResponsesRequest, body))
    if api == "anthropic":
        return anthropic.parse_messages(parse(MessagesRequest, {"max_tokens": 1, **body}))
    if api == "openai":
        return openai.parse_chat(parse(ChatCompletionRequest, body))
    if "messages" in body:
        return native.parse_chat(parse(ChatRequest, body))
    return native.parse_generate(parse(GenerateRequest, body))


def render(services: Services) -> Callable[[Request, Handler], None]:
    from corral.server.pipeline.run import render_only

    def route(req: Request, handler: Handler) -> None:
        body = req.json()
        extras = parse(RenderExtras, body)
        handler.send_json(200, render_only(services, task_of(body, extras.api),
                                           extras.chat_template or None,
                                           extras.bos_token or "", extras.eos_token or ""))
    return route
