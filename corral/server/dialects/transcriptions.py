"""OpenAI's /v1/audio/transcriptions: a multipart upload, answered as a chat about the clip.

Ollama and llama-server both turn the upload into a chat request whose one user message
holds the clip, and read the reply back as the transcript; this does the same, with
llama-server's instruction ("Transcribe audio to text", the form's `prompt` in its place,
the `language` after it, the clip last), so the prompt is the one llama-server builds
for the same model. The form's fields are OpenAI's: `file`, `model`, `prompt`, `language`,
`response_format` (`json`, `text` or `verbose_json`), `temperature` (0 unless given:
a transcript is not creative writing) and `stream`, which sends OpenAI's
`transcript.text.delta` and `transcript.text.done` events; and llama-server's
`max_tokens`, which bounds the transcript (left out, the clip's length does: a
random or looping model would otherwise talk on to the end of its context). The upload
must be audio (WAV, MP3 or FLAC, what mtmd decodes): anything else, a picture included,
is refused by name before the model is asked, as every clip is checked
(server.chat.audio), within the daemon's body limit (CORRAL_MAX_BODY).
"""

from __future__ import annotations

import base64
from typing import Any, Iterator

from corral.errors import BadRequest, CorralError, Shape, format_error
from corral.server.chat.audio import check_clip
from corral.server.chat.messages import Message, placed_text
from corral.server.chat.models import require_model
from corral.server.chat.reply import Kind
from corral.server.dialects.openai import Stream
from corral.server.dialects.stream import SSE, respond
from corral.server.http import Handler, Request, Route
from corral.server.pipeline.request import ChatTask, Event, Finished
from corral.server.pipeline.run import run
from corral.server.pipeline.services import Services

INSTRUCTION = "Transcribe audio to text"  # llama-server's (common_chat_get_asr_prompt)
FORMATS = ("json", "text", "verbose_json")
# The default bound: speech is 2-4 tokens a second in the tokenizers of today's audio
# models; eight a second and a floor leave room for dense speech and a language tag.
TOKENS_PER_SECOND = 8
MIN_TOKENS = 64


def token_bound(fields: dict[str, str], seconds: float, own: int | None) -> int:
    """The transcript's most tokens: the form's `max_tokens`, else the clip's length's,
    or the model's own num_predict where that is less."""
    given = fields.get("max_tokens")
    if given is None or given == "":
        bound = max(MIN_TOKENS, int(seconds * TOKENS_PER_SECOND) + 1)
        return min(bound, own) if own is not None and own >= 0 else bound
    try:
        bound = int(given)
    except ValueError:
        raise BadRequest("max_tokens must be a whole number") from None
    if bound < 1:
        raise BadRequest("max_tokens must be at least 1")
    return bound


