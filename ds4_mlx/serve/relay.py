"""`serve` on a model split across ranks (model/shard.py): rank 0 serves HTTP, the other ranks follow its worker.

Every rank holds a share of every layer, so every rank must run the same model calls in the same order. Rank 0's
worker (worker.py) runs rounds of its Batch; before each round it hands the other ranks the requests it starts in
that round (`Relay.publish`, as JSON, through `mx.distributed`), and each of them starts the same requests on its own
Batch and runs the same round (`follow`), its events dropped. What is decided by time rather than by the input is
decided by rank 0 and agreed: whether a request is cancelled (its client left, the server stops), asked by the
engine between tokens and prefill chunks, is rank 0's answer on every rank (`Relay.flag`).

A request held to a grammar (structured output, strict tools: `GenerationRequest.output`, a constrain.Constraint)
is relayed with what its Constraint holds: the answer's format (kind, schema, name, Lark rule), the tools (names,
strict parameters) and the two grammars rank 0 compiled from them; each rank makes the same Constraint of them,
without compiling again. Every rank gets the same logits and samples with one seed, so the same grammar gives the
same masks and the same tokens on every rank.

While rank 0 has nothing to run it publishes an empty round every `heartbeat` seconds, so that every rank's
watchdog (model/watchdog.py) sees the others answer and a rank that hangs ends the run even on an idle server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..batch import Batch
from ..constrain import Constraint, OutputFormat
from ..engine import GenerationRequest
from ..model import watchdog
from ..sampling import SamplingParams
from ..toolgrammar import ToolSpec

if TYPE_CHECKING:
    from ..engine import Engine
    from ..model.shard import Split


class Relay:
    """Rank 0's decisions, handed to every rank (each call is a collective: every rank makes the same calls)."""

    def __init__(self, split: Split) -> None:
        self.split = split
        self.heartbeat = watchdog.heartbeat()
        """Seconds between rank 0's empty rounds while idle (None: it never publishes one, with no watchdog)."""

    def _broadcast(self, data: bytes) -> bytes:
        """Rank 0's bytes on every rank."""
        watchdog.beat()
        group, first = self.split.group, self.split.first
        size = mx.distributed.all_sum(mx.array([len(data) if first else 0], dtype=mx.int32), group=group).item()
        mine = np.frombuffer(data, dtype=np.uint8).astype(np.int32) if first else np.zeros(size, np.int32)
        return np.array(mx.distributed.all_sum(mx.array(mine), group=group)).astype(np.uint8).tobytes()

    def publish(self, requests: list[GenerationRequest] | None) -> list[GenerationRequest] | None:
        """Rank 0: the requests it starts before its next round (None: it stops); the other ranks pass None and get
        rank 0's."""
        data = json.dumps(None if requests is None else [_fields(r) for r in requests]) if self.split.first else ""
        got = json.loads(self._broadcast(data.encode()))
        return None if got is None else [_request(fields) for fields in got]

    def flag(self, value: bool) -> bool:
        """Rank 0's `value` on every rank (the others' is ignored)."""
        watchdog.beat()
        mine = mx.array([int(value) if self.split.first else 0], dtype=mx.int32)
        return bool(mx.distributed.all_sum(mine, group=self.split.group).item())

    def cancel(self, decide: Callable[[], bool]) -> Callable[[], bool]:
        """A request's cancel check as the engine asks it: rank 0's `decide()`, agreed."""
        return lambda: self.flag(decide())


def _fields(request: GenerationRequest) -> dict:
    """A request as JSON: its fields, and what its Constraint holds."""
    output = request.output
    held = None if output is None else {
        "answer": None if output.answer is None else asdict(output.answer),
        "tools": [asdict(tool) for tool in output.tools], "grammar": output.grammar,
        "answer_only": output.answer_only}
    return {"prompt": request.prompt, "max_tokens": request.max_tokens, "sampling": asdict(request.sampling),
            "stop": list(request.stop), "thinking": request.thinking, "tools_active": request.tools_active,
            "output": held}


def _request(fields: dict) -> GenerationRequest:
    """The request `_fields` wrote, its Constraint made again from the fields rank 0's held."""
    held = fields["output"]
    output = None if held is None else Constraint(
        None if held["answer"] is None else OutputFormat(**held["answer"]),
        tuple(ToolSpec(**tool) for tool in held["tools"]), held["grammar"], held["answer_only"])
    return GenerationRequest(fields["prompt"], fields["max_tokens"], SamplingParams(**fields["sampling"]),
                             tuple(fields["stop"]), fields["thinking"], fields["tools_active"], output)


def relay_for(engine: Engine) -> Relay | None:
    """The relay of an engine over a split model (None in a single process, or for test doubles)."""
    split = getattr(getattr(engine, "model", None), "split", None)
    return None if split is None else Relay(split)


def follow(engine: Engine, relay: Relay) -> None:
    """A rank past 0 under `serve`: runs the requests and rounds rank 0's worker runs, until rank 0 stops."""
    batch = Batch(engine)
    while (requests := relay.publish(None)) is not None:
        for request in requests:
            batch.start(request, relay.cancel(lambda: False), lambda _event: None, lambda: None)
        batch.round()
    engine.shutdown()
