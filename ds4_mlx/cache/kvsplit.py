"""The disk KV cache of a model split across ranks (model/shard.py): each rank keeps its own files, and every rank
loads a checkpoint or none.

Each rank writes the state it holds (a tensor split's rank: the whole state, which every rank keeps alike; a
pipeline's rank: the rows of its own layers) to a directory of its own under `--kv-disk-dir`,
`split-<kind>-<ranks>-rank<r>` (`rank_options`), so ranks that share a disk never share a file. The identity every
file carries names the split and the rank's slices (kvidentity.py), so a file of another split, share or rank is
never loaded, wherever it lies.

The ranks' directories can differ: a write that failed on one rank, a file one rank's budget evicted or that was
deleted by hand. Loading on some ranks only would leave their states apart, so a lookup is agreed (`agreed_load`):
at each round the ranks agree on the longest text any of them still has a candidate for, each loads its file of
that text if it has one, and the checkpoint is used only where every rank loaded one and all hold the same tokens
(two exchanges: the length, then whether all loaded and the digest of their tokens); else every rank passes on to
shorter texts. Likewise a save counts as on disk (which decides where the next continued checkpoint is taken) only
where every rank saved (`agreed_saved`). In one process both are what they were: the first candidate that loads,
the save's own result.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .kvstore import KvCacheOptions, KvEntry, KvHit

if TYPE_CHECKING:
    from ..model.shard import Split

log = logging.getLogger("ds4_mlx.cache.kvsplit")

Attempt = Callable[[KvEntry], tuple[KvHit, list[int]] | None]
"""Loads a candidate for the prompt: the hit and the prompt's effective tokens, or None where it does not serve."""


def rank_options(options: KvCacheOptions, split: Split) -> KvCacheOptions:
    """The options of this rank's own directory under `options.directory`."""
    return replace(options, directory=options.directory / f"split-{split.kind}-{split.size}-rank{split.rank}")


def agreed_load(split: Split | None, candidates: Iterable[KvEntry], attempt: Attempt
                ) -> tuple[KvHit, list[int]] | None:
    """The checkpoint every rank loads (best first, as `KvStore.candidates` lists them), or None on every rank."""
    if split is None:
        return next((found for entry in candidates if (found := attempt(entry)) is not None), None)
    left = list(candidates)
    while True:
        longest = -split.least(-(left[0].text_bytes if left else -1))
        if longest < 0:
            return None
        here = [entry for entry in left if entry.text_bytes == longest]
        left = [entry for entry in left if entry.text_bytes < longest]
        found = attempt(here[0]) if here else None
        digest = tokens_digest(found[0].tokens) if found is not None else -1
        loaded, low, high = split.least_of([int(found is not None), digest, -digest])
        if loaded and low == -high:
            return found
        if found is not None:
            log.info("kv cache: %s is not used: not every rank holds a checkpoint of its %d tokens",
                     found[0].entry.path, len(found[0].tokens))


def agreed_saved(split: Split | None, saved: bool) -> bool:
    """Whether a checkpoint was saved: on every rank of a split model."""
    return saved if split is None else split.every(saved)


def tokens_digest(tokens: list[int]) -> int:
    """A 31-bit digest of token ids (CRC-32): what the ranks compare before using the checkpoints they loaded."""
    return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) & 0x7FFFFFFF
