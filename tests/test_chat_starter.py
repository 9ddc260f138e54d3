"""The chat starter end to end: its GGUF's ChatML template, system prompts, turn reuse, stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from corral.registry.gguf import inspect_gguf
from corral.server.chat.messages import Message
from corral.server.chat.prompt import PromptBuilder
from corral.server.daemon import Daemon

CHAT = "smollm2:135m"
GREEDY = {"temperature": 0, "seed": 1}


def chat(d: Daemon, messages: list[dict[str, str]], **options: Any) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/chat", timeout=120, json={
        "model": CHAT, "messages": messages, "stream": False, "options": {**GREEDY, **options}})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_gguf_template_renders_chatml(chat_gguf: Path) -> None:
    template = inspect_gguf(chat_gguf).chat_template
    builder = PromptBuilder(None, template, "<|im_start|>", "<|im_end|>")
    assert builder.kind == "jinja"
    text, _ = builder.chat([Message("system", "Be brief."), Message("user", "Hi")])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_show_reports_the_jinja_template(daemon: Daemon, chat_gguf: Path) -> None:
    shown = httpx.post(daemon.url + "/api/show", json={"model": CHAT}, timeout=30).json()
    assert shown["template"] == inspect_gguf(chat_gguf).chat_template
    assert shown["details"]["family"] == "llama" and "completion" in shown["capabilities"]


def test_system_prompt_reaches_the_model_as_chatml(daemon: Daemon) -> None:
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What colour is the sky?"}]
    via_chat = chat(daemon, messages, num_predict=12)
    raw = httpx.post(daemon.url + "/api/generate", timeout=120, json={
        "model": CHAT, "raw": True, "stream": False, "options": {**GREEDY, "num_predict": 12},
        "prompt": "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
                  "<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n"})
    assert via_chat["message"]["content"] == raw.json()["response"]
    assert via_chat["prompt_eval_count"] >= raw.json()["prompt_eval_count"] - 1


def test_second_turn_prefills_only_the_new_turn(daemon: Daemon) -> None:
    first = [{"role": "user", "content": "Name a fruit that is yellow."}]
    one = chat(daemon, first, num_predict=16)
    reply = one["message"]["content"]
    history = first + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": "And one that is red?"}]
    two = chat(daemon, history, num_predict=4)
    # The second prompt holds the whole first exchange, yet only the new turn is evaluated.
    assert two["prompt_eval_count"] < one["prompt_eval_count"]
    assert two["prompt_eval_count"] <= 24


def test_a_reply_ends_at_im_end(daemon: Daemon) -> None:
    out = chat(daemon, [{"role": "user", "content": "Say hello."}], num_predict=200)
    assert out["done_reason"] == "stop" and out["eval_count"] < 200
    assert "<|im_end|>" not in out["message"]["content"]
    assert "<|im_start|>" not in out["message"]["content"]
