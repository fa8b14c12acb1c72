"""Stop strings: find the earliest match in streamed text, holding back only what could still become one."""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Streams text through, cutting it before the first stop string.

    A stop string can straddle two deltas, so the end of the text is held back while it is the start of a stop
    string, and only then: text that cannot begin a match flows through at once.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.hit = False

    def _held(self) -> int:
        """Length of the longest end of `pending` that is a proper prefix of some stop string."""
        for n in range(min(len(self.pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def feed(self, text: str) -> str:
        """Returns the text that is now safe to emit; after a hit, returns the text before it and then nothing."""
        if self.hit:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = self._held()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out
