"""The wire records of the runner's POST /rerank (runner/llama/rerank.py builds the prompts).

    daemon --RerankJob--> runner /rerank --Ranked-->
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corral.errors import BadRequest


@dataclass(frozen=True)
class RerankJob:
    """POST /rerank: a query and the documents to score against it."""

    query: str
    documents: tuple[str, ...]
    id: str = ""  # for /cancel
    max_tokens: int = 0  # every document's prompt together (0: no limit), as an embed's

    def to_json(self) -> dict[str, Any]:
        return {"query": self.query, "documents": list(self.documents), "id": self.id,
                "max_tokens": self.max_tokens}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "RerankJob":
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str):
            raise BadRequest("query must be a string")
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise BadRequest("documents must be a list of strings")
        limit = body.get("max_tokens") or 0
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise BadRequest("max_tokens must be a whole number, 0 or more")
        return cls(query, tuple(documents), str(body.get("id") or ""), limit)


@dataclass(frozen=True)
class Ranked:
    """What /rerank answers: a score per document, in the order sent, and the tokens
    evaluated for them all."""

    scores: list[float]
    prompt_eval_count: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"scores": self.scores, "prompt_eval_count": self.prompt_eval_count}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Ranked":
        return cls([float(s) for s in body.get("scores") or []],
                   int(body.get("prompt_eval_count") or 0))
