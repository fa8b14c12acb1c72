"""The loader's page-locked path (model/pinned.py): byte ranges of a file land where they are asked, whatever the
pieces and workers; a short file is a clear error; and a model loaded through it equals one loaded from the mapped
file. On the CPU a host-memory stand-in for the CUDA runtime does the copies (MLX's CPU arrays expose their memory
as the CUDA build's managed arrays do); on CUDA the real runtime does (gpu-marked)."""

from __future__ import annotations

import ctypes
import threading

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.model import stream
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.pinned import CudaRuntime, PinnedReader, split
from ds4_mlx.model.weights import open_weights


class HostRuntime:
    """CudaRuntime's calls over host memory: buffers are ctypes arrays, a copy is a memmove."""

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.streams: set[int] = set()
        self.copy_threads: set[str] = set()
        self.copies = 0

    def host_alloc(self, nbytes: int) -> int:
        buffer = (ctypes.c_ubyte * nbytes)()
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def free_host(self, pointer: int) -> None:
        del self.buffers[pointer]

    def new_stream(self) -> int:
        stream_id = len(self.streams) + 1
        self.streams.add(stream_id)
        return stream_id

    def destroy_stream(self, stream_id: int) -> None:
        self.streams.remove(stream_id)

    def copy(self, destination: int, source: int, nbytes: int, stream_id: int) -> None:
        assert source in self.buffers and stream_id in self.streams
        ctypes.memmove(destination, source, nbytes)
        self.copy_threads.add(threading.current_thread().name)
        self.copies += 1


def test_split_covers_the_range_in_order():
    assert split(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert split(8, 4) == [(0, 4), (4, 4)]
    assert split(0, 4) == []


@pytest.mark.parametrize("offset,nbytes", [(0, 1), (3, 4096 * 5 + 7), (100_003, 250_000), (0, 400_000)])
def test_ranges_land_at_their_destination(tmp_path, offset, nbytes):
    data = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    runtime = HostRuntime()
    reader = PinnedReader(path, runtime, workers=3, piece_bytes=4096 + 5)
    out = np.zeros(nbytes + 16, np.uint8)
    nbytes = min(nbytes, data.size - offset)
    reader.fill(out.ctypes.data + 8, offset, nbytes)
    np.testing.assert_array_equal(out[8:8 + nbytes], data[offset:offset + nbytes])
    assert not out[:8].any() and not out[8 + nbytes:].any()  # nothing written around it
    assert runtime.copies == len(split(nbytes, 4096 + 5))
    reader.close()
    assert not runtime.buffers and not runtime.streams  # every worker's buffer and stream freed


def test_a_short_file_is_a_clear_error(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    reader = PinnedReader(path, HostRuntime(), workers=2, piece_bytes=256)
    out = np.zeros(2000, np.uint8)
    with pytest.raises(OSError, match="the file ends at byte 1000"):
        reader.fill(out.ctypes.data, 0, 2000)
    reader.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("pinned") / "tiny.gguf", preset="tiny", experts="mixed")


def _resident(model: Model) -> list[np.ndarray]:
    flat = [v for _, v in _leaves(model)]
    mx.eval(flat)
    return [np.asarray(v) for v in flat]


def _leaves(obj, seen=None):
    """Every MLX array a model holds, in a fixed order."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        yield "", obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _leaves(item, seen)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key], seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("ds4_mlx"):
        for key in sorted(vars(obj)):
            yield from _leaves(vars(obj)[key], seen)


def test_a_model_loaded_through_pinned_buffers_equals_the_mapped_load(tiny_path, monkeypatch):
    with open_weights(tiny_path) as weights:
        mapped = Model(weights)
    assert mapped.load_stats.pinned_bytes == 0  # the CPU backend: the mapped path
    runtime = HostRuntime()
    monkeypatch.setattr(stream, "_pinned_reader",
                        lambda w: PinnedReader(w.file.path, runtime, workers=3, piece_bytes=64 << 10))
    monkeypatch.setattr(stream, "PINNED_MIN_BYTES", 4096)
    with open_weights(tiny_path) as weights:
        pinned = Model(weights)
        total = weights.nbytes
    stats = pinned.load_stats
    assert stats.pinned_bytes > 0.9 * total  # all but the tensors under 4 KB (and a wrong guess's prefetch)
    assert len(runtime.copy_threads) > 1 and not runtime.buffers  # workers in parallel; all freed at the end
    want, got = _resident(mapped), _resident(pinned)
    assert len(got) == len(want) > 50
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.cuda
def test_the_cuda_runtime_fills_device_arrays(on_cuda, tmp_path):
    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 11, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    staged = mx.zeros((data.size - 5,), mx.uint8)
    mx.eval(staged)
    reader = PinnedReader(path, CudaRuntime.load(), workers=4, piece_bytes=1 << 20)
    reader.fill(np.asarray(staged).ctypes.data, 5, data.size - 5)
    reader.close()
    np.testing.assert_array_equal(np.asarray(staged * 1), data[5:])  # read by a device op


@pytest.mark.gpu
@pytest.mark.cuda
def test_a_cuda_load_goes_through_pinned_buffers_and_equals_the_mapped_one(on_cuda, tiny_path, monkeypatch):
    monkeypatch.setattr(stream, "PINNED_MIN_BYTES", 4096)
    with open_weights(tiny_path) as weights:
        pinned = Model(weights)
    monkeypatch.setenv("DS4_LOAD", "mapped")
    with open_weights(tiny_path) as weights:
        mapped = Model(weights)
    assert pinned.load_stats.pinned_bytes > 0.9 * pinned.load_stats.file_bytes
    assert mapped.load_stats.pinned_bytes == 0
    for a, b in zip(_resident(pinned), _resident(mapped)):
        np.testing.assert_array_equal(a, b)
