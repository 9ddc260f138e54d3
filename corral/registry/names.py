"""Model names: `[scheme://][host/][namespace/]model[:tag]`, parsed from the right.

Defaults are `registry.ollama.ai`, `library` and `latest`. Every part is checked
against a strict character set, so a valid name is always a safe relative path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from corral.errors import InvalidName

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# Ollama allows 350 characters of host, but each part becomes a directory name in
# the store, and file systems stop at 255 bytes: a DNS name is at most 253 anyway.
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,252}")
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}")
_MODEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
_TAG = _MODEL


@dataclass(frozen=True)
class Name:
    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = "https"

    def display(self) -> str:
        """The shortest form that still names the model: `model:tag`, `ns/model:tag`, ..."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    def full(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    def parts(self) -> tuple[str, str, str, str]:
        """Path components under `manifests/`."""
        return (self.host, self.namespace, self.model, self.tag)

    def key(self) -> tuple[str, str, str, str]:
        """Lookups are case-insensitive."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    def __str__(self) -> str:
        return self.display()


def parse_name(text: str) -> Name:
    """Parse and validate a model name, filling in the defaults."""
    if not isinstance(text, str) or not text or len(text) > 600:
        raise InvalidName(f"invalid model name {text!r}"[:200])
    scheme = "https"
    rest = text
    for prefix in ("https://", "http://"):
        if rest.startswith(prefix):
            scheme, rest = prefix[:-3], rest[len(prefix) :]
            break
    tag = DEFAULT_TAG
    colon, slash = rest.rfind(":"), rest.rfind("/")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        _check(_TAG, tag, text)
    pieces = rest.split("/")
    if len(pieces) > 3:
        raise InvalidName(f"invalid model name {text!r}: too many parts")
    model = pieces[-1]
    namespace = pieces[-2] if len(pieces) >= 2 else DEFAULT_NAMESPACE
    host = pieces[-3] if len(pieces) == 3 else DEFAULT_HOST
    _check(_MODEL, model, text)
    _check(_NAMESPACE, namespace, text)
    _check(_HOST, host, text)
    if model in (".", "..") or tag in (".", ".."):
        raise InvalidName(f"invalid model name {text!r}")
    return Name(host, namespace, model, tag, scheme)


def _check(pattern: re.Pattern[str], part: str, text: str) -> None:
    if not pattern.fullmatch(part) or not part.isascii():
        raise InvalidName(f"invalid model name {text!r}"[:200])


def is_valid_name(text: str) -> bool:
    try:
        parse_name(text)
    except InvalidName:
        return False
    return True
