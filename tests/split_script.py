"""A fixed run of the model on one process or, under `mlx.launch`, split across its ranks (tests/test_split.py).

    split_script.py MODEL OUT KIND QUANT [SHARE]

QUANT "exact" turns the activation quantisation simulation off (model.py), "simulated" leaves it on; "fail" is
"exact" where the last rank stops with status 3 once loaded (the others are then waiting in their first sum);
"hang" is "exact" where the last rank sleeps past its first decode steps, its own watchdog paused, as a rank stuck
where nothing of it notices (model/watchdog.py).

Prefills a prompt in chunks, decodes greedily, restores a snapshot and decodes again, and takes one B-row step over
two sessions; saves every logit it saw to OUT.<rank>.npz (OUT.single.npz for one process) and, split, the count
and bytes of a decode step's exchanges.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import ds4_mlx  # noqa: F401
from ds4_mlx.model import watchdog
from ds4_mlx.model.model import Model
from ds4_mlx.model.shard import init_split, launched
from ds4_mlx.model.weights import open_weights

PROMPT = 37
CHUNK = 16
STEPS = 5
CTX = 96


def main(path: str, out: str, kind: str, quant: str, share: str | None = None) -> None:
    mx.set_default_device(mx.cpu)
    weights = open_weights(path)
    split = init_split(kind, share, weights) if launched() else None
    model = Model(weights, simulate_quant=quant == "simulated", split=split)
    if quant == "fail" and split is not None and split.last:
        sys.exit(3)
    tokens = mx.array(np.random.default_rng(0).integers(0, model.config.n_vocab, PROMPT), dtype=mx.int32)
    seen: dict[str, np.ndarray] = {}
    cache = model.new_cache(CTX)
    for i, start in enumerate(range(0, PROMPT, CHUNK)):
        seen[f"chunk{i}"] = np.array(model(tokens[start : start + CHUNK], cache, all_logits=True))
    snapshot = cache.snapshot()
    token = int(np.argmax(seen[f"chunk{i}"][-1]))
    for again in ("decode", "restored"):
        if again == "restored":
            if quant == "hang" and split is not None and split.last:
                watchdog.pause()
                time.sleep(3600)
            cache.restore(snapshot)
            token = int(np.argmax(seen[f"chunk{i}"][-1]))
        for step in range(STEPS):
            _, logits = model.decode(token, cache)
            seen[f"{again}{step}"] = np.array(logits)
            token = int(np.argmax(seen[f"{again}{step}"]))
    other = model.new_cache(CTX)
    model.prefill(tokens[:5], other)
    _, logits, rows = model.decode_rows([token, 7, 9], [cache, other], groups=(1, 2))
    seen["rows"] = np.array(logits)
    cache.advance(rows[0], cache.n_tokens + 1)
    _, logits = model.decode(3, cache)
    seen["after_rows"] = np.array(logits)
    name = "single" if split is None else str(split.rank)
    if split is not None:  # the exchanges of one decode step, counted while its graph is built
        before = split.exchanges, split.exchanged_bytes
        model.step(mx.array([0], dtype=mx.int32), mx.array([cache.n_tokens], dtype=mx.int32), cache.layers)
        seen["exchanges"] = np.array([split.exchanges - before[0], split.exchanged_bytes - before[1]])
    np.savez(f"{out}.{name}.npz", **seen)


def state(path: str, out: str, kind: str, kv_dir: str) -> None:
    """`split_script.py state MODEL OUT KIND KV_DIR`: the engine's kept states on one process or split. Asks
    greedy prompts that take, restore and drop RAM checkpoints (the last rank, or the one process, finds its memory
    short once), then a new engine that loads disk checkpoints (the last rank has lost one file), then a request
    held to a JSON schema (split: relayed from rank 0); saves the tokens, last logits, reuse sources and kept
    checkpoints of each to OUT.<rank>.npz (OUT.single.npz)."""
    from ds4_mlx import memory
    from ds4_mlx.cache.kvstore import KvCacheOptions, text_key
    from ds4_mlx.constrain import Constraint, OutputFormat
    from ds4_mlx.engine import Engine, GenerationRequest
    from ds4_mlx.sampling import SamplingParams
    from ds4_mlx.serve.relay import Relay

    mx.set_default_device(mx.cpu)
    rank = mx.distributed.init().rank() if launched() else None
    last = rank is None or rank == mx.distributed.init().size() - 1
    if rank == 1:  # a host with less memory: its RAM checkpoint budget is every rank's
        memory.set_limit(memory.device_limit() // 2)
    options = KvCacheOptions(Path(kv_dir), min_tokens=16, cold_max_tokens=4000, boundary_align_tokens=0,
                             boundary_trim_tokens=0)
    seen: dict[str, np.ndarray] = {}

    def load() -> Engine:
        return Engine.load(path, 256, simulate_quant=False, kv_cache=options, split=kind if launched() else None)

    def ask(engine: Engine, name: str, prompt: str, request: GenerationRequest | None = None) -> None:
        request = request or GenerationRequest(prompt, 2, SamplingParams(temperature=0))
        events = list(engine.generate(request))
        seen[f"{name}.tokens"] = np.array(events[-1].token_ids)
        seen[f"{name}.logits"] = np.array(engine.session.logits)
        seen[f"{name}.reuse"] = np.array(events[0].reuse.source)
        seen[f"{name}.kept"] = np.array(engine.checkpoints.positions())

    fox, other = "The quick brown fox jumps over the lazy dog. ", "A second text, on disk on one rank. "
    engine = load()
    seen["budget"] = np.array([engine.checkpoints.budget_bytes, engine.budget.spare])
    ask(engine, "fox", fox)
    ask(engine, "other", other)
    drops = []
    drop_oldest = engine.checkpoints.drop_oldest
    engine.checkpoints.drop_oldest = lambda: drops.append(1) or drop_oldest()
    free_bytes = memory.free_bytes
    short = [0] if last else []  # the last rank finds no memory free once: every rank drops its oldest checkpoint
    memory.free_bytes = lambda: short.pop() if short else free_bytes()
    ask(engine, "fox_again", fox + "It runs on.")  # from the RAM checkpoint at the end of the first prompt
    memory.free_bytes = free_bytes
    seen["drops"] = np.array(len(drops))
    if launched() and last:  # a write that failed here: the others still have their file of this text
        Path(engine.kv_store.directory, f"{text_key(engine._text_bytes(engine.tokenizer.encode(other)))}.kv").unlink()
    engine = load()
    ask(engine, "fox_disk", fox + "Then it sleeps.")
    ask(engine, "other_disk", other + "And more.")
    fmt = OutputFormat.build("json_schema", {"type": "object", "properties": {"name": {"type": "string"}, "n": {
        "type": "integer"}}, "required": ["name", "n"]}, "thing", "response_format")
    held = GenerationRequest("Describe a thing as JSON.", 8, SamplingParams(temperature=0.8, seed=11),
                             output=Constraint.make(fmt, []))
    if launched():  # as serve hands it on: rank 0 publishes, the others receive it
        relay = Relay(engine.split)
        got = relay.publish([held] if relay.split.first else None)
        seen["relayed"] = np.array(got == [held])
        held = got[0]
    ask(engine, "held", "", held)
    np.savez(f"{out}.{'single' if rank is None else rank}.npz", **seen)


if __name__ == "__main__":
    state(*sys.argv[2:]) if sys.argv[1] == "state" else main(*sys.argv[1:])
