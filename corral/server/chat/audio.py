"""Audio clips from requests: sniffed, measured and limited before any reaches the runner.

Ollama carries audio in a message's `images` beside its pictures and tells them apart
by their bytes; OpenAI's `input_audio` parts and `/v1/audio/transcriptions` uploads
arrive here the same way (server.chat.images sorts a request's media). A clip is
audio when its header says WAV, FLAC or MP3: exactly the test of the runner's decoder
(llama.cpp's mtmd helper, miniaudio), which would hand any other bytes to a video path.
Its length is counted the way the runner's decoder will count it, and checked against
the limits before anything is decoded: a WAV's frames from its data size (dr_wav does
not trust block_align, so neither does this; only PCM, float, A-law and mu-law, whose
frames it sizes exactly), a FLAC's from its STREAMINFO (which dr_flac reads as the
length), an MP3's by walking its frames (dr_mp3 decodes every frame it finds, whatever
a Xing header or the first frame's bitrate say). A WAV must hold every byte its header
promises, an MP3's frames must run to its end, and a clip must last at least
MIN_SECONDS (mtmd asserts on a clip of one sample) at a rate of at least MIN_RATE
(resampling a 1 Hz clip to 16 kHz would ask for gigabytes). The runner decodes and
resamples the clip itself, as llama-server does, so a clip gives the same tokens here
as there.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from corral.config import Settings
from corral.errors import BadRequest
from corral.media import audio_format, named

@dataclass(frozen=True)
class Clip:
    format: str  # "wav", "mp3" or "flac"
    seconds: float


MIN_SECONDS = 0.1
MIN_RATE, MAX_RATE = 8000, 384000
MAX_CHANNELS = 8
# WAVE format tags dr_wav sizes a frame of exactly (channels x bits / 8): PCM, IEEE float,
# A-law, mu-law; WAVE_FORMAT_EXTENSIBLE names one of these in its sub-format.
_WAV_BITS = {1: (8, 16, 24, 32), 3: (32, 64), 6: (8,), 7: (8,)}
_EXTENSIBLE = 0xFFFE
_MP3_TAILS = (b"TAG", b"APETAGEX", b"LYRICS")  # tags that may follow the last frame


def check_clip(data: bytes, i: int, settings: Settings) -> Clip:
    """The clip's format and length, once it is within the limits; else a 400 naming it."""
    kind = audio_format(data)
    if kind is None:
        raise BadRequest(f"audio {i} is {named(data)}, which the runner cannot decode: "
                         "audio must be WAV, MP3 or FLAC")
    if len(data) > settings.max_audio_bytes:
        raise BadRequest(f"audio {i} is over the limit of {settings.max_audio_bytes} bytes"
                         " (CORRAL_MAX_AUDIO_BYTES)")
    limit = settings.max_audio_seconds
    seconds = {"wav": _wav_seconds, "flac": _flac_seconds, "mp3": _mp3_seconds}[kind](
        data, i, limit)
    if seconds > limit:
        raise BadRequest(f"audio {i} is {seconds:.1f} s long, over the limit of"
                         f" {limit:g} s (CORRAL_MAX_AUDIO_SECONDS)")
    if seconds < MIN_SECONDS:
        raise BadRequest(f"audio {i} has no samples" if seconds <= 0 else
                         f"audio {i} is {seconds:.3f} s long, shorter than {MIN_SECONDS} s")
    return Clip(kind, seconds)


def _rate(rate: int, channels: int, i: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE or not 1 <= channels <= MAX_CHANNELS:
        raise BadRequest(f"audio {i} has {channels} channels at {rate} Hz: a clip must have"
                         f" 1 to {MAX_CHANNELS} channels at {MIN_RATE} to {MAX_RATE} Hz")


def _wav_seconds(data: bytes, i: int, _limit: float) -> float:
    """Frames as dr_wav counts them: the data chunk's bytes over channels x bits / 8, for
    the formats whose frames it sizes so; every chunk the RIFF header counts is there."""
    cut = BadRequest(f"audio {i} is a truncated or corrupt WAV")
    if struct.unpack("<I", data[4:8])[0] + 8 > len(data):
        raise cut
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        name, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if pos + 8 + size > len(data):
            raise cut
        if name == b"fmt " and size >= 16:
            fmt = data[pos + 8:pos + 8 + size]
        elif name == b"data":
            if fmt is None:
                raise cut
            return size / _wav_frame(fmt, i) / struct.unpack("<I", fmt[4:8])[0]
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    raise cut


def _wav_frame(fmt: bytes, i: int) -> int:
    """Bytes a frame of this `fmt` chunk holds; a 400 for what dr_wav would size otherwise."""
    tag, channels, rate, _, align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID's first two bytes
    if bits not in _WAV_BITS.get(tag, ()):
        raise BadRequest(f"audio {i} is a WAV of format {tag:#x} at {bits} bits: send PCM,"
                         " float, A-law or mu-law")
    _rate(rate, channels, i)
    if align != channels * bits // 8:
        raise BadRequest(f"audio {i} is a WAV whose block size ({align}) is not its"
                         f" frame's ({channels} x {bits} bits)")
    return align


def _flac_seconds(data: bytes, i: int, _limit: float) -> float:
    """STREAMINFO's sample count: dr_flac's length, which it then reads."""
    from mutagen import MutagenError  # only a request with audio pays for the import
    from mutagen.flac import FLAC

    try:
        info = FLAC(io.BytesIO(data)).info
    except (MutagenError, ValueError, struct.error, EOFError):
        raise BadRequest(f"audio {i} is a truncated or corrupt FLAC") from None
    _rate(int(info.sample_rate), int(info.channels), i)
    return float(info.total_samples) / float(info.sample_rate)


def _mp3_seconds(data: bytes, i: int, limit: float) -> float:
    """Every frame's samples, counted frame by frame (mutagen reads each header) up to
    the limit; the frames must run from the tag to the end, as dr_mp3 would find them."""
    from mutagen.mp3 import HeaderNotFoundError, MPEGFrame

    f = io.BytesIO(data)
    f.seek(_id3_size(data))
    seconds = 0.0
    while f.tell() < len(data) and seconds <= limit:
        at = f.tell()
        try:
            frame = MPEGFrame(f)
        except HeaderNotFoundError:
            if data[at:].startswith(_MP3_TAILS):
                break
            raise BadRequest(f"audio {i} is an MP3 whose frames do not run to its end:"
                             " truncated, corrupt or not an MP3") from None
        _rate(int(frame.sample_rate), int(frame.channels), i)
        samples = 384 if frame.layer == 1 else 576 if frame.version >= 2 and \
            frame.layer == 3 else 1152
        seconds += samples / frame.sample_rate
    return seconds


def _id3_size(data: bytes) -> int:
    """Bytes of a leading ID3v2 tag (its size is four 7-bit bytes; a footer adds ten)."""
    if not data.startswith(b"ID3") or len(data) < 10:
        return 0
    size = 0
    for byte in data[6:10]:
        size = (size << 7) | (byte & 0x7F)
    return 10 + size + (10 if data[5] & 0x10 else 0)
