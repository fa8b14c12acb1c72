"""`ds4-mlx bench --parallel N`: N sessions decoding at once, their tokens in one step over the weights.

At each frontier, once the single-stream probe is done, N sessions stand at that frontier (the first session's
state, shared: MLX arrays are immutable, and each session's first step makes its own) and each is fed a different
token, so that the rows pick their own experts from the first step on, as independent conversations do. Then
`--gen-tokens` greedy steps of `session.decode_together`, every row's argmax read back in one transfer per step
(as the server's scheduler runs them, batch.py). Aggregate t/s counts every row's token; per stream, one row's.
A step is made and compiled once per frontier before the timing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..session import Session, Snapshot, decode_together

WARM_STEPS = 2
"""Steps run (and undone) at each frontier before the timed ones: the shared step's compilation and first use."""


@dataclass
class ParallelFigures:
    """One frontier's figures with N sessions, one entry per walk."""

    streams: int
    aggregate_tps: list[float] = field(default_factory=list)

    def row(self) -> dict:
        import statistics

        aggregate = statistics.median(self.aggregate_tps)
        return {"parallel": self.streams, "parallel_tps": round(aggregate, 3),
                "parallel_stream_tps": round(aggregate / self.streams, 3),
                "parallel_tps_min": round(min(self.aggregate_tps), 3),
                "parallel_tps_max": round(max(self.aggregate_tps), 3)}


PARALLEL_COLUMNS = ("parallel", "parallel_tps", "parallel_stream_tps", "parallel_tps_min", "parallel_tps_max")
"""With --parallel, after ds4-bench's columns: the sessions, the aggregate and per-stream t/s (median), the
aggregate's min and max."""


def measure(sessions: Sequence[Session], at_frontier: Snapshot, first_tokens: Sequence[int], steps: int,
            never: int) -> float:
    """Seconds of `steps` shared greedy steps of all `sessions` from `at_frontier`, fed `first_tokens` first (one
    per session); every session is left at the frontier."""
    def start() -> list[int]:
        for session in sessions:
            session.restore(at_frontier)
        return list(first_tokens)

    def step(tokens: list[int]) -> list[int]:
        rows = decode_together(sessions, tokens)
        logits = mx.stack(rows)
        logits[:, never] = -mx.inf  # the bench's EOS is never chosen, as in the single-stream probe
        return mx.argmax(logits, axis=-1).tolist()

    tokens = start()
    for _ in range(WARM_STEPS):
        tokens = step(tokens)
    tokens = start()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens)
    seconds = time.perf_counter() - t0
    start()
    return seconds
