"""Ollama's management request records: /api/show, /api/copy, /api/delete, /api/pull,
/api/push and /api/create. Each names its model as `model` or, as older clients do,
`name`; `target` is whichever was given."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from corral.api.wire import Wire
from corral.api.wire.common import Options


class Named(Wire):
    model: Optional[str] = None
    name: Optional[str] = None  # the older spelling, which Ollama still reads

    @property
    def target(self) -> Optional[str]:
        return self.model or self.name


class ShowRequest(Named):
    system: Optional[str] = None
    verbose: bool = False
    options: Options = None


class DeleteRequest(Named):
    pass


class CopyRequest(Wire):
    source: Optional[str] = None
    destination: Optional[str] = None


class TransferRequest(Named):
    """/api/pull and /api/push (Ollama's username and password are not read)."""

    insecure: bool = False
    stream: Optional[bool] = None  # absent or null: stream

    @property
    def streams(self) -> bool:
        return self.stream is not False


class CreateRequest(Named):
    stream: Optional[bool] = None
    modelfile: Optional[str] = None  # the older API: a Modelfile's text
    from_: Optional[str] = Field(default=None, alias="from")
    files: Optional[dict[str, str]] = None  # file name -> an uploaded blob's digest
    adapters: Optional[dict[str, str]] = None
    draft: Optional[str] = None  # a stored model that drafts for this one (a Corral extension)
    draft_files: Optional[dict[str, str]] = None  # or its uploaded GGUF, as Ollama sends it
    template: Optional[str] = None
    system: Optional[str] = None
    license: Union[str, list[str], None] = None
    parameters: Optional[dict[str, Any]] = None
    messages: Optional[list[dict[str, Any]]] = None  # checked by the registry's create
    quantize: Optional[str] = None
    quantization: Optional[str] = None  # the older spelling of quantize
    requantize: bool = False  # a Corral extension: quantize an already quantized model

    @property
    def streams(self) -> bool:
        return self.stream is not False


class RenderExtras(Wire):
    """/corral/render's own fields, beside a chat or generate body."""

    # Whose body it is: "ollama" (/api/chat or /api/generate), "openai" (chat
    # completions), "anthropic" (messages) or "responses"; left out, it is told by shape.
    api: Optional[Literal["ollama", "openai", "anthropic", "responses"]] = None
    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
