"""The one event stream every front end consumes (CLI, chat, OpenAI, Anthropic).

The engine turns sampled token ids into these events through the incremental detokenizer and the DSML
parser; the `serve/` translators only reshape them into wire formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .reuse import Reuse


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call. `arguments` is a compact JSON object text in the order the model wrote the keys."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    """The final parse of one generated message.

    `raw_dsml` is the exact sampled tool block (from its leading "\\n\\n" when present to the closing tag),
    kept so that a later request can replay it byte for byte. `error` names a parse problem that did not
    stop the request (e.g. "invalid tool call", "unterminated tool call"). `reasoning_closed` is False when a
    thinking-mode message never wrote `</think>` (a non-streaming chat response then reports that text as
    content, ds4_server.c).
    """

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    raw_dsml: str = ""
    error: str = ""
    reasoning_closed: bool = True


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call was recognised (its invoke tag is complete); `index` counts calls from 0 in this message."""

    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A fragment of the call's JSON arguments text; the fragments concatenate to a JSON object."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class PromptAccepted:
    """The first event: the prompt fits, and `cached_tokens` of it are reused (`reuse` says from where, and where
    the prompt first differs from the live session when it did not extend it)."""

    prompt_tokens: int
    cached_tokens: int
    reuse: Reuse | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PrefillProgress:
    """Emitted between prefill chunks so that front ends can show progress or send keep-alives."""

    done: int
    total: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    """Of the completion tokens, those written while the reasoning was open (`</think>` included)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cache_write_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Done:
    """The last event of a generation.

    finish_reason is one of "stop", "length", "tool_calls", "error" (ds4_server.c).
    """

    finish_reason: str
    message: ParsedMessage
    usage: Usage
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    error: str = ""
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    mtp_drafted: int = 0
    """MTP guesses compared with the model's own greedy choice (speculative decoding, --mtp-draft >= 2)."""
    mtp_accepted: int = 0
    """Of those, the ones it agreed with."""
    reuse: Reuse | None = field(default=None, repr=False, compare=False)
    """The prompt's reuse decision, as in PromptAccepted."""


Event = PromptAccepted | ReasoningDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | PrefillProgress | Done
