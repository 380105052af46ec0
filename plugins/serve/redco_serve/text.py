"""A sample's text as its tokens arrive, for streaming: the whole text is decoded again at each
token (a token can change how the ones before it read, e.g. a character split over two tokens)
and only what can no longer change is sent. Held back: a trailing replacement character (the
rest of a character is still to come) and a tail that could be the start of a stop string. A
stop string ends the text before it."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        """Add ``token``; returns the text that is now certain and was not sent yet."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        found = [text.find(s) for s in self.stop if s in text]
        if found:
            self.text, self.stopped = text[:min(found)], True
            return self._send(len(self.text))
        self.text = text
        certain = len(text.rstrip("\ufffd"))
        for s in self.stop:  # the longest tail that a stop string starts with
            partial = next((k for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), 0)
            certain = min(certain, len(text) - partial)
        return self._send(certain)

    def finish(self) -> str:
        """What is left to send once the sample has ended."""
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta
