"""Several requests at once: continuous batching over the engine's lanes.

Each running request holds one lane (a live session, engine.py's Lane) and runs the engine's own `answer` there,
so tokenizing, prefix reuse, sampling, stop rules and tool calls are the one implementation every front end uses.
The scheduler works in rounds. In a round every request moves to its next pause: a prefilling one by one chunk
(while other lanes decode, a chunk the backend runs in about `prefill_stall` seconds, at most `prefill_cap` tokens,
so that their tokens wait for one short chunk, not a whole prompt), a decoding one by one token. While two or more lanes decode, their tokens go into one step over the
weights (session.decode_together: every dense weight read once for all rows, each row attending to its own
session); a lane that decodes alone steps as `Engine.generate` does (the decode graphs, tokens fed ahead, MTP
speculation), which is what a lone stream runs fastest. Where the decode graphs run, the shared step is one launch
of the lanes' joint decode graph (model/graphstep.py `JointGraphs`).

A request joins at any round on a free lane: the one whose live tokens start its prompt (the longest), else the
one idle longest, whose state the engine keeps as a RAM checkpoint before replacing it. It leaves when its answer
ends or its client goes (`cancel`), freeing the lane at that round. Nothing one request does reaches another's
tokens: each row's logits are its own session's, and its sampler, stop strings, mask and limits are its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import mlx.core as mx

from .engine import PAUSE, Engine, Feed, GenerationRequest, Lane
from .memory import CHUNK_LADDER
from .events import Done, Event
from .session import decode_together
from .tokenizer import utf8

log = logging.getLogger("ds4_mlx.batch")

PREFILL_CAP = 1024
"""Tokens a prefill chunk holds at most while other lanes decode: what their next token may wait for."""
PREFILL_STALL = 0.5
"""Seconds a prefill chunk should take, about, while other lanes decode. Its length is what the last chunk's rate
runs in that time (a prefill slows with depth, so the last chunk is the nearest measure), a CHUNK_LADDER size (few
new shapes) from MIN_CAP to `prefill_cap`: on a GPU that is the cap itself (an H200 prefills ~4,000 t/s), on a CPU
or a small Mac a few hundred tokens."""
MIN_CAP = 128
"""The shortest chunk a prefill beside decoding lanes is cut to, whatever its rate: shorter ones cost more in
launches and first-use checks than they save the other lanes."""


@dataclass(eq=False)
class Running:
    """One request on its lane: its answer, where its events go, and what the next round sends it."""

    lane: Lane
    post: Callable[[Event | BaseException], None]
    end: Callable[[], None]
    answer: Generator[Event | Feed | object, mx.array | None, None] | None = None
    """The engine's answer on the lane, made once the request holds it (`Batch.start`)."""
    decoding: bool = False
    feed: Feed | None = None
    """The token waiting for the next shared step."""
    send: mx.array | None = None
    error: BaseException | None = None
    """A shared step's failure, raised inside the answer at its Feed."""


