"""Fill-in-the-middle prompts, assembled as llama-server's `format_prompt_infill`
(tools/server/server-common.cpp) assembles them, as a pure function of token lists.

    [BOS] [FIM_REP]myproject\n [FIM_SEP]name\n text ... [FIM_SEP]filename\n
          [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The repo-level head (arXiv 2409.12186) is there when the vocabulary has `fim_rep` and
`fim_sep`; without `fim_sep` each extra file is set off by llama-server's
"--- snippet ---" line instead. The prefix keeps its last 3/4 of a batch, the suffix its
first quarter less the prompt, and the extra files fill what is left of the context
(their tail is kept). `prompt` (read with control tokens as tokens) ends the prefix, where
llama-server puts it. llama-server reads its own --batch-size and --n-predict for these
budgets, not the request's: Corral reads their defaults (FIM_BATCH, FIM_PREDICT), so a
prompt is llama-server's for an unflagged llama-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from corral.errors import BadRequest
from corral.registry.fim import missing

FIM_BATCH = 2048  # llama-server's default --batch-size (common_params.n_batch)
FIM_PREDICT = -1  # llama-server's default --n-predict
NULL = -1  # LLAMA_TOKEN_NULL
# An infill's cached suffix is shifted into place behind a prefix that grew, in chunks of
# at least this many tokens (llama-server's --cache-reuse, which llama.vscode sets to 256;
# a suffix of a few lines is shorter than that).
FIM_REUSE = 16
REPO = "myproject\n"  # llama-server's project name ("TODO: make project name an input")
LAST_FILE = "filename\n"  # and the current file's ("TODO: current filename")
SNIPPET = "\n\n--- snippet ---\n\n"  # the chunk separator without fim_sep

Tokenize = Callable[[str, bool], list[int]]  # (text, parse_special) -> ids, never BOS


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's FIM ids (llama_vocab_fim_*), NULL where it has none, and the BOS
    to put first (NULL when the vocabulary adds none)."""

    pre: int = NULL
    suf: int = NULL
    mid: int = NULL
    rep: int = NULL
    sep: int = NULL
    bos: int = NULL

    def missing(self) -> str:
        """llama-server's reason an infill cannot run, or ""."""
        ids = {"pre": self.pre, "suf": self.suf, "mid": self.mid}
        return missing(frozenset(role for role, tok in ids.items() if tok != NULL))


@dataclass(frozen=True)
class Infill:
    """An infill request's text: what /infill sends, or /api/generate's prompt and suffix."""

    prefix: str = ""
    suffix: str = ""
    extra: tuple[tuple[str, str], ...] = ()  # (filename, text) of other files
    prompt: str = ""  # after the prefix
    # /infill's budgets of prefix and suffix (llama-server's); /api/generate's suffix takes
    # them whole, as Ollama does, and a prompt over the context is then truncated as any.
    budgets: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "suffix": self.suffix, "prompt": self.prompt,
                "extra": [{"filename": f, "text": t} for f, t in self.extra],
                "budgets": self.budgets}

    @classmethod
    def from_json(cls, body: Any) -> Infill:
        if not isinstance(body, dict):
            raise BadRequest("infill must be an object")
        texts = [body.get(k, "") for k in ("prefix", "suffix", "prompt")]
        extra = body.get("extra") or []
        if not all(isinstance(t, str) for t in texts) or not isinstance(extra, list) or \
                not all(isinstance(c, dict) and isinstance(c.get("filename", ""), str)
                        and isinstance(c.get("text"), str) for c in extra):
            raise BadRequest("infill must hold strings and {filename, text} chunks")
        budgets = body.get("budgets", True)
        if not isinstance(budgets, bool):
            raise BadRequest("infill budgets must be a boolean")
        return cls(texts[0], texts[1], tuple((c.get("filename", "tmp"), c["text"])
                                             for c in extra), texts[2], budgets)


def infill_tokens(infill: Infill, fim: FimTokens, tokenize: Tokenize, n_ctx: int,
                  n_batch: int = FIM_BATCH, n_predict: int = FIM_PREDICT) -> list[int]:
    """The prompt llama-server's /infill evaluates for `infill` in a slot of `n_ctx`; with
    `infill.budgets` off (/api/generate's suffix), the prefix and suffix whole."""
    if fim.missing():
        raise BadRequest(f"Infill is not supported by this model: {fim.missing()}")
    prefix, suffix = tokenize(infill.prefix, False), tokenize(infill.suffix, False)
    prompt = tokenize(infill.prompt, True)
    extra = _extra(infill.extra, fim, tokenize)
    take_prefix = min(len(prefix), 3 * (n_batch // 4)) if infill.budgets else len(prefix)
    take_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt)))) \
        if infill.budgets else len(suffix)
    take_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim.pre] + prefix[len(prefix) - take_prefix:] + prompt
    tail = [fim.suf] + suffix[:take_suffix]
    bos = [fim.bos] if fim.bos != NULL else []
    return extra[len(extra) - take_extra:] + bos + head + tail + [fim.mid]


def _extra(chunks: tuple[tuple[str, str], ...], fim: FimTokens,
           tokenize: Tokenize) -> list[int]:
    """The other files, each after its name (or a snippet line), then the current file's."""
    out: list[int] = []
    if fim.rep != NULL:
        out += [fim.rep] + tokenize(REPO, False)
    for filename, text in chunks:
        if fim.sep != NULL:
            out += [fim.sep] + tokenize(filename + "\n", False)
        else:
            out += tokenize(SNIPPET, False)
        out += tokenize(text, False)
    if fim.sep != NULL:
        out += [fim.sep] + tokenize(LAST_FILE, False)
    return out
