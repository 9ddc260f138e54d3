"""The one error hierarchy, and the one function that maps an error to HTTP.

Every package raises these; only `to_http` decides what a client sees.
"""

from __future__ import annotations


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


class Unauthorized(CorralError):
    status = 401


class Forbidden(CorralError):
    status = 403


class NotFound(CorralError):
    status = 404


class ModelNotFound(NotFound):
    pass


class PayloadTooLarge(CorralError):
    status = 413


class ServerBusy(CorralError):
    status = 503


class NoSpace(CorralError):
    """The disk is full; retrying will not help."""

    status = 507


class RunnerError(CorralError):
    """The model runner failed or died."""


def to_http(exc: BaseException) -> tuple[int, dict[str, str]]:
    """Map any exception to (status, JSON body). Unknown errors never leak details."""
    if isinstance(exc, CorralError):
        return exc.status, {"error": exc.message}
    return 500, {"error": "internal server error"}