def read_form(request: Request) -> tuple[dict[str, str], bytes]:
    """The form's text fields and the `file` part's bytes, parsed by python-multipart
    from the body the transport already read whole (within CORRAL_MAX_BODY)."""
    from python_multipart.multipart import FormParser, parse_options_header

    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise BadRequest("the request must be multipart/form-data with a file")
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}

    def on_field(field: Any) -> None:
        value = field.value or b""
        fields[field.field_name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")

    def on_file(part: Any) -> None:
        part.file_object.seek(0)
        files[part.field_name.decode("utf-8", "replace")] = part.file_object.read()

    body = request.body()
    parser = FormParser("multipart/form-data", on_field, on_file, boundary=params[b"boundary"],
                        config={"MAX_MEMORY_FILE_SIZE": len(body) + 1})
    try:
        parser.write(body)
        parser.finalize()
    except Exception as exc:  # noqa: BLE001 - the parser's errors are the client's
        raise BadRequest(f"the multipart form could not be parsed: {exc}") from None
    if "file" not in files:
        raise BadRequest("file is required")
    if not files["file"]:
        raise BadRequest("the audio file is empty")
    return fields, files["file"]


def task_of(fields: dict[str, str], clip: bytes, template: str, limit: int) -> ChatTask:
    """The chat that asks for the transcript, as llama-server builds it
    (convert_transcriptions_to_chatcmpl): the instruction, or the form's prompt, then the
    language, then the clip; an LFM2 template's model gets its own preset, the system
    message "Perform ASR." and no instruction (common_chat_get_asr_prompt)."""
    if fields.get("response_format", "json") not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}")
    lfm2 = "<|tool_list_start|>" in template and "<|tool_list_end|>" in template
    text = fields.get("prompt") or ("" if lfm2 else INSTRUCTION)
    if fields.get("language"):
        text += f" (language: {fields['language']})"
    try:
        temperature = float(fields.get("temperature") or 0.0)
    except ValueError:
        raise BadRequest("temperature must be a number") from None
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest("temperature must be between 0 and 2")
    image = base64.b64encode(clip).decode("ascii")
    messages = [Message("system", "Perform ASR.")] if lfm2 else []
    # The clip after the text, where llama-server puts its media marker.
    messages.append(Message("user", placed_text([text, None]), (image,)))
    return ChatTask(model=require_model(fields.get("model")), messages=messages,
                    options={"temperature": temperature, "num_predict": limit}, think=False)


class Transcript:
    """OpenAI's transcription bodies and events, from the chat's pieces."""

    content_type = SSE

    def __init__(self, response_format: str, language: str, seconds: float) -> None:
        self.response_format, self.language, self.seconds = response_format, language, seconds

    sse = staticmethod(Stream.sse)  # OpenAI's framing, as the chat stream's

    def error_frame(self, exc: CorralError) -> bytes:
        return self.sse(format_error(exc, Shape.OPENAI)[1])

    def frames(self, events: Iterator[Event]) -> Iterator[bytes]:
        text: list[str] = []
        for event in events:
            if isinstance(event, Finished):
                yield self.sse({"type": "transcript.text.done", "text": "".join(text).strip(),
                                "usage": _usage(event)})
            elif event.kind is Kind.CONTENT and event.text:
                text.append(event.text)
                yield self.sse({"type": "transcript.text.delta", "delta": event.text})

    def whole(self, events: Iterator[Event]) -> Any:
        text, final = [], Finished()
        for event in events:
            if isinstance(event, Finished):
                final = event
            elif event.kind is Kind.CONTENT:
                text.append(event.text)
        transcript = "".join(text).strip()
        if self.response_format == "text":
            return transcript
        if self.response_format == "verbose_json":  # no segments: there are no timestamps
            return {"task": "transcribe", "language": self.language or "unknown",
                    "duration": self.seconds, "text": transcript,
                    "usage": {"type": "duration", "seconds": self.seconds}}
        return {"text": transcript, "usage": _usage(final)}


def _usage(final: Finished) -> dict[str, Any]:
    return {"type": "tokens", "input_tokens": final.prompt_tokens,
            "output_tokens": final.eval_count,
            "total_tokens": final.prompt_tokens + final.eval_count}


def transcriptions(services: Services) -> Route:
    def route(req: Request, handler: Handler) -> None:
        fields, clip = read_form(req)
        view = services.models.view(require_model(fields.get("model")))
        # Audio or nothing: a picture would be "transcribed" by a vision model.
        seconds = check_clip(clip, 0, services.settings).seconds
        limit = token_bound(fields, seconds, view.options({}).num_predict)
        task = task_of(fields, clip, view.template, limit)
        renderer = Transcript(fields.get("response_format", "json"), fields.get("language", ""),
                              round(seconds, 3))
        stream = fields.get("stream", "false").lower() == "true"
        if renderer.response_format == "text" and not stream:
            events = run(services, task, req.on_disconnect)
            handler.send_text(200, renderer.whole(events))
            return
        respond(handler, run(services, task, req.on_disconnect), renderer, stream)
    return route
