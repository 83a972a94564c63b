"""Token ids in, text deltas out, for streaming answers.

The deltas concatenate to exactly the non-streamed answer, `decode(ids).strip()`: leading
whitespace is never sent, trailing whitespace is held back until more text follows it, and a
token that ends inside a multi-byte character waits for the rest of it.

Stop strings (OpenAI's `stop`): the answer ends before the first one the model writes. Text that could be the
start of one is held back until the next token settles it, so no delta ever holds any part of a stop string.

Incremental: each token decodes only the window since the last complete text (a token or two, a few
more while a character is split across tokens), never the whole answer again — the model thread pays
O(1) per token, not O(answer length).
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.stopped = False  # a stop string was written: the answer ended before it
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
        if self.stops:  # a stop starts in the text not yet sent: whatever could begin one was held back
            found = [at for at in (text.find(s) for s in self.stops) if at >= 0]
            if found:  # the answer ends here
                text, final, self.stopped = text[:min(found)], True, True
        body = text.rstrip()
        if self.stops and not final:
            body = body[:len(body) - self._open(body)].rstrip()  # its whitespace held too
        self._held = "" if final else text[len(body):]
        self.sent += body
        return body

    def _open(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop string (held back until settled)."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it makes final ("" while it is still open). Once `stopped`, the
        caller stops pushing."""
        self.ids.append(token_id)
        new = self._new_text(final=False)
        return "" if new is None else self._hand_out(new, final=False)

    def finish(self) -> str:
        """The rest, once no token follows."""
        if self.stopped:
            return ""
        return self._hand_out(self._new_text(final=True) or "", final=True)
