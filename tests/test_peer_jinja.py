"""llama.cpp's Jinja chat-template cases (tests/peers/SOURCES.md), rendered through the
daemon as a user would read them: POST /corral/render with each case's template (and its
BOS and EOS text) in place of the model's. Templates that cannot show a system message
(Gemma's raises on the role, Phi-3's drops it) get its text at the head of the first
user message, as llama.cpp's chat layer gives it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from corral.registry.store import Store
from corral.server.daemon import Daemon
from tests.support import start_daemon

DATA = json.loads((Path(__file__).parent / "peers" / "llama.cpp" /
                   "chat_templates.json").read_text())


@pytest.fixture(scope="module")
def daemon(starter_store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(starter_store, tmp_path_factory.mktemp("jinja-peers"))
    yield d
    d.shutdown()


def test_the_peer_cases_are_all_here() -> None:
    assert len(DATA["cases"]) == 32


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: c["name"])
def test_render_matches_llama_cpp(daemon: Daemon, case: dict[str, Any]) -> None:
    r = httpx.post(daemon.url + "/corral/render", timeout=60, json={
        "model": "smollm2:135m", "messages": DATA["conversation"],
        "chat_template": case["template"], "bos_token": case["bos_token"],
        "eos_token": case["eos_token"]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == case["expected"]


def test_a_template_that_does_not_compile_is_a_400(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/corral/render", timeout=60, json={
        "model": "smollm2:135m", "messages": DATA["conversation"], "chat_template": "{% if"})
    assert r.status_code == 400 and "chat template" in r.json()["error"]
