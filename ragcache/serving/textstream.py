"""Token ids in, text deltas out, for streaming answers.

The deltas concatenate to exactly the non-streamed answer, `decode(ids).strip()`: leading
whitespace is never sent, trailing whitespace is held back until more text follows it, and a
token that ends inside a multi-byte character waits for the rest of it.

Incremental: each token decodes only the window since the last complete text (a token or two, a few
more while a character is split across tokens), never the whole answer again — the model thread pays
O(1) per token, not O(answer length).
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""  # the text already handed out
        self._start = 0  # ids[_start:] is the window decoded each push
        self._read = 0  # ids[_start:_read] is the window's part already turned into text
        self._held = ""  # trailing whitespace not yet sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, final: bool) -> str | None:
        """The text the window adds past its part already read; None while it is open (a partial character,
        or a decode that rewrote the read part: wait for more tokens)."""
        window, seen = self._decode(self.ids[self._start:]), self._decode(self.ids[self._start:self._read])
        if not window.startswith(seen):
            return "" if final else None  # what was sent stays as it was sent
        if window.endswith("\ufffd") and not final:
            return None
        self._start, self._read = self._read, len(self.ids)
        return window[len(seen):]

    def _hand_out(self, text: str, final: bool) -> str:
        text = self._held + text
        if not self.sent:
            text = text.lstrip()
        body = text.rstrip()
        self._held = "" if final else text[len(body):]
        self.sent += body
        return body

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it makes final ("" while it is still open)."""
        self.ids.append(token_id)
        new = self._new_text(final=False)
        return "" if new is None else self._hand_out(new, final=False)

    def finish(self) -> str:
        """The rest, once no token follows."""
        return self._hand_out(self._new_text(final=True) or "", final=True)
