"""The errors the CLI and API turn into a clear message instead of a traceback."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or a missing prerequisite; the message says what to do. usage=True → exit 2 / HTTP 400,
    usage=False (the environment, not the request: a database that cannot be opened) → exit 1 / HTTP 503."""

    def __init__(self, message: str, *, usage: bool = True):
        super().__init__(message)
        self.usage = usage

    def __reduce__(self):  # pickled whole (the ingest process's errors reach the server so): usage and all
        return _rebuilt, (type(self), str(self), self.__dict__)


class Invalid(UserError):
    """A request's content that cannot be taken, at `field` (documents.3.text; HTTP 422 with it as the param)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class NotFound(UserError):
    """An id that names nothing (HTTP 404)."""


class Conflict(UserError):
    """The request is fine but collides with work under way (HTTP 409)."""


class Busy(UserError):
    """The queue is full: come back in `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _rebuilt(cls: type, message: str, state: dict) -> UserError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error
