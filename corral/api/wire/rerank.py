"""The rerank routes' requests: Jina's (llama-server's /v1/rerank, /rerank, /v1/reranking)
and Cohere's v2 /v2/rerank. Both are {model, query, documents, top_n}; a document is a
string, or Jina's {"text"}. Response records are the TypedDicts beside them."""

from __future__ import annotations

from typing import Optional, TypedDict, Union

from pydantic import Field

from corral.api.wire import Wire
from corral.api.wire.common import KeepAlive


class TextDocument(Wire):
    text: str


Document = Union[str, TextDocument]


class RerankRequest(Wire):
    """POST /v1/rerank (Jina, llama-server) and /v2/rerank (Cohere v2)."""

    model: Optional[str] = None
    query: str
    documents: list[Document]
    top_n: Optional[int] = Field(default=None, ge=1)
    return_documents: bool = False  # llama-server never returns them; Jina may be asked
    keep_alive: KeepAlive = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankDocument(TypedDict):
    text: str


class _Result(TypedDict):
    index: int
    relevance_score: float


class RerankResult(_Result, total=False):
    document: RerankDocument  # with return_documents


class RerankUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class JinaRerank(TypedDict):
    """/v1/rerank's answer, as llama-server's format_response_rerank writes it."""

    model: str
    object: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereRerank(TypedDict):
    """/v2/rerank's answer, as Cohere's v2 API (`meta.billed_units.search_units`: one
    search, as Cohere counts up to 100 documents of a query)."""

    id: str
    results: list[RerankResult]
    meta: dict[str, object]
