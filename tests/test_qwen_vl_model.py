"""The Qwen-VL test pair (tests/qwen_vl_model.py) is one the pinned mtmd serves with
M-RoPE: the projector loads beside its text model, an image of nx x ny tokens takes only
max(nx, ny) decoder positions, laid out on a (t, x, y) grid, and llama.cpp's own
mtmd_helper_eval_chunks advances n_past by those positions, not by the tokens. The
engine's Qwen-VL work builds on these facts; this pins them.

The prompt is what llama-server renders for one user turn holding "What is this?" and
then the image, with the chat starter's ChatML template; the greedy ids pinned below are
the ones llama-server answered that request with (temperature 0, 8 tokens)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Iterator

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from tests.qwen_vl_model import (KINDS, TEXT_EMBD, VISION_TOKENS, tokens_grid,
                                 write_qwen2vl_text, write_qwen3vl_text,
                                 write_qwen_vl_projector)
from tests.vision_model import png_bytes

pytestmark = pytest.mark.model

MARKER = M.mtmd_default_marker().decode()
PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n<|im_start|>user\nWhat is this?" + MARKER
          + "<|im_end|>\n<|im_start|>assistant\n")
SIZE = {"qwen2vl_merger": (224, 56), "qwen2.5vl_merger": (224, 56),
        "qwen3vl_merger": (256, 64)}  # 8 x 2 tokens each: 16 tokens, 8 positions
IMAGE_SEED = 2
N_BEFORE, N_AFTER = 29, 7  # text tokens around the image, <|vision_start|>/<|vision_end|> included
# llama-server's answer to the same request; mtmd_helper_eval_chunks + greedy gives the same
GREEDY = {
    "qwen2vl_merger": [13824, 33608, 25663, 42573, 44117, 9112, 15682, 7976],
    "qwen2.5vl_merger": [32478, 35840, 9738, 10144, 41564, 39862, 40344, 6867],
    "qwen3vl_merger": [26172, 8398, 29289, 38287, 26172, 8398, 26172, 8398],
}


@pytest.fixture(scope="module")
def pair_files(chat_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen_vl")
    files = {"qwen2vl": write_qwen2vl_text(d / "qwen2vl.gguf", chat_gguf),
             "qwen3vl": write_qwen3vl_text(d / "qwen3vl.gguf", chat_gguf)}
    for kind in KINDS:
        files[kind] = write_qwen_vl_projector(d / f"{kind}.gguf", kind)
    return files


def _text_for(kind: str) -> str:
    return "qwen3vl" if kind == "qwen3vl_merger" else "qwen2vl"


def _load_model(path: Path) -> Any:
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), params)
    assert model
    return model


def _init_mtmd(projector: Path, model: Any) -> Any:
    mp = M.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.print_timings, mp.warmup = False, 2, False, False
    return M.mtmd_init_from_file(str(projector).encode(), model, mp)


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, pair_files: dict[str, Path]
         ) -> Iterator[tuple[str, Any, Any]]:
    """(kind, text model, mtmd context) of one projector kind beside its text model."""
    kind = request.param
    model = _load_model(pair_files[_text_for(kind)])
    ctx = _init_mtmd(pair_files[kind], model)
    try:
        assert ctx
        yield kind, model, ctx
    finally:
        if ctx:
            M.mtmd_free(ctx)
        L.llama_model_free(model)


def _tokenize(ctx: Any, data: bytes, prompt: str = PROMPT) -> Any:
    """The prompt's chunks (the caller frees them), the image given as `data`."""
    buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
    assert bitmap
    raw = prompt.encode()
    text = M.mtmd_input_text()
    text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), True, True
    chunks = M.mtmd_input_chunks_init()
    rc = M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
    M.mtmd_bitmap_free(bitmap)
    assert rc == 0
    return chunks


