"""The errors the CLI and API turn into a clear message instead of a traceback."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or a missing prerequisite; the message says what to do. usage=True → exit 2 / HTTP 400,
    usage=False (the environment, not the request: a database that cannot be opened) → exit 1 / HTTP 503."""

    def __init__(self, message: str, *, usage: bool = True):
        super().__init__(message)
        self.usage = usage


class NotFound(UserError):
    """An id that names nothing (HTTP 404)."""


class Conflict(UserError):
    """The request is fine but collides with work under way (HTTP 409)."""


class Busy(UserError):
    """The queue is full: come back in `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
