"""Image and audio files named in a prompt, attached as Ollama's CLI does.

`corral run MODEL "what is in ./photo.png"` and REPL lines alike: each path to an
image or audio clip (WAV, MP3, FLAC) that exists is read, removed from the text and
sent with the message, in Ollama's `images` (which carries both). Paths may be quoted
('...' or "..."), hold escaped spaces (my\\ photo.png) and start with ~. Images
only for models that report the vision capability, clips only for those that report
audio; any other path is sent as typed.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from corral.errors import CorralError

if TYPE_CHECKING:
    from corral.api.client import Client
    from corral.cli.runoptions import RunOptions

AUDIO = (".wav", ".mp3", ".flac")
EXTENSIONS = r"(?:png|jpe?g|gif|bmp|webp|wav|mp3|flac)"
_START = r"(?:~|\.{1,2})?/"
_PATH = re.compile(
    rf"""(?P<q>["'])(?P<quoted>{_START}[^"'\n]*?\.{EXTENSIONS})(?P=q)"""
    rf"""|(?P<bare>{_START}(?:\\ |\S)*?\.{EXTENSIONS})(?=$|\s|[,;:!?)])""",
    re.IGNORECASE)
MAX_BYTES = 100 << 20  # as Ollama's CLI; the daemon applies its own, smaller limit


def mentions_image(text: str) -> bool:
    return _PATH.search(text) is not None


def extract_images(text: str, kinds: frozenset[str] = frozenset({"image", "audio"})
                   ) -> tuple[str, list[str]]:
    """The text without the paths of files that exist and are of `kinds` ("image",
    "audio"), and those files as base64."""
    images: list[str] = []
    out, last = [], 0
    for match in _PATH.finditer(text):
        raw = match.group("quoted") or match.group("bare").replace("\\ ", " ")
        path = Path(os.path.expanduser(raw))
        kind = "audio" if path.suffix.lower() in AUDIO else "image"
        if kind not in kinds or not path.is_file():
            continue  # not a file here, or not one the model takes: it stays text
        if path.stat().st_size > MAX_BYTES:
            raise CorralError(f"{path}: the {kind} is larger than {MAX_BYTES >> 20} MB")
        try:
            images.append(base64.b64encode(path.read_bytes()).decode())
        except OSError as exc:
            raise CorralError(f"couldn't read {path}: {exc.strerror}") from None
        print(f"Added {kind} '{path}'", file=sys.stderr)
        out.append(text[last:match.start()])
        last = match.end()
    out.append(text[last:])
    return re.sub(r"[ \t]{2,}", " ", "".join(out)).strip(), images


def attach(client: "Client", opts: "RunOptions", text: str) -> tuple[str, list[str]]:
    """Image and audio paths in the text, read and attached where the model takes them
    (its capabilities, asked once)."""
    if not mentions_image(text):
        return text, []
    if opts.media is None:
        capabilities = client.show(opts.model).get("capabilities") or []
        opts.media = frozenset({"vision": "image", "audio": "audio"}[c] for c in capabilities
                               if c in ("vision", "audio"))
    return extract_images(text, opts.media) if opts.media else (text, [])
