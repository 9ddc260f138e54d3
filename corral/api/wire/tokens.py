"""The token routes' requests: Ollama's (unmerged) /api/tokenize and /api/detokenize and
llama-server's /tokenize and /detokenize. The counting routes (Anthropic's count_tokens,
the Responses API's input_tokens) take their API's own request records."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from corral.api.wire import Wire
from corral.api.wire.common import KeepAlive

TokenIds = list[int]


class TokenizeRequest(Wire):
    """POST /api/tokenize: {model, content} -> {tokens}."""

    model: Optional[str] = None
    content: str
    keep_alive: KeepAlive = None


class DetokenizeRequest(Wire):
    """POST /api/detokenize: {model, tokens} -> {content}."""

    model: Optional[str] = None
    tokens: TokenIds
    keep_alive: KeepAlive = None


class LlamaTokenizeRequest(Wire):
    """llama-server's POST /tokenize, with `model` for a daemon that serves many (the one
    loaded when it is left out). No `content`: no tokens, as llama-server answers."""

    model: Optional[str] = None
    content: Optional[str] = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class LlamaDetokenizeRequest(Wire):
    """llama-server's POST /detokenize, with `model` as for /tokenize."""

    model: Optional[str] = None
    tokens: TokenIds = Field(default_factory=list)
