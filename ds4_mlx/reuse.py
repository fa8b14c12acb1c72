"""Why a prompt's prefix was or was not reused: where the reused state came from, and where a prompt that does not
extend the live session first differs from it.

Agents resend the whole conversation each turn and expect it to extend the last one. When a client changes an
earlier part (a timestamp in the system prompt, re-serialized tool schemas, dropped reasoning), the prompt stops
extending the live session and is prefilled again; the first differing token and the text on both sides of it show
which change did that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

SOURCES = ("live", "ram", "disk", "none")
"""Where reused tokens come from: the live session, an in-memory checkpoint, a disk checkpoint, nowhere."""
CONTEXT_TOKENS = 8
"""Tokens of text shown on each side of the first difference."""


@dataclass(frozen=True)
class Miss:
    """Where a prompt first differs from the live session it did not extend: the token `index` (the same in both,
    since the tokens before it are equal), the text of the tokens just `before` it, and the text from it on in the
    live session (`was`) and in the new prompt (`now`)."""

    index: int
    before: str
    was: str
    now: str


@dataclass(frozen=True)
class Reuse:
    """The reuse decision for one prompt: `tokens` reused from `source`, and the miss against the live session
    when the prompt did not extend it (None when it did, or when the session was empty)."""

    source: str
    tokens: int
    miss: Miss | None = None

    def describe(self) -> str:
        """One line for the log, the trace and the `x-ds4-reuse` header (text escaped to printable ASCII)."""
        line = f"{self.source} {self.tokens}"
        if self.miss is not None:
            m = self.miss
            line += (f"; differs from the live session at token {m.index}, after {_ascii(m.before)}: "
                     f"was {_ascii(m.was)} now {_ascii(m.now)}")
        return line


def first_difference(live: Sequence[int], prompt: Sequence[int], tokenizer: Tokenizer) -> Miss | None:
    """The miss of `prompt` against the `live` tokens, or None when the prompt starts with all of them."""
    n = min(len(live), len(prompt))
    index = next((i for i in range(n) if live[i] != prompt[i]), n)
    if index == len(live):
        return None

    def after(tokens: Sequence[int]) -> str:
        return tokenizer.decode(tokens[index : index + CONTEXT_TOKENS])

    return Miss(index, tokenizer.decode(prompt[max(0, index - CONTEXT_TOKENS) : index]), after(live), after(prompt))


def _ascii(text: str) -> str:
    """`text` quoted with every non-printable or non-ASCII character escaped, so that it fits an HTTP header."""
    escaped = text.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return f'"{escaped}"'


def rest_after(prompt: bytes, prefix: bytes) -> str | None:
    """The text of `prompt` after `prefix`, if `prefix` is its byte prefix and ends on a character boundary."""
    if not prompt.startswith(prefix):
        return None
    rest = prompt[len(prefix) :]
    if rest and rest[0] & 0xC0 == 0x80:
        return None  # the prefix ends inside a character: the rest is not text on its own
    return rest.decode("utf-8")
