"""Image files named in a prompt, attached as Ollama's CLI does.

`corral run MODEL "what is in ./photo.png"` and REPL lines alike: each path to an
image that exists is read, removed from the text and sent as an image. Paths may
be quoted ('...' or "..."), hold escaped spaces (my\\ photo.png) and start with ~.
Only for models that report the vision capability; for others the text is sent
as typed.
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

EXTENSIONS = r"(?:png|jpe?g|gif|bmp|webp)"
_START = r"(?:~|\.{1,2})?/"
_PATH = re.compile(
    rf"""(?P<q>["'])(?P<quoted>{_START}[^"'\n]*?\.{EXTENSIONS})(?P=q)"""
    rf"""|(?P<bare>{_START}(?:\\ |\S)*?\.{EXTENSIONS})(?=$|\s|[,;:!?)])""",
    re.IGNORECASE)
MAX_BYTES = 100 << 20  # as Ollama's CLI; the daemon applies its own, smaller limit


def mentions_image(text: str) -> bool:
    return _PATH.search(text) is not None


def extract_images(text: str) -> tuple[str, list[str]]:
    """The text without the image paths that exist, and those images as base64."""
    images: list[str] = []
    out, last = [], 0
    for match in _PATH.finditer(text):
        raw = match.group("quoted") or match.group("bare").replace("\\ ", " ")
        path = Path(os.path.expanduser(raw))
        if not path.is_file():
            continue  # not a file here: it stays part of the text
        if path.stat().st_size > MAX_BYTES:
            raise CorralError(f"{path}: the image is larger than {MAX_BYTES >> 20} MB")
        try:
            images.append(base64.b64encode(path.read_bytes()).decode())
        except OSError as exc:
            raise CorralError(f"couldn't read {path}: {exc.strerror}") from None
        print(f"Added image '{path}'", file=sys.stderr)
        out.append(text[last:match.start()])
        last = match.end()
    out.append(text[last:])
    return re.sub(r"[ \t]{2,}", " ", "".join(out)).strip(), images


def attach(client: "Client", opts: "RunOptions", text: str) -> tuple[str, list[str]]:
    """Image paths in the text, read and attached, when the model can see (asked once)."""
    if not mentions_image(text):
        return text, []
    if opts.vision is None:
        opts.vision = "vision" in (client.show(opts.model).get("capabilities") or [])
    return extract_images(text) if opts.vision else (text, [])