def _text_tokens(chunk: Any) -> list[int]:
    n = ctypes.c_size_t()
    tokens = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
    return [tokens[i] for i in range(n.value)]


def _greedy(model: Any, ctx: Any, chunks: Any, n: int = 8) -> tuple[int, int, list[int]]:
    """llama.cpp's own decode of the chunks, then `n` greedy tokens:
    (n_past after the prompt, the KV cache's last position then, the tokens)."""
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
    cp.n_threads = cp.n_threads_batch = 2
    lctx = L.llama_init_from_model(model, cp)
    assert lctx
    sampler = L.llama_sampler_init_greedy()
    try:
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True,
                                         ctypes.byref(n_past)) == 0
        pos_max = L.llama_memory_seq_pos_max(L.llama_get_memory(lctx), 0)
        out: list[int] = []
        for _ in range(n):
            token = L.llama_sampler_sample(sampler, lctx, -1)
            out.append(token)
            # positions continue from the cache's last one (n_past - 1), one per token
            assert L.llama_decode(lctx, L.llama_batch_get_one((L.llama_token * 1)(token), 1)) == 0
        return n_past.value, pos_max, out
    finally:
        L.llama_sampler_free(sampler)
        L.llama_free(lctx)


def test_an_image_takes_fewer_positions_than_tokens(pair: tuple[str, Any, Any]) -> None:
    kind, model, ctx = pair
    assert M.mtmd_support_vision(ctx) and not M.mtmd_support_audio(ctx)
    assert M.mtmd_decode_use_mrope(ctx)  # from the text model's rope type, not the projector
    assert L.llama_model_rope_type(model) == (
        L.LLAMA_ROPE_TYPE_IMROPE if kind == "qwen3vl_merger" else L.LLAMA_ROPE_TYPE_MROPE)
    nx, ny = tokens_grid(kind, *SIZE[kind])
    assert (nx, ny) == (8, 2)
    chunks = _tokenize(ctx, png_bytes(*SIZE[kind], seed=IMAGE_SEED))
    try:
        got = [(M.mtmd_input_chunk_get_type(c), M.mtmd_input_chunk_get_n_tokens(c),
                M.mtmd_input_chunk_get_n_pos(c))
               for c in (M.mtmd_input_chunks_get(chunks, i)
                         for i in range(M.mtmd_input_chunks_size(chunks)))]
        assert got == [(M.MTMD_INPUT_CHUNK_TYPE_TEXT, N_BEFORE, N_BEFORE),
                       (M.MTMD_INPUT_CHUNK_TYPE_IMAGE, nx * ny, max(nx, ny)),
                       (M.MTMD_INPUT_CHUNK_TYPE_TEXT, N_AFTER, N_AFTER)]
        assert M.mtmd_helper_get_n_tokens(chunks) == N_BEFORE + 16 + N_AFTER
        assert M.mtmd_helper_get_n_pos(chunks) == N_BEFORE + 8 + N_AFTER
        # mtmd wraps the image in Qwen's markers: one token each, as appended to the vocab
        vocab = L.llama_model_get_vocab(model)
        start = _text_tokens(M.mtmd_input_chunks_get(chunks, 0))[-1]
        end = _text_tokens(M.mtmd_input_chunks_get(chunks, 2))[0]
        assert (start, end) == (49152, 49153)  # the chat starter's 49152, then these
        assert [L.llama_vocab_get_text(vocab, t).decode() for t in (start, end)] \
            == list(VISION_TOKENS[:2])

        image = M.mtmd_input_chunks_get(chunks, 1)
        tokens = M.mtmd_input_chunk_get_tokens_image(image)
        assert (M.mtmd_image_tokens_get_nx(tokens), M.mtmd_image_tokens_get_ny(tokens)) == (nx, ny)
        assert M.mtmd_image_tokens_get_n_pos(tokens) == 8
        # token i at t = p0, x = p0 + i % nx (column), y = p0 + i // nx (row), z = 0
        p0 = N_BEFORE
        for i, want in ((0, (p0, p0, p0, 0)), (1, (p0, p0 + 1, p0, 0)),
                        (7, (p0, p0 + 7, p0, 0)), (8, (p0, p0, p0 + 1, 0)),
                        (15, (p0, p0 + 7, p0 + 1, 0))):
            pos = M.mtmd_image_tokens_get_decoder_pos(tokens, p0, i)
            assert (pos.t, pos.x, pos.y, pos.z) == want
        every = (M.mtmd_decoder_pos * 16)()
        M.mtmd_helper_image_get_decoder_pos(tokens, p0, every)
        assert [(p.t, p.x, p.y) for p in every] == [
            (p0, p0 + i % nx, p0 + i // nx) for i in range(16)]

        assert M.mtmd_encode_chunk(ctx, image) == 0
        n_embd = L.llama_model_n_embd_inp(model)  # qwen3vl: main + 1 deepstack embedding
        assert n_embd == TEXT_EMBD * (2 if kind == "qwen3vl_merger" else 1)
        embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(16 * n_embd,))
        assert np.isfinite(embd).all() and embd.std() > 0
    finally:
        M.mtmd_input_chunks_free(chunks)


def test_eval_chunks_advances_n_past_by_positions(pair: tuple[str, Any, Any]) -> None:
    kind, model, ctx = pair
    chunks = _tokenize(ctx, png_bytes(*SIZE[kind], seed=IMAGE_SEED))
    try:
        n_past, pos_max, tokens = _greedy(model, ctx, chunks)
    finally:
        M.mtmd_input_chunks_free(chunks)
    # 52 tokens went in; they took 44 positions
    assert (n_past, pos_max) == (N_BEFORE + 8 + N_AFTER, N_BEFORE + 8 + N_AFTER - 1)
    assert tokens == GREEDY[kind]
    # the image reaches the text model: a flat one changes the first token
    chunks = _tokenize(ctx, png_bytes(*SIZE[kind], color=(200, 30, 30)))
    try:
        assert _greedy(model, ctx, chunks, n=1)[2][0] != GREEDY[kind][0]
    finally:
        M.mtmd_input_chunks_free(chunks)


def test_positions_follow_the_text_model(chat_gguf: Path, tmp_path: Path) -> None:
    """A Qwen2-VL projector beside a plain RoPE model (the chat starter, llama, 576 wide)
    loads, and its image takes one position a token: no M-RoPE."""
    projector = write_qwen_vl_projector(tmp_path / "p.gguf", "qwen2vl_merger", text_embd=576)
    model = _load_model(chat_gguf)
    ctx = _init_mtmd(projector, model)
    try:
        assert ctx and M.mtmd_support_vision(ctx) and not M.mtmd_decode_use_mrope(ctx)
        chunks = _tokenize(ctx, png_bytes(224, 56, seed=IMAGE_SEED))
        image = M.mtmd_input_chunks_get(chunks, 1)
        assert (M.mtmd_input_chunk_get_n_tokens(image), M.mtmd_input_chunk_get_n_pos(image)) \
            == (16, 16)
        M.mtmd_input_chunks_free(chunks)
    finally:
        if ctx:
            M.mtmd_free(ctx)
        L.llama_model_free(model)


def test_a_mismatched_or_incomplete_projector_is_refused(pair_files: dict[str, Path],
                                                         tmp_path: Path) -> None:
    model = _load_model(pair_files["qwen2vl"])
    try:
        # Qwen3-VL's output (64 + 64 deepstack) is wider than qwen2vl's 64 inputs
        assert not _init_mtmd(pair_files["qwen3vl_merger"], model)
        broken = write_qwen_vl_projector(tmp_path / "b.gguf", leave_out=("mm.2.bias",))
        assert not _init_mtmd(broken, model)
    finally:
        L.llama_model_free(model)
