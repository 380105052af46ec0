"""A sample's text as its tokens arrive, for streaming, decoded incrementally: each new piece is
what ``decode(tokens[prefix:])`` adds to ``decode(tokens[prefix:read])`` (a few tokens of
context, so that a token reads as it does inside the whole text: a leading space, a character
split over two tokens), so a token costs the same at the end of a long text as at its start.
Held back: a piece ending in a replacement character (the rest of a character is still to come)
and a tail that could be the start of a stop string. A stop string ends the text before it."""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False
        self._prefix = self._read = 0  # tokens[_prefix:_read]: context; [_read:]: not in text

    def push(self, token: int) -> str:
        """Add ``token``; returns the text that is now certain and was not sent yet."""
        return self.extend([token])

    def extend(self, tokens: list[int]) -> str:
        """Add ``tokens``; returns the text that is now certain and was not sent yet."""
        self.tokens.extend(tokens)
        if self.stopped:
            return ""
        return self._grow(self._new_text(final=False))

    def finish(self) -> str:
        """What is left to send once the sample has ended (a last incomplete character too)."""
        if not self.stopped:
            self._grow(self._new_text(final=True))
        return self._send(len(self.text))

    def _new_text(self, final: bool) -> str:
        context = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        if len(text) <= len(context) or text.endswith(REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return text[len(context):]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def _grow(self, new: str) -> str:
        """``new`` appended to the text, cut at a stop string; what is certain is sent."""
        start = max(0, len(self.text) - max(map(len, self.stop), default=1) + 1)
        self.text += new
        found = [at for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self._send(len(self.text))
        certain = len(self.text)
        for s in self.stop:  # the longest tail that a stop string starts with
            partial = next((k for k in range(len(s) - 1, 0, -1) if self.text.endswith(s[:k])), 0)
            certain = min(certain, len(self.text) - partial)
        return self._send(certain)

    def _send(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta
