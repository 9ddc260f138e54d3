"""Images from requests: decoded, sniffed and measured before any reaches the runner.
(Audio clips travel in the same lists; server.chat.audio checks those.)

Every API carries images as base64 (Ollama's `images`, OpenAI's and the Responses
API's data URIs, Anthropic's base64 sources). Each is checked here from its
header alone, so a decompression bomb (a few kilobytes claiming 30000 x 30000
pixels) is refused before anything allocates its pixels, and a truncated or
foreign file gets a 400 naming the image rather than a failure in native code.
The runner decodes them: PNG, JPEG, GIF and BMP with llama.cpp's own stb_image, and
WebP, which browsers and phones produce and Ollama takes, with Pillow's libwebp. The
daemon decodes nothing: it measures each from its header, so a decoder's fault on
untrusted bytes ends a runner (which is replaced) and never the daemon, and a photo
crosses to the runner as the client sent it, not as a PNG many times its size.
Anything else is refused here by name.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Any

from corral.config import Settings
from corral.errors import BadRequest
from corral.server.chat.audio import audio_format, check_clip

_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,",
                       re.ASCII)
# JPEG start-of-frame markers carry the size; C4, C8 and CC share the range but are not frames.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def from_data_uri(url: Any) -> str:
    """The base64 payload of a `data:image/...;base64,` URI. Remote URLs are refused:
    the daemon fetches nothing on a client's behalf."""
    if not isinstance(url, str) or not url:
        raise BadRequest("image_url must be a data URI")
    if url.startswith(("http://", "https://")):
        raise BadRequest("remote images are not fetched: send the image inline as a data URI"
                         " (data:image/png;base64,...)")
    match = _DATA_URI.match(url)
    if match is None:
        raise BadRequest("image_url must be a base64 data URI (data:image/png;base64,...)")
    return url[match.end():]


def check_images(images: Any, settings: Settings, seen: int = 0, vision: bool = True,
                 audio: bool = False, model: str = "the model") -> list[str]:
    """Validated base64 media, pictures and audio clips (Ollama's `images` carries both,
    told apart by their bytes); `seen` counts the request's media before these, and
    `vision`/`audio` say what the model takes (Ollama's 400 names what it does not)."""
    if images in (None, []):
        return []
    if not isinstance(images, list):
        raise BadRequest("images must be a list of base64 strings")
    if seen + len(images) > settings.max_images:
        raise BadRequest(f"too many images: {seen + len(images)} is over the limit of"
                         f" {settings.max_images} (CORRAL_MAX_IMAGES)")
    out = []
    for i, image in enumerate(images, start=seen):
        data = _decode(image, i, max(settings.max_image_bytes, settings.max_audio_bytes))
        if audio_format(data) is not None:
            if not audio:
                raise BadRequest(f"{model} does not support audio")
            check_clip(data, i, settings)
            out.append(image)
            continue
        if not vision:
            raise BadRequest(f"{model} does not support vision")
        out.append(_checked_image(data, image, i, settings))
    return out


def _checked_image(data: bytes, image: str, i: int, settings: Settings) -> str:
    if len(data) > settings.max_image_bytes:
        raise BadRequest(f"image {i} is over the limit of {settings.max_image_bytes} bytes"
                         " (CORRAL_MAX_IMAGE_BYTES)")
    kind, width, height = measure(data, i)
    if width <= 0 or height <= 0:
        raise BadRequest(f"image {i} has no pixels ({width}x{height})")
    if width * height > settings.max_image_pixels:
        raise BadRequest(f"image {i} is {width}x{height} pixels, over the limit of"
                         f" {settings.max_image_pixels} (CORRAL_MAX_IMAGE_PIXELS)")
    return image


def _decode(image: Any, i: int, limit: int) -> bytes:
    """The bytes of a base64 item, within `limit` (the larger of the image and the audio
    limits: which applies is known once the bytes are sniffed)."""
    if not isinstance(image, str):  # JSON carries images as base64 strings only
        raise BadRequest(f"image {i} must be a base64 string")
    if len(image) > limit * 4 // 3 + 4:
        raise BadRequest(f"image {i} is over the limit of {limit} bytes"
                         " (CORRAL_MAX_IMAGE_BYTES, CORRAL_MAX_AUDIO_BYTES)")
    try:
        data = base64.b64decode(image, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"image {i} is not valid base64") from None
    if not data:
        raise BadRequest(f"image {i} is empty")
    return data


def measure(data: bytes, i: int = 0) -> tuple[str, int, int]:
    """(format, width, height) from the header, or a 400 saying what is wrong."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if len(data) < 24 or data[12:16] != b"IHDR" or b"IEND" not in data[-32:]:
            raise BadRequest(f"image {i} is a truncated or corrupt PNG")
        width, height = struct.unpack(">II", data[16:24])
        return "png", width, height
    if data.startswith(b"\xff\xd8\xff"):
        width, height = _jpeg_size(data, i)
        return "jpeg", width, height
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return "gif", width, height
    if data.startswith(b"BM") and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return "bmp", width, abs(height)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        width, height = _webp_size(data, i)
        return "webp", width, height
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) or b"<svg" in head:
        raise BadRequest(f"image {i} is SVG, which is not supported: send PNG, JPEG, GIF,"
                         " BMP or WebP")
    raise BadRequest(f"image {i} is not a supported image (PNG, JPEG, GIF, BMP or WebP)")


def _webp_size(data: bytes, i: int) -> tuple[int, int]:
    """The canvas from the first chunk (VP8X: the extended format's canvas; VP8L:
    lossless; VP8: lossy key frame), once the RIFF size says the file is whole."""
    corrupt = BadRequest(f"image {i} is a truncated or corrupt WebP")
    if len(data) < 30 or struct.unpack("<I", data[4:8])[0] + 8 > len(data):
        raise corrupt
    chunk, body = data[12:16], data[20:]
    if chunk == b"VP8X" and len(body) >= 10:
        return (1 + int.from_bytes(body[4:7], "little"),
                1 + int.from_bytes(body[7:10], "little"))
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", body[6:10])
        return width & 0x3FFF, height & 0x3FFF
    raise corrupt


def _jpeg_size(data: bytes, i: int) -> tuple[int, int]:
    """Walk the marker segments to the first frame header; the scan must be complete."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            break
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1  # fill byte
            continue
        length = struct.unpack(">H", data[pos + 2:pos + 4])[0]
        if marker in _SOF and pos + 9 <= len(data):
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            if b"\xff\xd9" not in data[pos:]:  # no end-of-image marker: the file was cut
                break
            return width, height
        pos += 2 + length
    raise BadRequest(f"image {i} is a truncated or corrupt JPEG")
