"""Qwen-VL images (M-RoPE) in the runner: the tiny random Qwen2-VL, Qwen2.5-VL and
Qwen3-VL pairs of tests/qwen_vl_model.py, against llama-server's own answers.

An image of nx x ny tokens takes max(nx, ny) positions on M-RoPE's grid, and the text
after it continues there; the engine keeps positions apart from token counts in its
batches, its image slices, its prefix reuse and its speculative trims. The greedy ids
are the ones llama-server (--mmproj) answered the same request with on the same files
(tests/test_qwen_vl_model.py pins them, and that llama.cpp's mtmd_helper_eval_chunks
gives the same); the engine must give them alone, fed in slices, with three text
streams decoding beside it, and after a follow-up reuses the image's cached tokens.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Iterator

import llama_cpp as L
import pytest

from corral.runner.process.service import RunnerService
from corral.runner.wire import MARKER, CompletionJob
from tests.qwen_vl_model import KINDS
from tests.test_qwen_vl_model import GREEDY, IMAGE_SEED, PROMPT, SIZE, pair_files  # noqa: F401
from tests.test_qwen_vl_model import MARKER as MTMD_MARKER
from tests.support import wait_for
from tests.test_vision import chat, collect, serve, submit
from tests.vision_model import png_bytes

pytestmark = pytest.mark.model

N = len(GREEDY["qwen2vl_merger"])
# llama-server's answer on the Qwen2-VL pair with the image in front of "What is this?"
LLAMA_SERVER_BEFORE = "aji lapse\ufffd traded ureth Hazards granted Weber"


@pytest.fixture(scope="module")
def files(pair_files: dict[str, Path]) -> dict[str, Path]:
    """The Qwen-VL pair's text models and projectors (tests/test_qwen_vl_model.py)."""
    return pair_files


@pytest.fixture(scope="module", params=KINDS)
def seeing(request: pytest.FixtureRequest, files: dict[str, Path]
           ) -> Iterator[tuple[str, RunnerService]]:
    kind = request.param
    text = files["qwen3vl" if kind == "qwen3vl_merger" else "qwen2vl"]
    service = serve(text, files[kind], n_slots=4, num_ctx=256, deterministic=True)
    yield kind, service
    service.engine.stop()


def image(kind: str, **colour: Any) -> str:
    return base64.b64encode(png_bytes(*SIZE[kind], seed=IMAGE_SEED, **colour)).decode()


def ask(kind: str, prompt: str = PROMPT, **options: Any) -> dict[str, Any]:
    """llama-server's rendering of the request, the image at its media marker."""
    return {"prompt": prompt.replace(MTMD_MARKER, MARKER), "return_context": True,
            "images": [image(kind)], "add_bos": True, "options": {
                "temperature": 0, "seed": 1, "num_predict": N, **options}}


def reply_ids(service: RunnerService, body: dict[str, Any]) -> tuple[list[int], Any]:
    text, stats = collect(service.job(CompletionJob.from_json(body)))
    return list(stats.context[-N:]), stats


def clear(service: RunnerService) -> None:
    for slot in service.engine.slots:  # nothing cached helps anyone this time
        slot.cached = []
        L.llama_memory_seq_rm(service.engine.llama.mem, slot.seq_id, -1, -1)


def test_an_image_answers_as_llama_server_does(seeing: tuple[str, RunnerService]) -> None:
    kind, service = seeing
    clear(service)
    ids, stats = reply_ids(service, ask(kind))
    assert ids == GREEDY[kind]
    assert stats.prompt_tokens == 52 and stats.eval_count == N  # tokens, not positions
    slot = next(s for s in service.engine.slots if s.cached)
    # The KV's last position: 29 text tokens, the image's 8 positions, 7 text tokens and
    # the answer but its last token: its tokens counted 16, its positions 8.
    assert L.llama_memory_seq_pos_max(service.engine.llama.mem, slot.seq_id) == \
        29 + 8 + 7 + N - 2
    assert len(slot.cached) == 52 + N - 1


def test_beside_three_text_streams_and_in_slices(seeing: tuple[str, RunnerService]) -> None:
    kind, service = seeing
    clear(service)
    prompts = ["The capital of France is", "Write a haiku about rain.", "Count to five:"]
    texts = [submit(service, chat([], p), num_predict=12) for p in prompts]
    job = service.job(CompletionJob.from_json(ask(kind)))
    assert all(collect(t)[1].eval_count for t in texts)
    assert list(collect(job)[1].context[-N:]) == GREEDY[kind]


def test_a_follow_up_reuses_the_image(seeing: tuple[str, RunnerService]) -> None:
    kind, service = seeing
    clear(service)
    first, _ = reply_ids(service, ask(kind))
    follow_prompt = PROMPT + "A red square.<|im_end|>\n<|im_start|>user\nAnd its colour?" \
        "<|im_end|>\n<|im_start|>assistant\n"
    encoded = service.vision.encoded if service.vision else -1
    _, follow = reply_ids(service, ask(kind, follow_prompt))
    assert follow.prompt_eval_count < follow.prompt_tokens - 16  # the image was not decoded
    assert service.vision is not None and service.vision.encoded == encoded
    clear(service)
    _, cold = reply_ids(service, ask(kind, follow_prompt))
    assert cold.prompt_eval_count == cold.prompt_tokens
    assert cold.context[-N:] == follow.context[-N:]  # reused cells answer as fresh ones


def test_a_full_context_ends_with_length(files: dict[str, Path]) -> None:
    # M-RoPE KV cannot shift (llama.cpp's get_can_shift): a full context ends the reply.
    service = serve(files["qwen2vl"], files["qwen2vl_merger"], n_slots=1, num_ctx=64,
                    deterministic=True)
    try:
        assert not service.engine.llama.can_shift
        text, stats = collect(service.job(CompletionJob.from_json(
            ask("qwen2vl_merger", num_predict=-1))))
        assert stats.done_reason == "length"
        assert stats.prompt_tokens + stats.eval_count <= 64 + 1
    finally:
        service.engine.stop()


def test_fed_in_slices_it_answers_as_whole(files: dict[str, Path]) -> None:
    # num_batch 8: the image's 16 tokens go in two slices of 8, between other steps
    service = serve(files["qwen2vl"], files["qwen2vl_merger"], n_slots=1, num_ctx=256,
                    n_batch=8, deterministic=True)
    try:
        ids, _ = reply_ids(service, ask("qwen2vl_merger"))
        assert ids == GREEDY["qwen2vl_merger"]
        assert service.engine.steps >= 29 // 8 + 2 + N
    finally:
        service.engine.stop()


def test_the_ollama_client_sends_an_image_to_a_qwen_vl_model(
        starter_store: Any, files: dict[str, Path], daemon_factory: Any) -> None:
    import httpx
    import ollama

    d = daemon_factory(starter_store, NUM_PARALLEL="1", CACHE_RAM="64MiB", CACHE_DISK="64MiB",
                       DETERMINISTIC="1")
    client = ollama.Client(host=d.url)
    blobs = {"qwen2vl.gguf": client.create_blob(files["qwen2vl"]),
             "mmproj.gguf": client.create_blob(files["qwen2vl_merger"])}
    assert client.create(model="qwen-vl-tiny", files=blobs).status == "success"
    assert "vision" in (client.show("qwen-vl-tiny").capabilities or [])
    picture = base64.b64decode(image("qwen2vl_merger"))
    # Ollama's "[img]" puts the image where llama-server put it: after the question
    first = [{"role": "user", "content": "What is this?[img]", "images": [picture]}]
    greedy = {"temperature": 0, "num_predict": N}
    reply = client.chat(model="qwen-vl-tiny", options=greedy, messages=first)
    assert reply.message.content == detokenize(d.url, "qwen-vl-tiny", GREEDY["qwen2vl_merger"])
    assert reply.eval_count == N
    # OpenAI's parts put the image where each stands: llama-server's answers to both
    # orders on the same files (/v1/chat/completions, --temp 0; recorded 2026-12-05).
    url = "data:image/png;base64," + image("qwen2vl_merger")
    part, text = {"type": "image_url", "image_url": {"url": url}}, {"type": "text",
                                                                    "text": "What is this?"}
    for content, said in (([text, part], reply.message.content),
                          ([part, text], LLAMA_SERVER_BEFORE)):
        r = httpx.post(d.url + "/v1/chat/completions", timeout=120, json={
            "model": "qwen-vl-tiny", "temperature": 0, "seed": 1, "max_tokens": N,
            "messages": [{"role": "user", "content": content}]})
        assert r.json()["choices"][0]["message"]["content"] == said
    # Long enough that a restore is worth it (runner.engine.placer.MIN_GAIN)
    long = [{"role": "user", "content": "Look closely at the picture. " * 8 + "What is this?[img]",
             "images": [picture]}]
    said = client.chat(model="qwen-vl-tiny", options=greedy, messages=long).message.content
    follow = long + [{"role": "assistant", "content": said},
                     {"role": "user", "content": "And its colour?"}]
    client.chat(model="qwen-vl-tiny", options=greedy,  # takes the one slot: the image's
                messages=[{"role": "user", "content": "Something else."}])  # goes to RAM
    warm = client.chat(model="qwen-vl-tiny", options=greedy, messages=follow)
    assert (warm.prompt_eval_count or 0) < 40  # restored from RAM, image and all
    r = httpx.post(d.url + "/api/generate", json={"model": "qwen-vl-tiny", "keep_alive": 0},
                   timeout=60)
    assert r.json()["done_reason"] == "unload"
    wait_for(lambda: not client.ps().models, timeout=60)
    restored = client.chat(model="qwen-vl-tiny", options=greedy, messages=follow)
    assert (restored.prompt_eval_count or 0) < 40  # from the disk tier, after a restart
    assert restored.message.content == warm.message.content
    fresh = daemon_factory(starter_store, DETERMINISTIC="1")  # nothing cached: all decoded
    other = ollama.Client(host=fresh.url)
    blobs = {name: other.create_blob(files[key]) for name, key in
             (("qwen2vl.gguf", "qwen2vl"), ("mmproj.gguf", "qwen2vl_merger"))}
    assert other.create(model="qwen-vl-tiny", files=blobs).status == "success"
    cold = other.chat(model="qwen-vl-tiny", options=greedy, messages=follow)
    assert (cold.prompt_eval_count or 0) > 60
    assert cold.message.content == warm.message.content  # restored cells answer as fresh


def detokenize(url: str, model: str, tokens: list[int]) -> str:
    import httpx

    r = httpx.post(url + "/api/detokenize", json={"model": model, "tokens": tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["content"])
