"""Every Jinja chat template llama.cpp ships for its tests (70 real models), rendered
through the daemon (POST /corral/render with the template in place of the model's), with
and without tools: each renders the conversation, and a tool-aware one the tool. Found
by it: `{% break %}` (Hugging Face's loop controls), `{% generation %}` (its training-mask
tag) and `tojson` of a generator, which Corral's sandbox refused."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import start_daemon

TEMPLATES = sorted((Path(__file__).parent / "peers" / "llama.cpp" / "templates").glob("*.jinja"))
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant"},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"},
                {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# What these templates expect is not what any client sends; each fails in Hugging Face's
# renderer too, with the same request.
NOT_RENDERED = {
    ("CohereForAI-c4ai-command-r-plus-tool_use", "plain"): "iterates `tools` unconditionally",
    ("CohereForAI-c4ai-command-r-plus-tool_use", "tools"):
        "wants Cohere's own tool shape (name, description, parameter_definitions)",
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "plain"): "iterates `tools` unconditionally",
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "plain"): "iterates `tools` unconditionally",
    ("fireworks-ai-llama-3-firefunction-v2", "plain"): "reads a `functions` variable of its own",
    ("fireworks-ai-llama-3-firefunction-v2", "tools"): "reads a `functions` variable of its own",
}


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(starter_store, tmp_path_factory.mktemp("model-templates"))
    yield d
    d.shutdown()


def test_seventy_templates() -> None:
    assert len(TEMPLATES) == 70


@pytest.mark.parametrize("mode", ["plain", "tools"])
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_renders_through_the_daemon(daemon: Daemon, template: Path, mode: str) -> None:
    body: dict[str, Any] = {"model": "smollm2:135m", "messages": CONVERSATION,
                            "chat_template": template.read_text(), "bos_token": "<s>",
                            "eos_token": "</s>", "think": False}
    if mode == "tools":
        body["tools"] = TOOLS
    r = httpx.post(daemon.url + "/corral/render", timeout=60, json=body)
    source = template.read_text()
    if mode == "tools" and not any(k in source for k in ("tools", "tool_call")):
        # A template that never mentions tools cannot take them: Ollama's 400.
        assert r.status_code == 400 and "does not support tools" in r.json()["error"]
        return
    if (template.stem, mode) in NOT_RENDERED:
        assert r.status_code == 400 and "template" in r.json()["error"]  # a 400, not a crash
        return
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "What is the weather in Paris?" in prompt
    if mode == "tools" and re.search(r"\btools\b", source):  # it lists the tools it gets
        assert "get_weather" in prompt
