"""The one thread that owns the Engine, and the bounded queue of generation jobs in front of it.

MLX evaluation happens only on this thread (the engine is even loaded here, so its arrays and streams belong
to it). The asyncio event loop submits jobs and receives their events through `loop.call_soon_threadsafe`; it
never waits on MLX. Up to the engine's `parallel` jobs run at once, each on a lane of its own (batch.py: their
tokens share each decode step); the others wait in arrival order and join as lanes free up. A request holds its
place from before its body is read (`reserve`), so that requests still being read, parsed or tokenized count
against the queue's bound as queued jobs do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..batch import Batch
from ..events import Event
from .common import ApiError
from .relay import Relay, relay_for

if TYPE_CHECKING:
    from ..engine import Engine, GenerationRequest

log = logging.getLogger("ds4_mlx.serve")

_END = object()


class Job:
    """One generation on its way through the worker; its events come back to the event loop that made it."""

    def __init__(self, request: GenerationRequest, request_id: str) -> None:
        self.request = request
        self.id = request_id
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    def cancel(self) -> None:
        """Stop generating at the next token (or skip the job if it is still queued). Safe from any thread."""
        self.cancelled.set()

    def _post(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            self.cancel()  # the event loop is gone: nobody is listening any more

    async def events(self) -> AsyncIterator[Event]:
        """The job's events in order; raises what the engine raised, or the error that ended the job."""
        while True:
            item = await self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    """Runs jobs on one thread, up to the engine's `parallel` at once in arrival order, with at most `max_queue`
    requests waiting behind the running ones (queued jobs and reserved requests still being prepared alike)."""

    def __init__(self, load: Callable[[], Engine], max_queue: int = 64) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self._load = load
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._batch: Batch | None = None
        self._relay: Relay | None = None
        """Under a split model, what hands this worker's requests and rounds to the other ranks (relay.py)."""
        self._reserved = 0
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ds4-mlx-worker", daemon=True)

    def start(self) -> Engine:
        """Starts the thread and waits until it has loaded the engine; re-raises a load failure here."""
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        assert self.engine is not None
        return self.engine

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        """Jobs holding a lane now."""
        return len(self._batch.running) if self._batch is not None else 0

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def parallel(self) -> int:
        return self.engine.parallel if self.engine is not None else 1

    def _check_room(self) -> None:
        """503 while shutting down, 429 when the lanes and the queue (running, queued and reserved requests) are
        full."""
        if self._stopping:
            raise ApiError("server shutting down", 503)
        occupied = self.running + len(self._queue) + self._reserved
        if occupied > self.max_queue + self.parallel - 1:
            raise ApiError(
                f"too many requests waiting: the queue holds at most {self.max_queue} behind the "
                f"{self.parallel} running; retry later",
                429,
            )

    @contextlib.contextmanager
    def reserve(self) -> Iterator[Callable[[Job], None]]:
        """A place in the queue for a request about to be read and prepared (refused with 503 or 429 at once);
        yields the function that queues its job in that place. Leaving without queueing frees the place."""
        with self._cond:
            self._check_room()
            self._reserved += 1
        held = True

        def submit(job: Job) -> None:
            nonlocal held
            with self._cond:
                if not held:
                    raise RuntimeError("a reservation queues one job")
                self._reserved -= 1
                held = False
                if self._stopping:
                    raise ApiError("server shutting down", 503)
                self._queue.append(job)
                self._cond.notify()

        try:
            yield submit
        finally:
            if held:
                with self._cond:
                    self._reserved -= 1

    def shutdown(self) -> None:
        """Refuse new jobs, end the queued ones with 503 and make the running ones stop at their next token."""
        with self._cond:
            self._stopping = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify()
        for job in queued:
            job._post(ApiError("server shutting down", 503))
            job._post(_END)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # handed to start(), which re-raises it in the caller's thread
            self._load_error = e
            return
        finally:
            self._loaded.set()
        batch = self._batch = Batch(self.engine)
        relay = self._relay = relay_for(self.engine)
        heartbeat = relay.heartbeat if relay is not None else None
        while True:
            with self._cond:
                while not self._queue and not batch.running and not self._stopping:
                    if not self._cond.wait(heartbeat):
                        break  # idle under a split: an empty round, so that every rank's watchdog sees rank 0
                if self._stopping and not self._queue and not batch.running:
                    break
                started = []  # the requests the other ranks start too, under a split model
                while self._queue and batch.free:
                    job = self._queue.popleft()
                    if self._start(batch, job):
                        started.append(job.request)
            if relay is not None:
                relay.publish(started)
            batch.round()
        if relay is not None:
            relay.publish(None)
        try:
            self.engine.shutdown()  # the disk KV cache keeps the live session for the next process
        except Exception:
            log.exception("saving the live session at shutdown failed")

    def _start(self, batch: Batch, job: Job) -> bool:
        """Starts the job on a lane; False where it ends here instead (cancelled while queued)."""
        if job.cancelled.is_set():  # the client left while the job was queued
            job._post(_END)
            return False
        cancel = lambda: job.cancelled.is_set() or self._stopping  # noqa: E731
        if self._relay is not None:
            cancel = self._relay.cancel(cancel)
        batch.start(job.request, cancel=cancel, post=job._post, end=lambda: job._post(_END))
        return True
