"""llama.cpp's Jinja chat-template cases (tests/peers/SOURCES.md) through Corral's
prompt builder, the one the daemon renders with: the same conversation, the same BOS
and EOS text, the same prompt. Templates that cannot show a system message (Gemma's
raises on the role, Phi-3's drops it) get its text at the head of the first user
message, as llama.cpp's chat layer gives it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from corral.server.prompt import PromptBuilder

DATA = json.loads((Path(__file__).parent / "peers" / "llama.cpp" /
                   "chat_templates.json").read_text())


def test_the_peer_cases_are_all_here() -> None:
    assert len(DATA["cases"]) == 32


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: c["name"])
def test_render_matches_llama_cpp(case: dict[str, Any]) -> None:
    builder = PromptBuilder(None, case["template"], case["bos_token"], case["eos_token"])
    text, _ = builder.chat(DATA["conversation"])
    assert text == case["expected"]
