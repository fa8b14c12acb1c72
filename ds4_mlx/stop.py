"""Stop strings: find the earliest match in streamed text, holding back only what could still become one."""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Streams text through, cutting it before the first stop string.

    A stop string can straddle two deltas, so up to `longest - 1` characters are held back until the next delta
    shows whether they start a match.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

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
        keep = min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out
