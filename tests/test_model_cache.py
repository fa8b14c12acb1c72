"""Session state: ds4's payload format (ds4.c) round-trips, and bad payloads are refused with a reason."""

from __future__ import annotations

import io
import struct

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import CacheFileError
from ds4_mlx.model.cache import PAYLOAD_MAGIC, read_payload, write_payload
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

CTX = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("cache") / "tiny.gguf", preset="tiny", experts="q2", seed=3)
    return Model(open_weights(path))


@pytest.fixture(scope="module")
def saved(model):
    """A session of 143 tokens (both frontiers mid-window) and its payload bytes."""
    tokens = np.random.default_rng(5).integers(0, model.config.n_vocab, 150).astype(np.int32)
    cache = model.new_cache(CTX)
    logits = model.prefill(mx.array(tokens[:143]), cache, chunk_size=64)
    f = io.BytesIO()
    write_payload(f, cache, tokens[:143].tolist(), logits)
    return tokens, cache, logits, f.getvalue()


def test_payload_layout(model, saved):
    tokens, cache, logits, data = saved
    c = model.config
    header = struct.unpack_from("<13I", data)
    assert header == (PAYLOAD_MAGIC, 1, CTX, CTX, 16, 16, CTX // 4 + 2, 143, c.n_layer, c.head_dim,
                      c.indexer_head_dim, c.n_vocab, 16)
    assert data[:4] == b"DSV4"
    offset = 13 * 4
    assert np.frombuffer(data, "<u4", 143, offset).tolist() == tokens[:143].tolist()
    offset += 143 * 4
    np.testing.assert_array_equal(np.frombuffer(data, "<f4", c.n_vocab, offset), np.array(logits))
    offset += c.n_vocab * 4
    counts = np.frombuffer(data, "<u4", 2 * c.n_layer, offset).reshape(2, -1)
    assert counts.tolist() == [[0, 0, 35, 1, 35, 1], [0, 0, 35, 0, 35, 0]]
    raw_rows = 16 * c.head_dim
    comp4 = 35 * c.head_dim + 2 * 8 * 2 * c.head_dim + 35 * c.indexer_head_dim + 2 * 8 * 2 * c.indexer_head_dim
    comp128 = 1 * c.head_dim + 2 * 128 * c.head_dim
    body = 6 * raw_rows + 2 * comp4 + 2 * comp128
    assert len(data) == offset + 8 * c.n_layer + 4 * body
    # layer 0's raw rows come first, oldest first: the last 16 rows of the live window
    first = np.frombuffer(data, "<f4", raw_rows, offset + 8 * c.n_layer).reshape(16, -1)
    np.testing.assert_array_equal(first, np.array(cache.layers[0].raw))


def test_payload_round_trip_continues_identically(model, saved):
    tokens, cache, logits, data = saved
    loaded, ids, next_logits = read_payload(io.BytesIO(data), model.config, CTX + 64)  # a larger context is fine
    assert ids == tokens[:143].tolist() and loaded.n_tokens == 143 and loaded.ctx == CTX + 64
    np.testing.assert_array_equal(np.array(next_logits), np.array(logits))
    snapshot = cache.snapshot()
    want = np.array(model(mx.array(tokens[143:]), cache, all_logits=True))
    cache.restore(snapshot)
    got = np.array(model(mx.array(tokens[143:]), loaded, all_logits=True))
    np.testing.assert_array_equal(got, want)


def test_ds4_empty_frontier_rows_are_empty(model, saved):
    tokens, _, _, data = saved
    plain, _, _ = read_payload(io.BytesIO(data), model.config, CTX)
    ds4_style, _, _ = read_payload(io.BytesIO(data.replace(struct.pack("<f", -np.inf), struct.pack("<f", -1e30))),
                                   model.config, CTX)
    assert float(mx.min(ds4_style.layers[3].comp_frontier.score)) == np.float32(-1e30)
    want = np.array(model(mx.array(tokens[143:]), plain, all_logits=True))
    np.testing.assert_array_equal(np.array(model(mx.array(tokens[143:]), ds4_style, all_logits=True)), want)


def patched(data: bytes, field: int, value: int) -> bytes:
    return data[: 4 * field] + struct.pack("<I", value) + data[4 * field + 4 :]


@pytest.mark.parametrize("change,match", [
    (lambda d: patched(d, 0, 0x12345678), "not a ds4 session payload"),
    (lambda d: patched(d, 8, 43), "model with"),
    (lambda d: patched(d, 2, CTX * 2), "context"),
    (lambda d: patched(d, 12, 3), "raw window"),
    (lambda d: d[:-4], "ends inside layer 5"),
    (lambda d: d + b"\0", "bytes after"),
    (lambda d: d[:30], "ends inside the header"),
])
def test_bad_payloads_are_refused(model, saved, change, match):
    with pytest.raises(CacheFileError, match=match):
        read_payload(io.BytesIO(change(saved[3])), model.config, CTX)


def test_payload_needs_room_for_one_more_token(model, saved):
    with pytest.raises(CacheFileError, match="143 tokens"):
        read_payload(io.BytesIO(saved[3]), model.config, 143)


def test_mismatched_row_counts_are_refused(model, saved):
    data = saved[3]
    offset = 13 * 4 + 143 * 4 + model.config.n_vocab * 4 + 2 * 4  # n_comp of layer 2
    with pytest.raises(CacheFileError, match="row counts"):
        read_payload(io.BytesIO(data[:offset] + struct.pack("<I", 34) + data[offset + 4 :]), model.config, CTX)
