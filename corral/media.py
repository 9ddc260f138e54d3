"""What a media item's bytes are, read as llama.cpp's mtmd helper reads them.

The daemon checks a request's media (server.chat) and the runner hands the bytes to
mtmd's decoder (runner.llama.vision); both sort them by the same test, the helper's
own: WAV, FLAC and MP3 by their headers are audio (miniaudio), anything else is
taken for an image (stb_image), and bytes that are neither would be sent on to a
video path that starts ffprobe, so neither side lets them through.
"""

from __future__ import annotations

def audio_format(data: bytes) -> str | None:
    """The format mtmd's helper would decode these bytes as, or None: not audio."""
    if len(data) < 12:
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def webp(data: bytes) -> bool:
    """Whether these bytes are a WebP: the runner decodes those itself (stb_image reads
    none)."""
    return len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def stb_image(data: bytes) -> bool:
    """Whether stb_image (mtmd's image decoder) reads this format: PNG, JPEG, GIF, BMP."""
    return data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM"))


# Formats mtmd cannot take as audio, by what their bytes start with, for errors that
# name what came instead of the vague "not audio".
_OTHERS = ((b"OggS", "an Ogg file"), (b"\x1aE\xdf\xa3", "a WebM or Matroska file"),
           (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"),
           (b"GIF8", "a GIF image"), (b"BM", "a BMP image"), (b"%PDF", "a PDF"))


def named(data: bytes) -> str:
    """What the bytes are, in words, as far as their first bytes tell."""
    kind = audio_format(data)
    if kind is not None:
        return f"a {kind.upper()} clip"
    if webp(data):
        return "a WebP image"
    if data[4:8] == b"ftyp":
        return "an MP4 or M4A file"
    return next((name for head, name in _OTHERS if data.startswith(head)), "not a known format")
