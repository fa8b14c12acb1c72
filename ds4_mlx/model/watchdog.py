"""A rank of a split model (model/shard.py) that waits too long on the others ends the run with one line.

MLX's ring backend has no timeout: a rank whose peer hangs (a stopped process, a stalled link) would wait in its
next sum forever. Here each rank runs one thread over a deadline. Every place that hands the rank work involving
the others moves the deadline on (`beat`): each model call (a prefill chunk, a decode step, a B-row step, the LM
head a drafter calls), each agreement (`Split.agree`, `Split.least`) and each round `serve` relays. MLX evaluates
lazily, so the sums a call builds are waited for after the call returns, before the next beat: the time between
two beats is the time a rank's work and its waits on the others took. Past the deadline the thread writes

    error: rank R: no answer from the other ranks for N s (a rank hung or the link is down)

to standard error and exits with status 1 (`os._exit`: the main thread is blocked inside MLX), and the launcher
ends the other ranks.

Between beats the rank is counted as waiting, except where it waits for something other than the ranks (`pause`,
`idle`): its own share's load (the model's, a drafter's; every rank then waits for the others' in `Split.loaded`),
and a line of `chat`'s input. `serve` needs no exception: the ranks past 0 wait for rank 0's next round, and rank
0 publishes an empty round every `heartbeat()` seconds while it has nothing to run, so an idle server beats on
every rank and a rank 0 that hangs is noticed by the others as any rank is.

The deadline is `DS4_MLX_SPLIT_TIMEOUT` seconds (default 30; 0 turns the watchdog off). The wait for the other
ranks' loads, the start (the ranks' processes start at their hosts' pace) and the first call of each kind (`beat`
with a key not seen before: the first prefill, the first decode step of a cache layout, the first step of a row
grouping) get `FIRST_USE` times that: a slower disk, and the kernels' first-use checks, may take much longer on
one rank than on another.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

ENV = "DS4_MLX_SPLIT_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
FIRST_USE = 20
"""How many deadlines the first call of a kind may take (the slowest rank's load, first-use kernel checks)."""


class Watchdog:
    """The deadline of one rank and the thread that watches it."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._allowed = 0.0
        self.beat(slow=True)  # the ranks' processes start at their hosts' pace
        threading.Thread(target=self._watch, name="ds4-mlx-split-watchdog", daemon=True).start()

    def beat(self, key: Hashable = None, slow: bool = False) -> None:
        """The rank made progress: the deadline moves on, by FIRST_USE deadlines for a key not seen before or a
        `slow` wait."""
        if key is not None and key not in self._seen:
            self._seen.add(key)
            slow = True
        allowed = self.timeout * (FIRST_USE if slow else 1)
        with self._lock:
            self._deadline, self._allowed = time.monotonic() + allowed, allowed

    def pause(self) -> None:
        """No deadline until the next beat (the rank waits for nothing of the other ranks')."""
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
            if late:
                sys.stderr.write(f"error: rank {self.rank}: no answer from the other ranks for "
                                 f"{self._allowed:.0f} s (a rank hung or the link is down)\n")
                sys.stderr.flush()
                os._exit(1)


_current: Watchdog | None = None


def timeout() -> float:
    """The deadline in seconds from the environment (0: off); a value that is not a number >= 0 is refused."""
    from ds4_mlx.errors import UsageError

    text = os.environ.get(ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"{ENV} must be a number of seconds >= 0 (0: no deadline), got {text!r}")
    return value


def start(rank: int) -> None:
    """Watch this rank (once per process; not when the deadline is 0)."""
    global _current
    seconds = timeout()
    if _current is None and seconds > 0:
        _current = Watchdog(rank, seconds)


def beat(key: Hashable = None, slow: bool = False) -> None:
    """`Watchdog.beat` of this process's watchdog, if it has one."""
    if _current is not None:
        _current.beat(key, slow)


def pause() -> None:
    """`Watchdog.pause` of this process's watchdog, if it has one."""
    if _current is not None:
        _current.pause()


@contextmanager
def idle(then: Hashable = None) -> Iterator[None]:
    """No deadline inside (the rank waits for something other than the ranks: a line of input), a beat with key
    `then` after."""
    pause()
    try:
        yield
    finally:
        beat(then)


def heartbeat() -> float | None:
    """How often (seconds) rank 0 of `serve` publishes an empty round while it has nothing to run, well within the
    deadline (None: never, with no watchdog)."""
    return _current.timeout / 4 if _current is not None else None
