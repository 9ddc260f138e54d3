"""Ollama's own golden renders (tests/peers/SOURCES.md), rendered through the daemon as a
user would: a model made with each template, and the prompt read back from
POST /corral/render, the Corral extension that shows what the runner is given."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from corral.registry.create import CreateRequest, create_model
from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import start_daemon

PEERS = Path(__file__).parent / "peers" / "ollama" / "template"
TEMPLATES = sorted(p.name for p in (PEERS / "testdata").iterdir())
# The three conversations of Ollama's template_test.go.
HELLO = {"role": "user", "content": "Hello, how are you?"}
CONVERSATIONS = {
    "user": [HELLO],
    "user-assistant-user": [
        HELLO, {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!"}],
}
CONVERSATIONS["system-user-assistant-user"] = [
    {"role": "system", "content": "You are a helpful assistant."},
    *CONVERSATIONS["user-assistant-user"]]


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(starter_store, tmp_path_factory.mktemp("peers"))
    for name in TEMPLATES:
        create_model(d.store, CreateRequest(model=_model(name), from_="smollm2:135m",
                                            template=(PEERS / name).read_text()))
    yield d
    d.shutdown()


def _model(template: str) -> str:
    return "peer-" + template.removesuffix(".gotmpl").replace(".", "-")


def test_there_are_twenty_peer_templates() -> None:
    assert len(TEMPLATES) == 20


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("scenario", list(CONVERSATIONS))
def test_render_matches_ollamas_golden(daemon: Daemon, template: str, scenario: str) -> None:
    golden = PEERS / "testdata" / template / scenario
    if not golden.exists():
        pytest.skip(f"Ollama has no {scenario} render for {template}")
    r = httpx.post(daemon.url + "/corral/render", timeout=60, json={
        "model": _model(template), "messages": CONVERSATIONS[scenario]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == golden.read_text()


def test_render_is_a_corral_route_and_refuses_what_chat_refuses(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/corral/render", timeout=60, json={
        "model": "smollm2:135m", "messages": [HELLO], "think": True})
    assert r.status_code == 400 and "does not support thinking" in r.json()["error"]
    plain = httpx.post(daemon.url + "/api/chat", timeout=60, json={
        "model": _model(TEMPLATES[0]), "messages": [], "stream": False}).json()
    assert "prompt" not in plain  # nothing of it on the Ollama-shaped routes
