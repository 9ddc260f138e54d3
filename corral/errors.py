"""The one error hierarchy, and the one formatter that turns an error into a response body.

Every package raises these; only `format_error` decides what a client sees.

    CorralError                  500  anything raised on purpose; the message is shown to users
    +-- BadRequest               400
    |   +-- InvalidName               a model name outside the name grammar
    |   +-- InvalidDigest             a digest that is not sha256:<64 hex>
    |   +-- DigestMismatch            content whose sha256 is not the digest announced
    |   +-- InvalidModelFile          a file that is not a well-formed GGUF
    |   +-- ModelfileError            a Modelfile or create request that cannot be applied
    |   +-- InvalidOption             an option of the wrong type or out of range
    |   +-- ContextOverflow           an input longer than the context, with truncation off
    +-- Unauthorized             401
    +-- Forbidden                403  foreign Host or Origin; answered with no body
    +-- NotFound                 404
    |   +-- ModelNotFound
    +-- MethodNotAllowed         405
    +-- PayloadTooLarge          413
    +-- ServerBusy               503  answered with Retry-After
    +-- NoSpace                  507  the disk is full; retrying will not help
    +-- Cancelled                499  the client left; the work stopped
    +-- RunnerError              500  the model runner failed or died
"""

from __future__ import annotations

import enum
from typing import Any


class CorralError(Exception):
    """Base of every error we raise on purpose. The message is shown to users."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(CorralError):
    status = 400


class InvalidName(BadRequest):
    """A model name that does not follow the name grammar."""


class InvalidDigest(BadRequest):
    def __init__(self, message: str = "invalid digest format") -> None:
        super().__init__(message)



class DigestMismatch(BadRequest):
    """Content whose sha256 is not the digest it was announced as."""


class InvalidModelFile(BadRequest):
    """A file that is not a well-formed GGUF model."""


class ModelfileError(BadRequest):
    """A Modelfile or create request that cannot be parsed or applied."""


class InvalidOption(BadRequest):
    """An option value out of range or of the wrong type."""


class ContextOverflow(BadRequest):
    """An input longer than the context when the caller asked not to truncate."""


class Unauthorized(CorralError):
    status = 401


class Forbidden(CorralError):
    status = 403


class NotFound(CorralError):
    status = 404


class ModelNotFound(NotFound):
    pass


class MethodNotAllowed(CorralError):
    status = 405


class PayloadTooLarge(CorralError):
    status = 413


class ServerBusy(CorralError):
    status = 503


class NoSpace(CorralError):
    """The disk is full; retrying will not help."""

    status = 507


class Cancelled(CorralError):
    """The client went away and the work was stopped; nobody reads the answer."""

    status = 499


class RunnerError(CorralError):
    """The model runner failed or died."""


class EngineFailed(RunnerError):
    """The runner's engine thread failed: the runner refuses work and exits, and the daemon
    forgets it at once, so the next request loads the model afresh."""


class Shape(str, enum.Enum):
    """Which API's error body a response uses."""

    OLLAMA = "ollama"  # {"error": message}
    OPENAI = "openai"  # {"error": {"message", "type", "param", "code"}}
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}
    COHERE = "cohere"  # {"message": message}
    RUNNER = "runner"  # {"error": message, "kind": class name}: the type survives the hop
    TEXT = "text"  # "404 page not found": what Ollama (gin) answers for unknown routes


_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 404: "not_found_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def format_error(exc: BaseException, shape: Shape = Shape.OLLAMA) -> tuple[int, Any]:
    """(status, body): a dict for JSON, a str for plain text, None for no body.

    Unknown exceptions never leak their details.
    """
    if isinstance(exc, CorralError):
        status, message = exc.status, exc.message
    else:
        status, message = 500, "internal server error"
    if status == 403:
        return status, None
    if shape is Shape.OPENAI:
        return status, {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "api_error"),
                                  "param": None, "code": None}}
    if shape is Shape.ANTHROPIC:
        return status, {"type": "error", "error": {
            "type": _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                         else "api_error"), "message": message}}
    if shape is Shape.RUNNER:
        kind = type(exc).__name__ if isinstance(exc, CorralError) else "CorralError"
        return status, {"error": message, "kind": kind}
    if shape is Shape.TEXT:
        return status, message
    if shape is Shape.COHERE:
        return status, {"message": message}
    return status, {"error": message}


def _subclasses(cls: type[CorralError]) -> dict[str, type[CorralError]]:
    found = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        found.update(_subclasses(sub))
    return found


def from_wire(status: int | None, body: Any) -> CorralError:
    """Rebuild the error a runner process formatted with Shape.RUNNER.

    `status` is the response's, or None for an error line inside a stream.
    """
    if not isinstance(body, dict):
        return RunnerError(f"runner answered {status}")
    message = str(body.get("error") or "runner error")
    cls = _subclasses(CorralError).get(str(body.get("kind")))
    if cls is None or (status is not None and cls.status != status):
        cls = BadRequest if status is not None and 400 <= status < 500 else RunnerError
    return cls(message)
