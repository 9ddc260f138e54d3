"""The audio test model (tests/audio_model.py) is one the pinned mtmd serves: it loads
beside the chat starter as an audio-only projector, reads a WAV by its header, cuts a
clip into 30 s windows of 750 tokens each (positions = tokens: no M-RoPE), and encodes
a window into the text model's embedding width. The engine's audio work builds on these
facts; this pins them."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from tests.audio_model import TOKENS_PER_WINDOW, wav_bytes, write_audio_projector

pytestmark = pytest.mark.model


def _audio_chunks(ctx: int, data: bytes) -> list[tuple[int, int, object]]:
    """(n_tokens, n_pos, chunk) of each audio chunk of a prompt holding the clip."""
    buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
    assert bitmap and M.mtmd_bitmap_is_audio(bitmap)
    raw = f"What is in this clip? {M.mtmd_default_marker().decode()}".encode()
    text = M.mtmd_input_text()
    text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), True, True
    chunks = M.mtmd_input_chunks_init()
    assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(text),
                           (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    M.mtmd_bitmap_free(bitmap)
    out = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_AUDIO:
            out.append((M.mtmd_input_chunk_get_n_tokens(chunk),
                        M.mtmd_input_chunk_get_n_pos(chunk), chunk))
    return out


def test_the_audio_projector_loads_windows_and_encodes(chat_gguf: Path, tmp_path: Path) -> None:
    projector = write_audio_projector(tmp_path / "audio.gguf")
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(chat_gguf).encode(), params)
    assert model
    mp = M.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.print_timings, mp.warmup = False, 2, False, False
    ctx = M.mtmd_init_from_file(str(projector).encode(), model, mp)
    try:
        assert ctx and M.mtmd_support_audio(ctx) and not M.mtmd_support_vision(ctx)
        assert M.mtmd_get_audio_sample_rate(ctx) == 16000 and not M.mtmd_decode_use_mrope(ctx)
        for seconds, windows in ((1.0, 1), (31.0, 2)):
            chunks = _audio_chunks(ctx, wav_bytes(seconds))
            assert [(n, p) for n, p, _ in chunks] == [(TOKENS_PER_WINDOW,) * 2] * windows
        n_tokens, _, chunk = _audio_chunks(ctx, wav_bytes(2.0, tone=440.0))[0]
        assert M.mtmd_encode_chunk(ctx, chunk) == 0
        n_embd = L.llama_model_n_embd_inp(model)
        embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(n_tokens * n_embd,))
        assert n_embd == 576 and np.isfinite(embd).all() and embd.std() > 0
    finally:
        if ctx:
            M.mtmd_free(ctx)
        L.llama_model_free(model)
