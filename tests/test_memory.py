"""The device memory budget (memory.py): prefill chunks sized to what is free, a clear refusal when nothing fits,
RAM checkpoints given back first, and the budget said at start."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from ds4_mlx import memory
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.memory import check_memory
from ds4_mlx.errors import ResourceError
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.linear import loaded_nbytes
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "tiny.gguf"
    write_model(path, preset="tiny", vocab="real", seed=3)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return Engine.load(tiny_path, ctx=1024)


def test_transients_grow_with_the_chunk_and_its_position():
    at = memory.chunk_transient_bytes
    assert at(FLASH, 4096, 0) > at(FLASH, 2048, 0) > 0
    assert at(FLASH, 8192, 1 << 20) > at(FLASH, 8192, 0)  # the indexer's scores over every ratio-4 row


def test_fit_chunk_takes_the_preferred_chunk_else_a_shorter_one_else_none():
    need = lambda c, p=0: memory.chunk_transient_bytes(FLASH, c, p)  # noqa: E731
    assert memory.fit_chunk(FLASH, 12288, 0, need(12288)) == 12288
    assert memory.fit_chunk(FLASH, 12288, 0, need(12288) - 1) == 8192
    assert memory.fit_chunk(FLASH, 12288, 0, need(5000)) == 4096
    assert memory.fit_chunk(FLASH, 700, 0, need(700)) == 700  # a last, short chunk as it is
    assert memory.fit_chunk(FLASH, 12288, 0, need(memory.MIN_CHUNK)) == memory.MIN_CHUNK
    assert memory.fit_chunk(FLASH, 12288, 0, need(memory.MIN_CHUNK) - 1) == 0
    deep = 1 << 20
    assert memory.fit_chunk(FLASH, 8192, deep, need(8192)) < 8192  # what fits at 0 does not fit deep


def test_check_memory_counts_the_state_copies_and_a_chunk(tiny_path):
    weights = open_weights(tiny_path)
    nbytes = loaded_nbytes(weights)
    check_memory(weights, nbytes, 1024, 1 << 40)
    room = memory.chunk_transient_bytes(weights.config, memory.MIN_CHUNK, 0) + (64 << 20)
    with pytest.raises(ResourceError, match="a context of \\d+ tokens would fit"):
        check_memory(weights, nbytes, 1 << 20, nbytes + room)
    with pytest.raises(ResourceError, match="no context size fits"):
        check_memory(weights, nbytes, 1024, nbytes // 2)


def _prefill_chunks(engine: Engine, tokens: list[int]) -> tuple[list[int], mx.array]:
    engine.reset()
    session = engine.session
    sizes, done_before = [], 0
    for done, _ in session.prefill_steps(tokens):
        sizes.append(done - done_before)
        done_before = done
    return sizes, session.logits


def test_a_tight_limit_shortens_chunks_and_changes_no_logit(tiny):
    tokens = [5 + (i * 37) % 900 for i in range(600)]
    tiny.session.chunk_size = 512
    sizes, free_logits = _prefill_chunks(tiny, tokens)
    assert sizes == [512, 88]
    config = tiny.model.config
    room = memory.chunk_transient_bytes(config, 128, 600)  # room for 128 tokens, not 256, at any position here
    tiny.reset()
    with memory.limited(mx.get_active_memory() + room):
        sizes, tight_logits = _prefill_chunks(tiny, tokens)
    assert max(sizes) == 128 and sum(sizes) == 600
    # float32 reference path, chunking is exact up to summation order (ds4.c): the same argmax, tiny gaps
    assert mx.argmax(tight_logits).item() == mx.argmax(free_logits).item()
    assert mx.max(mx.abs(tight_logits - free_logits)).item() < 1e-3


def test_no_room_for_the_shortest_chunk_is_refused_and_loses_nothing(tiny):
    tiny.reset()
    tiny.session.prefill([5, 6, 7])
    logits = tiny.session.logits
    with memory.limited(0):  # nothing free, however much garbage is collected meanwhile
        with pytest.raises(memory.MemoryShortage, match="no room to prefill at position 3"):
            for _ in tiny.session.prefill_steps([8] * 40):
                pass
    assert tiny.session.tokens == [5, 6, 7]
    assert tiny.session.logits is logits


def test_a_short_prefill_drops_ram_checkpoints_first(tiny):
    tiny.reset()
    tiny.checkpoints.budget_bytes = 1 << 40
    for n in (3, 4, 5):
        tiny.session.reset()
        tiny.session.prefill(list(range(10, 10 + 40 * n)))
        tiny.checkpoints.add(tiny.session.snapshot())
    assert len(tiny.checkpoints) == 3
    tiny.session.reset()
    held = tiny.checkpoints.nbytes
    room = memory.chunk_transient_bytes(tiny.model.config, memory.MIN_CHUNK, 64)
    with memory.limited(mx.get_active_memory() - held + room):  # the checkpoints' memory is what is missing
        tiny.session.prefill([8] * 20)
    assert len(tiny.checkpoints) < 3
    assert tiny.session.tokens == [8] * 20


def test_the_engine_says_its_budget_and_leaves_checkpoints_what_is_spare(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="ds4_mlx.engine"):
        engine = Engine(tiny.model, tiny.tokenizer, 1024)
    line = next(r.getMessage() for r in caplog.records if "device memory budget" in r.getMessage())
    assert "weights" in line and "prefill chunk" in line and "RAM checkpoints" in line
    budget = engine.budget
    assert engine.checkpoints.budget_bytes == budget.spare
    assert budget.spare == budget.limit - budget.weights - budget.sessions - budget.chunk
    engine.session.close()


def test_a_request_without_room_gets_a_clear_error(tiny):
    tiny.reset()
    request = GenerationRequest(prompt="hello there", sampling=SamplingParams(temperature=0.0), max_tokens=2)
    with memory.limited(0):
        with pytest.raises(memory.MemoryShortage):
            list(tiny.generate(request))


def test_the_cli_takes_a_memory_limit(demo_model, capsys):
    from ds4_mlx.cli import main

    assert main(["run", "--demo", "--memory-limit", "1M", "-p", "hi", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ds4-mlx run: error: the model needs ") and "can hold 0.0 GiB" in err
    with pytest.raises(SystemExit) as exit:
        main(["run", "--demo", "--memory-limit", "lots", "-p", "hi"])
    assert exit.value.code == 2
    assert "argument --memory-limit: expected a size" in capsys.readouterr().err


def test_a_split_engine_changes_its_context_only_where_every_rank_has_room(tiny):
    """Under a split every rank takes the same answer (chat's /ctx reaches each): the one with the least room."""

    class NoRoomElsewhere:
        """A split whose other rank has no memory free."""

        def least_of(self, values: list[int]) -> list[int]:
            return [min(0, *values) for _ in values]

    tiny.reset()
    tiny.split = NoRoomElsewhere()
    try:
        with pytest.raises(ResourceError, match="the context stays at 1024"):
            tiny.set_context(512)
    finally:
        tiny.split = None
    tiny.set_context(512)  # alone, this rank has the room
    tiny.set_context(1024)
    assert tiny.ctx == 1024
