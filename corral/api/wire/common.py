"""Field types more than one API shares."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypedDict, Union

from pydantic import BeforeValidator, Field

from corral.api.wire import Wire

THINK_LEVELS = ("low", "medium", "high")
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # `n`: sequences that share one prompt, decoded side by side


def _think(raw: Any) -> bool | str | None:
    """Ollama's `think`: true, false, or a level ("true"/"false" as strings too). Ollama's
    newest level, "max", is "high" here: the templates that know levels (gpt-oss's
    `Reasoning:`, Jinja's `reasoning_effort`) know no higher one."""
    if raw is None or isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() == "max":
        return "high"
    if isinstance(raw, str) and raw.lower() in THINK_LEVELS:
        return raw.lower()
    if raw in ("true", "false"):
        return raw == "true"
    raise ValueError(f"invalid think value: {raw!r} (must be true, false, \"low\", "
                     "\"medium\", \"high\" or \"max\")")


Think = Annotated[Union[bool, str, None], BeforeValidator(_think)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
KeepAlive = Union[str, int, float, None]
Options = Union[dict[str, Any], None]


class InputAudio(Wire):
    data: str  # base64
    format: Optional[str] = None  # "wav" or "mp3" in OpenAI's words; the bytes decide


class AudioPart(Wire):
    """OpenAI's `input_audio` content part, the same in chat and in the Responses API."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class FunctionSpec(Wire):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})


class FunctionTool(Wire):
    """A tool as Ollama and OpenAI chat name it: {"type": "function", "function": {...}}."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(Wire):
    name: str


class FunctionChoice(Wire):
    """OpenAI chat's forced call: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: NamedFunction


ChatToolChoice = Union[Literal["auto", "none", "required"], FunctionChoice, None]


class Timings(TypedDict):
    """llama-server's `timings` (server-common.cpp, server_slot_stats::to_json): the
    prompt's and the output's counts and milliseconds, and speculative decoding's drafted
    and accepted tokens, which llama-server writes only when it drafted and Corral always
    (0 when nothing was drafted)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int
    draft_n_accepted: int
