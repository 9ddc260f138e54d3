"""Audio clips from requests: sniffed, measured and limited before any reaches the runner.

Ollama carries audio in a message's `images` beside its pictures and tells them apart
by their bytes; OpenAI's `input_audio` parts and `/v1/audio/transcriptions` uploads
arrive here the same way (server.chat.images sorts a request's media). A clip is
audio when its header says WAV, FLAC or MP3: exactly the test of the runner's decoder
(llama.cpp's mtmd helper, miniaudio), which would hand any other bytes to a video path.
Its length is read from the header (mutagen) and checked against the limits before
anything is decoded; a WAV must also hold every byte its header promises. The runner
decodes and resamples the clip itself, as llama-server does, so a clip gives the same
tokens here as there.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from corral.config import Settings
from corral.errors import BadRequest
from corral.media import audio_format

@dataclass(frozen=True)
class Clip:
    format: str  # "wav", "mp3" or "flac"
    seconds: float


def check_clip(data: bytes, i: int, settings: Settings) -> Clip:
    """The clip's format and length, once it is within the limits; else a 400 naming it."""
    kind = audio_format(data)
    if kind is None:
        raise BadRequest(f"audio {i} is not a supported audio file (WAV, MP3 or FLAC)")
    if len(data) > settings.max_audio_bytes:
        raise BadRequest(f"audio {i} is over the limit of {settings.max_audio_bytes} bytes"
                         " (CORRAL_MAX_AUDIO_BYTES)")
    if kind == "wav":
        _check_wav(data, i)
    seconds = _seconds(data, kind, i)
    if seconds > settings.max_audio_seconds:
        raise BadRequest(f"audio {i} is {seconds:.1f} s long, over the limit of"
                         f" {settings.max_audio_seconds:g} s (CORRAL_MAX_AUDIO_SECONDS)")
    return Clip(kind, seconds)


def _check_wav(data: bytes, i: int) -> None:
    """Every chunk the RIFF header counts is there, and so is the whole `data` chunk."""
    cut = BadRequest(f"audio {i} is a truncated or corrupt WAV")
    if struct.unpack("<I", data[4:8])[0] + 8 > len(data):
        raise cut
    pos = 12
    while pos + 8 <= len(data):
        name, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if pos + 8 + size > len(data):
            raise cut
        if name == b"data":
            return
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    raise cut


def _seconds(data: bytes, kind: str, i: int) -> float:
    """The clip's length from its header: WAV's data size over its byte rate, FLAC's
    STREAMINFO sample count, MP3's Xing/VBRI frame count or its bitrate."""
    from mutagen import MutagenError  # only a request with audio pays for the import
    from mutagen.flac import FLAC
    from mutagen.mp3 import MP3
    from mutagen.wave import WAVE

    reader = {"wav": WAVE, "flac": FLAC, "mp3": MP3}[kind]
    try:
        info = reader(io.BytesIO(data)).info
    except (MutagenError, ValueError, struct.error, EOFError):
        raise BadRequest(f"audio {i} is a truncated or corrupt {kind.upper()}") from None
    seconds = float(getattr(info, "length", 0.0) or 0.0)
    if seconds <= 0.0 or getattr(info, "sample_rate", 0) <= 0:
        raise BadRequest(f"audio {i} has no samples")
    return seconds
