"""A reply's text as the decoding loop commits tokens: what can be sent so far, cut before the first stop string."""

from __future__ import annotations

from ..models import Target


class ReplyText:
    """The reply decoded so far (the whole token list each time, so text is cut at character boundaries) and how much
    of it has been handed out. Held back until the next step: an incomplete multi-byte character, and the longest end
    of the text that begins a stop string (so a stop string split across steps is still found, and its first
    characters never sent). `stopped` once a stop string is found: `text` ends before its first occurrence."""

    def __init__(self, target: Target, stop: tuple[str, ...] = ()):
        self.target, self.stop = target, stop
        self.tokens: list[int] = []
        self.text = ""  # the reply so far, cut before the first stop string once `stopped`
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def add(self, token_ids) -> str:
        """Take one step's committed tokens; the text that can be sent now ('' when all of it is held back)."""
        self.tokens.extend(token_ids)
        text = self.target.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""  # the rest of a multi-byte character comes with a later token
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self.finish()
        self.text = text
        ready = len(text) - self._stop_prefix_length(text)
        return self._take(ready)

    def finish(self) -> str:
        """The reply ended: whatever was held back."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string begins in `text`, or None. Text already sent cannot hold one (it was held back
        while it could begin one), so the search starts at the first character not sent."""
        found = [at for at in (text.find(stop, self.sent) for stop in self.stop) if at >= 0]
        return min(found) if found else None

    def _stop_prefix_length(self, text: str) -> int:
        """The length of the longest end of `text` (after what was sent) that a stop string begins with."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
