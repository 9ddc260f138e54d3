"""Audio in the runner: the chat starter with a tiny random "qwen2a" projector
(tests/audio_model.py), against llama.cpp's own decode of the same files.

llama-server feeds a prompt with media through mtmd's helper (mtmd_helper_eval_chunks)
and samples greedily; `reference` does exactly that here, in this process, on the same
GGUFs, and Corral's engine, which decodes the clip's embeddings in slices between
other streams' steps, must answer token for token the same, alone and with three text
streams decoding beside it. Deterministic mode makes the kernels batch-invariant, so
slicing changes nothing. The answers are meaningless; the pipeline is real.

`LLAMA_SERVER` is what the pinned llama-server (--mmproj, --temp 0) answered to
/completion with the tone clip on the same files. For the noise clip it answered
otherwise from the third token: so does `reference` itself when run with ggml's
default kernels instead of the reference ones (checked by hand, 2026-12-04), so that
difference is the random model's near-ties under other kernels, not the pipeline.
"""

from __future__ import annotations

import base64
import ctypes
from pathlib import Path
from typing import Iterator

import llama_cpp as L
import pytest
from llama_cpp import mtmd_cpp as M

from corral.errors import CorralError
from corral.runner.process.service import RunnerService
from corral.runner.wire import MARKER, CompletionJob
from tests.audio_model import TOKENS_PER_WINDOW, flac_header, wav_bytes, write_audio_projector
from tests.test_vision import chat, collect, raw, run, serve, submit

pytestmark = pytest.mark.model

TONE = base64.b64encode(wav_bytes(2.0, tone=440.0)).decode()
NOISE = base64.b64encode(wav_bytes(2.0, seed=3)).decode()
N_PREDICT = 10
LLAMA_SERVER = {"tone": [253, 4928, 216, 33, 32, 32, 32, 32, 32, 32]}  # " a string 1000000"


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_audio_projector(tmp_path_factory.mktemp("audio") / "qwen2a.gguf")


@pytest.fixture(scope="module")
def hearing(chat_gguf: Path, projector: Path) -> Iterator[RunnerService]:
    service = serve(chat_gguf, projector, n_slots=4, num_ctx=1024, deterministic=True)
    yield service
    service.engine.stop()


def reference(model_path: Path, projector: Path, prompt: str, clip: bytes) -> str:
    """llama-server's path on the same files: mtmd tokenizes and evaluates the prompt
    (mtmd_helper_eval_chunks, one batch), then greedy sampling, one token a decode."""
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(model_path).encode(), params)
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_threads = 1024, 1024, 1024, 2
    ctx = L.llama_init_from_model(model, cparams)
    mparams = M.mtmd_context_params_default()
    mparams.use_gpu, mparams.print_timings, mparams.warmup = False, False, False
    mctx = M.mtmd_init_from_file(str(projector).encode(), model, mparams)
    vocab = L.llama_model_get_vocab(model)
    chunks = M.mtmd_input_chunks_init()
    sampler = L.llama_sampler_init_greedy()
    try:
        buf = (ctypes.c_ubyte * len(clip)).from_buffer_copy(clip)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(clip), False)
        text = M.mtmd_input_text()
        raw_text = prompt.replace(MARKER, M.mtmd_default_marker().decode()).encode()
        text.text, text.text_len, text.add_special, text.parse_special = \
            raw_text, len(raw_text), True, True
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(text),
                               (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        M.mtmd_bitmap_free(bitmap)
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 1024, True,
                                         ctypes.byref(n_past)) == 0
        out = []
        for _ in range(N_PREDICT):
            token = L.llama_sampler_sample(sampler, ctx, -1)
            if L.llama_vocab_is_eog(vocab, token):
                break
            piece = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(vocab, token, piece, 64, 0, True)
            out.append(piece.raw[:n])
            one = (L.llama_token * 1)(token)
            assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
        return b"".join(out).decode("utf-8", "replace")
    finally:
        L.llama_sampler_free(sampler)
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model)


def test_a_clip_answers_as_llama_cpp_does_alone_and_beside_three_streams(
        hearing: RunnerService, chat_gguf: Path, projector: Path) -> None:
    bodies = {"tone": raw([TONE], "The sound is"), "noise": raw([NOISE], "The sound is")}
    expected = {name: reference(chat_gguf, projector, body["prompt"],
                                base64.b64decode(body["images"][0]))
                for name, body in bodies.items()}
    assert expected["tone"] != expected["noise"]  # the clip reaches the context
    alone = {name: run(hearing, body, num_predict=N_PREDICT) for name, body in bodies.items()}
    assert {name: text for name, (text, _) in alone.items()} == expected
    assert list(alone["tone"][1].context[-N_PREDICT:]) == LLAMA_SERVER["tone"]
    for slot in hearing.engine.slots:  # nothing cached helps anyone this time
        slot.cached = []
        L.llama_memory_seq_rm(hearing.engine.llama.mem, slot.seq_id, -1, -1)
    prompts = ["The capital of France is", "Write a haiku about rain.", "Count to five:"]
    texts = [submit(hearing, chat([], p), num_predict=16) for p in prompts]
    beside = submit(hearing, bodies["tone"], num_predict=N_PREDICT)
    assert all(collect(job)[0] for job in texts)
    assert collect(beside)[0] == expected["tone"]


def test_a_follow_up_about_the_clip_reuses_its_tokens(hearing: RunnerService) -> None:
    first, stats = run(hearing, chat([NOISE], "Describe it."))
    encoded = hearing.vision.encoded if hearing.vision else -1
    _, follow = run(hearing, chat([NOISE], "And how loud is it?"))
    assert stats.prompt_tokens > TOKENS_PER_WINDOW
    assert follow.prompt_eval_count < follow.prompt_tokens - TOKENS_PER_WINDOW
    assert hearing.vision is not None and hearing.vision.encoded == encoded
    assert follow.context and all(t >= 0 for t in follow.context)  # no placeholder ids


def test_a_long_clip_is_one_span_per_30_s_window(hearing: RunnerService) -> None:
    long = base64.b64encode(wav_bytes(31.0)).decode()
    job = CompletionJob.from_json({**raw([long, TONE], "Two clips:"), "options": {}})
    tokens, spans = hearing.prompt_tokens(job)
    assert [s.n_tokens for s in spans] == [TOKENS_PER_WINDOW] * 3
    keys = [s.key for s in spans]
    assert len(set(keys)) == 3  # each window its own placeholder: no false prefix match
    again, _ = hearing.prompt_tokens(job)
    assert again == tokens  # the same clip gives the same placeholders


def test_bad_audio_fails_the_request_not_the_runner(hearing: RunnerService) -> None:
    wav = wav_bytes(1.0)
    broken = wav[:12] + b"fmt " + b"\xff" * 40  # a WAV header over nothing decodable
    from tests.vision_model import png_bytes

    # An audio-only projector: anything but a clip is an image it cannot take, and no
    # bytes that are neither reach mtmd's helper (which would try a video decoder).
    for data, words in ((broken, "audio 0 could not be decoded"),
                        (b"not audio, not an image", "does not support images"),
                        (png_bytes(8, 8), "does not support images"),
                        (flac_header(2.0), "audio 0 could not be decoded")):
        with pytest.raises(CorralError) as info:
            run(hearing, raw([base64.b64encode(data).decode()]))
        assert info.value.status == 400 and words in info.value.message
    assert run(hearing, raw([TONE]))[1].eval_count > 0  # and it still answers
