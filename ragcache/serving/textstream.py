"""Token ids in, text deltas out, for streaming answers.

The deltas concatenate to exactly the non-streamed answer, `decode(ids).strip()`: leading
whitespace is never sent, trailing whitespace is held back until more text follows it, and a
token that ends inside a multi-byte character waits for the rest of it.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""  # the text already handed out

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it makes final ("" while it is still open)."""
        self.ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""  # a partial character, or a decode that rewrote earlier text: wait
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self) -> str:
        """The rest, once no token follows."""
        text = self._text()
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta
