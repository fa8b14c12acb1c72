"""In-memory session checkpoints (`--kv-ram-budget`): exact states that agents come back to.

Agents resend what they sent before: a retry after a timeout, a regeneration, the same request with a reminder
appended to its last message, a side request (a title, a summary) between two turns of the main conversation.
The live session cannot go back (its state is only valid at its end), so the engine keeps snapshots where such
requests land: the end of each prompt (before generation), the start of its last message, the chunk boundaries
of long prefills, and the live session when another conversation replaces it. A new prompt is matched against
them by tokens (ids given by the caller) or by text (a rendered prompt whose ids differ after the snapshot), the
longest match wins, its state is restored and only the rest is prefilled.

Snapshots cost no copy when taken (MLX arrays are immutable), but every array a snapshot holds stays alive, so
they are kept within a byte budget (by default what the device memory budget leaves, memory.py), least recently
used first out; a prefill chunk short of device memory drops the oldest first. The budget counts each array once
however many snapshots share it (a state's arrays are shared until the layer they belong to is updated).

Of a model split across ranks (model/shard.py) every rank keeps the same checkpoints, or a prompt restored on one
rank and prefilled whole on another would send them different work: they take the same states in the same order,
so only what is measured per rank could set them apart. The budget is the least of the ranks' (the engine agrees
it), and whether the checkpoints exceed it is asked of every rank (`anywhere`: a pipeline rank holds the rows of
its own layers only, so the ranks' byte counts differ); a prefill chunk short of memory on one rank drops the
oldest on every rank (memory.lacks_room).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..session import Snapshot

log = logging.getLogger("ds4_mlx.cache.checkpoints")


def snapshot_arrays(snapshot: Snapshot) -> list[mx.array]:
    """Every array a snapshot keeps alive: the cache state, the logits, and the draft block's state."""
    arrays = list(snapshot.cache.arrays())
    if snapshot.logits is not None:
        arrays.append(snapshot.logits)
    mtp = snapshot.mtp
    if mtp is not None:
        arrays += mtp.arrays()
    return arrays


@dataclass
class Checkpoint:
    """One kept state: the snapshot, when it was last taken or used (a tick of the store's clock), and the UTF-8
    bytes its tokens spell (what a later prompt's text must start with; spelled when first compared)."""

    snapshot: Snapshot
    used: int
    text: bytes | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.snapshot.tokens)


@dataclass(frozen=True)
class Match:
    """A checkpoint that starts a prompt; `by_text` when only its text does (its ids are kept, the rest of the
    prompt text is tokenized after them)."""

    checkpoint: Checkpoint
    by_text: bool


class CheckpointStore:
    """Snapshots by token sequence, within `budget_bytes`; least recently used are dropped first."""

    def __init__(self, budget_bytes: int, spell: Callable[[Sequence[int]], bytes],
                 anywhere: Callable[[bool], bool] | None = None) -> None:
        """`spell`: the bytes of a token run; `anywhere`: whether a flag holds on any rank of a split model (None:
        in one process, the flag itself)."""
        if budget_bytes < 0:
            raise ValueError(f"the checkpoint budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._spell = spell
        self._anywhere = anywhere or (lambda flag: flag)
        self._items: dict[tuple[int, ...], Checkpoint] = {}
        self._clock = 0
        self.evictions = 0
        """Checkpoints dropped to stay within the budget (for /metrics)."""
        self.held_bytes = 0
        """`nbytes` as of the last change, readable from another thread (for /metrics)."""

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the checkpoints hold, each array counted once."""
        seen: dict[int, int] = {}
        for item in self._items.values():
            for array in snapshot_arrays(item.snapshot):
                seen[id(array)] = array.nbytes
        return sum(seen.values())

    def positions(self) -> list[int]:
        """The token counts of the kept states, shortest first (for logs and tests)."""
        return sorted(item.n_tokens for item in self._items.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def add(self, snapshot: Snapshot) -> None:
        """Keep a state (an equal token sequence is the same state: it is only marked used), then drop the least
        recently used until the rest fits the budget. An empty state is not kept."""
        if not snapshot.tokens or self.budget_bytes == 0:
            return
        item = self._items.get(snapshot.tokens)
        if item is not None:
            item.used = self._tick()
            return
        self._items[snapshot.tokens] = Checkpoint(snapshot, self._tick())
        self._fit()

    def _fit(self) -> None:
        while self._items and self._anywhere(self.nbytes > self.budget_bytes):
            key = min(self._items, key=lambda k: self._items[k].used)
            log.debug("checkpoint of %d tokens evicted (budget %d bytes)", len(key), self.budget_bytes)
            del self._items[key]
            self.evictions += 1
        self.held_bytes = self.nbytes

    def drop_oldest(self) -> bool:
        """Drops the least recently used checkpoint (a prefill short of device memory asks); False when none is
        kept."""
        if not self._items:
            return False
        key = min(self._items, key=lambda k: self._items[k].used)
        log.info("checkpoint of %d tokens dropped: a prefill chunk needs its memory", len(key))
        del self._items[key]
        return True

    def find(self, tokens: Sequence[int], text: bytes | None, longer_than: int = 0) -> Match | None:
        """The longest checkpoint of more than `longer_than` tokens that starts the prompt: its ids start `tokens`,
        or (when the prompt's `text` is given) its text starts `text` and ends on a character boundary there."""
        for item in sorted(self._items.values(), key=lambda c: c.n_tokens, reverse=True):
            n = item.n_tokens
            if n <= longer_than:
                return None
            if n <= len(tokens) and tuple(tokens[:n]) == item.snapshot.tokens:
                return Match(item, by_text=False)
            if text is None:
                continue
            if item.text is None:
                item.text = self._spell(item.snapshot.tokens)
            if text.startswith(item.text) and _starts_character(text, len(item.text)):
                return Match(item, by_text=True)
        return None

    def use(self, match: Match) -> Snapshot:
        """The matched state, marked used."""
        match.checkpoint.used = self._tick()
        return match.checkpoint.snapshot

    def clear(self) -> None:
        self._items.clear()
        self.held_bytes = 0


def _starts_character(data: bytes, offset: int) -> bool:
    """Whether `offset` is at the end of `data` or at the first byte of a UTF-8 character in it."""
    return offset == len(data) or data[offset] & 0xC0 != 0x80
