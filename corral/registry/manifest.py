"""Docker v2 schema-2 manifests as Ollama stores them, parsed with distrust.

The same parser checks manifests we write and manifests a registry sends us.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from corral.errors import BadRequest, InvalidDigest

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_PREFIX = "application/vnd.ollama.image."
MODEL = MEDIA_PREFIX + "model"
PROJECTOR = MEDIA_PREFIX + "projector"
ADAPTER = MEDIA_PREFIX + "adapter"
DRAFT = MEDIA_PREFIX + "draft"  # a smaller model's weights, for speculative decoding
TEMPLATE = MEDIA_PREFIX + "template"
PROMPT = MEDIA_PREFIX + "prompt"  # old alias of TEMPLATE
SYSTEM = MEDIA_PREFIX + "system"
PARAMS = MEDIA_PREFIX + "params"
MESSAGES = MEDIA_PREFIX + "messages"
LICENSE = MEDIA_PREFIX + "license"
KNOWN_LAYER_TYPES = frozenset(
    {MODEL, PROJECTOR, ADAPTER, DRAFT, TEMPLATE, PROMPT, SYSTEM, PARAMS, MESSAGES, LICENSE,
     MEDIA_PREFIX + "embed", MEDIA_PREFIX + "tensor",
     MEDIA_PREFIX + "json"}
)

MAX_MANIFEST_BYTES = 4 << 20
MAX_LAYERS = 256
MAX_BLOB_SIZE = 1 << 42  # 4 TiB: anything larger is a lie

DIGEST_RE = re.compile(r"sha256[:-]([0-9a-f]{64})")


def digest_hex(digest: str) -> str:
    """The 64 hex characters of a digest, or InvalidDigest. Accepts `sha256:` and `sha256-`."""
    if not isinstance(digest, str):
        raise InvalidDigest()
    m = DIGEST_RE.fullmatch(digest)
    if not m:
        raise InvalidDigest()
    return m.group(1)


def canonical_digest(digest: str) -> str:
    return "sha256:" + digest_hex(digest)


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str
    size: int
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.source:
            out["from"] = self.source
        return out


@dataclass(frozen=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...]
    schema_version: int = 2
    media_type: str = MANIFEST_MEDIA_TYPE
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def digests(self) -> set[str]:
        return {self.config.digest, *(layer.digest for layer in self.layers)}

    def layers_of(self, media_type: str) -> list[Layer]:
        return [layer for layer in self.layers if layer.media_type == media_type]

    def size(self) -> int:
        return sum(layer.size for layer in self.layers) + self.config.size

    def to_bytes(self) -> bytes:
        doc = {
            "schemaVersion": self.schema_version,
            "mediaType": self.media_type,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }
        return json.dumps(doc, separators=(",", ":")).encode()


def parse_manifest(data: bytes) -> Manifest:
    """Parse manifest bytes, rejecting anything malformed before it can become a path."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BadRequest("manifest is too large")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("invalid manifest: not JSON") from None
    if not isinstance(doc, dict):
        raise BadRequest("invalid manifest: not an object")
    if doc.get("schemaVersion") != 2:
        raise BadRequest("invalid manifest: unsupported schemaVersion")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise BadRequest("invalid manifest: no layers")
    if len(raw_layers) > MAX_LAYERS:
        raise BadRequest("invalid manifest: too many layers")
    config = _layer(doc.get("config"), config=True)
    layers = tuple(_layer(item) for item in raw_layers)
    media_type = doc.get("mediaType", MANIFEST_MEDIA_TYPE)
    if not isinstance(media_type, str):
        raise BadRequest("invalid manifest: bad mediaType")
    return Manifest(config, layers, 2, media_type)


def _layer(item: Any, config: bool = False) -> Layer:
    if not isinstance(item, dict):
        raise BadRequest("invalid manifest: layer is not an object")
    media_type, digest, size = item.get("mediaType"), item.get("digest"), item.get("size")
    if not isinstance(media_type, str):
        raise BadRequest("invalid manifest: layer without mediaType")
    if config:
        if media_type != CONFIG_MEDIA_TYPE:
            raise BadRequest(f"invalid manifest: unexpected config media type {media_type[:80]!r}")
    elif media_type not in KNOWN_LAYER_TYPES:
        raise BadRequest(f"invalid manifest: unknown layer media type {media_type[:80]!r}")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_BLOB_SIZE:
        raise BadRequest("invalid manifest: bad layer size")
    source = item.get("from")
    return Layer(media_type, canonical_digest(digest if isinstance(digest, str) else ""), size,
                 source if isinstance(source, str) else None)
