"""Test helpers for audio (issue 54): a tiny "qwen2a" projector GGUF and WAV clips.

No small audio model ships on PyPI, so the tests make one: a projector GGUF with
random weights from a fixed seed, of llama.cpp's "qwen2a" type (Qwen2-Audio): a
Whisper encoder (two 1-D convolutions, a pre-norm transformer with learned positions,
2x average pooling, a final layer norm) and one linear projection into the text model's
embedding width (576 for the chat starter, SmolLM2-135M).

What llama.cpp's mtmd asks of it (tools/mtmd/clip.cpp, models/whisper-enc.cpp):

- every clip is cut or padded into 30 s windows of 3000 mel frames; each window is one
  audio chunk of 3000 / 2 (stride-2 conv) / 2 (avg pool) = 750 tokens, so the position
  table must hold 1500 rows, whatever the clip's length;
- conv biases are [1, n_embd] in ggml (numpy (n_embd, 1)) so they broadcast over time;
- attn_k has no bias (the graph asserts so); q, v and out have one.

The answers it produces are meaningless; the pipeline that produces them is real.

`kind="ultravox"` or `"voxtral"` writes the same encoder under one of the projectors that
stack frames; the pinned mtmd loads and tokenizes those but aborts the process on the
first encode (see STACK_FACTORS), which is what they are for.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import gguf
import numpy as np

from tests.vision_model import add_blocks

N_MEL = 128  # Qwen2-Audio's Whisper (large-v3 style) uses 128 mel bins
N_CTX = 1500  # positions after the stride-2 conv: 3000 mel frames = 30 s
N_EMBD, N_FF, N_HEAD, N_LAYER = 64, 128, 4, 2
SAMPLE_RATE = 16000
TOKENS_PER_WINDOW = N_CTX // 2  # 750 embeddings per 30 s window

# Frames stacked into one token by the projectors that stack (the real models' values).
# For these the pinned mtmd counts a window's tokens as 3000 mel frames / stack / 2
# (/ 2 again for voxtral's avg pool), rounding down, while the graph stacks the 1500
# (voxtral: 750) encoder outputs rounding up (padding): ultravox 187 vs 188 tokens,
# voxtral 187 vs 188, so encoding aborts ("Invalid number of output tokens").
STACK_FACTORS = {"ultravox": 8, "voxtral": 4}


def write_audio_projector(path: Path | str, text_embd: int = 576, seed: int = 0,
                          leave_out: tuple[str, ...] = (), kind: str = "qwen2a",
                          k_bias: bool = False) -> Path:
    """A loadable audio projector whose output is `text_embd` wide; `leave_out` names
    tensors to omit, for one that must fail to load. `kind` is the projector type:
    "qwen2a" (the default), or "ultravox" / "voxtral", which the pinned mtmd loads and
    tokenizes but aborts on encoding (see STACK_FACTORS). `k_bias` gives Whisper's k
    projection a bias, which its graph asserts it has not: one that loads and aborts at
    its first encode whatever its type."""
    if kind not in ("qwen2a", *STACK_FACTORS):
        raise ValueError(f"unknown audio projector kind {kind!r}")
    path = Path(path)
    rng = np.random.default_rng(seed)

    def rand(*shape: int, std: float = 0.1) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    K = gguf.Keys
    w = gguf.GGUFWriter(str(path), "clip")

    def add(name: str, data: np.ndarray) -> None:
        if name not in leave_out:
            w.add_tensor(name, data)  # float16 arrays are stored as F16, float32 as F32

    w.add_string(K.General.NAME, f"corral test audio projector ({kind})")
    w.add_bool(K.Clip.HAS_VISION_ENCODER, False)
    w.add_bool(K.Clip.HAS_AUDIO_ENCODER, True)
    w.add_string(K.Clip.PROJECTOR_TYPE, kind)  # gguf.VisionProjectorType.QWEN2A, ...
    w.add_uint32(K.ClipAudio.EMBEDDING_LENGTH, N_EMBD)
    w.add_uint32(K.ClipAudio.FEED_FORWARD_LENGTH, N_FF)
    w.add_uint32(K.ClipAudio.BLOCK_COUNT, N_LAYER)
    w.add_uint32(K.ClipAudio.PROJECTION_DIM, text_embd)
    w.add_uint32(K.ClipAudio.Attention.HEAD_COUNT, N_HEAD)
    w.add_float32(K.ClipAudio.Attention.LAYERNORM_EPS, 1e-5)
    w.add_uint32(K.ClipAudio.NUM_MEL_BINS, N_MEL)
    if kind in STACK_FACTORS:
        w.add_uint32(K.ClipAudio.Projector.STACK_FACTOR, STACK_FACTORS[kind])

    # numpy shapes are ggml's reversed: a [n_in, n_out] matrix is (n_out, n_in) here,
    # a conv1d kernel [K, C_in, C_out] is (C_out, C_in, K).
    # conv kernels are F16, as convert_hf_to_gguf.py stores Whisper's
    add("a.conv1d.1.weight", rand(N_EMBD, N_MEL, 3, std=0.2).astype(np.float16))
    add("a.conv1d.1.bias", rand(N_EMBD, 1))
    add("a.conv1d.2.weight", rand(N_EMBD, N_EMBD, 3, std=0.1).astype(np.float16))
    add("a.conv1d.2.bias", rand(N_EMBD, 1))
    add("a.position_embd.weight", rand(N_CTX, N_EMBD, std=0.5))
    add_blocks(add, rand, "a", N_LAYER, N_EMBD, N_FF, k_bias=k_bias)
    add("a.post_ln.weight", 1.0 + rand(N_EMBD))
    add("a.post_ln.bias", rand(N_EMBD))
    if kind == "qwen2a":
        add("mm.a.fc.weight", rand(text_embd, N_EMBD))
        add("mm.a.fc.bias", rand(text_embd))
    elif kind == "ultravox":
        # UltravoxProjector: rms-norm (pre) -> mlp.1 -> swiglu (halves) -> rms-norm (mid)
        # -> mlp.2, all without biases, over frames stacked stack_factor at a time
        stacked = N_EMBD * STACK_FACTORS[kind]
        add("mm.a.norm_pre.weight", 1.0 + rand(stacked))
        add("mm.a.mlp.1.weight", rand(2 * N_FF, stacked))
        add("mm.a.norm_mid.weight", 1.0 + rand(N_FF))
        add("mm.a.mlp.2.weight", rand(text_embd, N_FF))
    else:  # voxtral: avg-pooled, stacked frames -> mlp.1 -> gelu -> mlp.2, no biases
        stacked = N_EMBD * STACK_FACTORS[kind]
        add("mm.a.mlp.1.weight", rand(N_FF, stacked))
        add("mm.a.mlp.2.weight", rand(text_embd, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def wav_bytes(seconds: float, rate: int = SAMPLE_RATE, seed: int = 0, tone: float | None = None
              ) -> bytes:
    """A 16-bit mono PCM WAV: white noise from `seed`, or a sine at `tone` Hz."""
    n = int(round(seconds * rate))
    if tone is not None:
        signal = 0.5 * np.sin(2 * np.pi * tone * np.arange(n) / rate)
    else:
        signal = np.random.default_rng(seed).uniform(-0.5, 0.5, n)
    pcm = (signal * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return out.getvalue()


def flac_header(seconds: float, rate: int = SAMPLE_RATE, tail: bytes = b"\x00" * 64) -> bytes:
    """A FLAC whose STREAMINFO promises `seconds` of 16-bit mono at `rate` and whose
    frames are `tail`: a header every check passes and no decoder can read."""
    total = int(seconds * rate)
    bits = (rate << 44) | (0 << 41) | (15 << 36) | total  # rate, channels-1, bps-1, samples
    info = (4096).to_bytes(2, "big") * 2 + b"\x00" * 6 + bits.to_bytes(8, "big") + b"\x00" * 16
    return b"fLaC" + bytes([0x80, 0, 0, len(info)]) + info + tail


def mp3_bytes(seconds: float) -> bytes:
    """An MP3 of silence: MPEG-2 layer III frames at 16 kHz, mono, 64 kbit/s (288 bytes
    and 576 samples each), every bit of side information and data zero."""
    frame = bytes([0xFF, 0xF3, 0x88, 0xC0]) + b"\x00" * (288 - 4)
    return frame * max(1, round(seconds * SAMPLE_RATE / 576))
