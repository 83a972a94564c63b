"""The one error type the CLI and API turn into a clear message instead of a traceback."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or a missing prerequisite; the message says what to do. usage=True → exit 2 / HTTP 4xx."""

    def __init__(self, message: str, *, usage: bool = True):
        super().__init__(message)
        self.usage = usage
