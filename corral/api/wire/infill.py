"""llama-server's POST /infill request (tools/server/server-context.cpp `post_infill`),
with a `model` for a daemon that serves many: left out, it means the one loaded."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field

from corral.api.wire import Wire

# llama-server's sampling defaults (common/common.h), which an /infill client expects
# where Ollama's differ (top_p 0.95, min_p 0.05).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0}


class ExtraChunk(Wire):
    """Another file of the project: {filename, text}."""

    text: str
    filename: str = "tmp"


class InfillRequest(Wire):
    model: Optional[str] = None
    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    n_indent: int = 0  # stop at a line indented less than this, once a line has ended
    t_max_predict_ms: int = 0  # stop at a new line once generating took this long
    n_predict: int = -1
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[list[str], None] = None
    ignore_eos: bool = False
    cache_prompt: bool = True  # Corral always reuses what it can
    stream: bool = False
    keep_alive: Union[str, int, float, None] = None

    def options(self) -> dict[str, object]:
        """The request's sampling, over llama-server's defaults, as Corral's options."""
        given = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                 "min_p": self.min_p, "seed": self.seed}
        opts: dict[str, object] = {**DEFAULTS, **{k: v for k, v in given.items()
                                                  if v is not None}}
        opts["num_predict"] = self.n_predict
        if self.stop:
            opts["stop"] = list(self.stop)
        if self.ignore_eos:
            opts["ignore_eos"] = True
        return opts