@dataclass(eq=False)
class Batch:
    """The lanes of one engine and the requests running on them; driven by one thread (serve/worker.py)."""

    engine: Engine
    prefill_cap: int = PREFILL_CAP
    prefill_stall: float = PREFILL_STALL
    running: list[Running] = field(default_factory=list)
    shared_steps: int = 0
    """Steps shared by several lanes so far, and the rows they fed (`shared_rows`)."""
    shared_rows: int = 0
    prefill_rate: float | None = None
    """Tokens a second of the last prefill chunk any lane ran (None before the first)."""
    _idle_since: dict[int, int] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    @property
    def free(self) -> int:
        """Lanes no request holds."""
        return self.engine.parallel - len(self.running)

    @property
    def decoding(self) -> int:
        """Requests past their prefill."""
        return sum(r.decoding for r in self.running)

    def run_all(self, requests: list[GenerationRequest]) -> list[list[Event]]:
        """Runs the requests to their ends, up to `engine.parallel` at once in order (the notebooks' and the bench's
        way in; the server's worker starts requests as they arrive); returns each one's events."""
        events: list[list[Event]] = [[] for _ in requests]
        failures: list[BaseException] = []
        waiting = list(enumerate(requests))
        while waiting or self.running:
            while waiting and self.free:
                i, request = waiting.pop(0)
                self.start(request, lambda: False, lambda e, i=i: (failures if isinstance(e, BaseException)
                                                                   else events[i]).append(e), lambda: None)
            self.round()
        if failures:  # a request refused (its prompt too long, say): raised once the others have ended
            raise failures[0]
        return events

    def start(self, request: GenerationRequest, cancel: Callable[[], bool],
              post: Callable[[Event | BaseException], None], end: Callable[[], None]) -> None:
        """Runs `request` on a free lane from the next round: its events (or the exception that ended it) go to
        `post`, then `end` is called once."""
        if self.free < 1:
            raise RuntimeError("no free lane")
        lane = self._choose(request)
        run = Running(lane, post, end)
        run.answer = self.engine.answer(lane, request, cancel, shared=lambda: self._shared(run))
        self.running.append(run)

    def round(self) -> None:
        """Moves every running request to its next pause, then feeds the waiting tokens in one shared step."""
        for run in list(self.running):
            if run.feed is None:
                session = run.lane.session
                session.chunk_cap = self.chunk_cap() if self._others_decode(run) else None
                fed, start = len(session.tokens), time.perf_counter()
                self._advance(run)
                fed = len(session.tokens) - fed
                if not run.decoding and fed > 1:  # one prefill chunk (a restored prefix feeds nothing)
                    self.prefill_rate = fed / (time.perf_counter() - start)
        waiting = [run for run in self.running if run.feed is not None]
        if not waiting:
            return
        try:
            rows = decode_together([run.lane.session for run in waiting], [run.feed.token for run in waiting])
        except Exception as error:  # every row's answer ends with it (finish "error")
            log.exception("a step shared by %d lanes failed", len(waiting))
            for run in waiting:
                run.feed, run.error = None, error
            return
        self.shared_steps, self.shared_rows = self.shared_steps + 1, self.shared_rows + len(waiting)
        for run, logits in zip(waiting, rows):
            run.feed, run.send = None, logits

    def chunk_cap(self) -> int:
        """The longest prefill chunk while other lanes decode: what the last chunk's rate runs in `prefill_stall`
        seconds, a CHUNK_LADDER size from MIN_CAP to `prefill_cap` (the cap itself before any chunk ran)."""
        if self.prefill_rate is None:
            return self.prefill_cap
        limit = min(self.prefill_rate * self.prefill_stall, self.prefill_cap)
        fitting = max((size for size in CHUNK_LADDER if size <= limit), default=0)
        return max(fitting, min(MIN_CAP, self.prefill_cap))

    def _advance(self, run: Running) -> None:
        """Runs the answer to its next Feed or pause, posting its events; ends it when it is done."""
        while True:
            try:
                if run.error is not None:
                    error, run.error = run.error, None
                    item = run.answer.throw(error)
                else:
                    value, run.send = run.send, None
                    item = run.answer.send(value)
            except StopIteration:
                self._finish(run)
                return
            except Exception as error:  # a client mistake found while accepting the request, or worse
                run.post(error)
                self._finish(run)
                return
            if isinstance(item, Feed):
                run.feed = item
                return
            if item is PAUSE:
                return
            if isinstance(item, Done):  # nothing follows Done: the lane is free before the client has the answer
                run.answer.close()
                self._finish(run, item)
                return
            run.post(item)

    def _finish(self, run: Running, last: Done | None = None) -> None:
        """Frees the run's lane, then posts its last event (if any) and ends it: a client that has its answer
        finds the lane free (/health, its next request)."""
        self.running.remove(run)
        run.lane.session.chunk_cap = None
        self._idle_since[id(run.lane)] = next(self._clock)
        if last is not None:
            run.post(last)
        run.end()

    def _shared(self, run: Running) -> bool:
        """Asked by a decoding answer before each token: whether it goes into a step shared with other lanes."""
        run.decoding = True
        return self.decoding > 1

    def _others_decode(self, run: Running) -> bool:
        return any(other.decoding for other in self.running if other is not run)

    def _choose(self, request: GenerationRequest) -> Lane:
        """The free lane whose live tokens start the prompt (the most of them), else the one idle longest."""
        held = {id(run.lane) for run in self.running}
        free = [lane for lane in self.engine.lanes if id(lane) not in held]
        prompt = request.prompt

        def starts(lane: Lane) -> int:
            live = lane.session.tokens
            if not live:
                return 0
            if isinstance(prompt, list):
                return len(live) if prompt[: len(live)] == live else 0
            return len(live) if utf8(prompt).startswith(self.engine._text_bytes(live)) else 0

        return max(free, key=lambda lane: (starts(lane), -self._idle_since.get(id(lane), -1)))
