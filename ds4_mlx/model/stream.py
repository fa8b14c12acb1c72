"""Streaming a GGUF file's tensors into their resident form with bounded host memory.

Why: MLX's CUDA backend keeps an array made from host bytes (`mx.array(numpy)`) in CUDA managed memory that the
host touched first, so it stays in host RAM until the GPU touches it; only the outputs of device ops are
allocated in device memory. A loader that builds each tensor from host bytes and keeps it keeps the whole model
(81 GB for the q2 file) in host RAM next to the file's page cache (which a tmpfs cannot evict), and is killed on a
128 GB machine. So here every tensor goes

    mapped file --(reader thread: one host copy)--> staging array (host)
        --(conversion ops + `to_device`, evaluated on the default device)--> resident arrays (device)

and each staging array is dropped, and MLX's buffer cache cleared, as soon as its conversion is evaluated: host
memory beyond the page cache stays within about two chunks plus one batch (`chunk_bytes` each) whatever the
model's size. Small tensors are converted in batches, one evaluation per `chunk_bytes` of file data rather than
one per tensor; a tensor larger than a chunk is converted a chunk of rows at a time into its preallocated
resident arrays (in place: MLX reuses the buffer of an array nothing else holds). While the device converts, the
reader thread copies what comes next: the next chunk of the same tensor, or the first chunk of the tensor
predicted to be read next (the one that followed this tensor's counterpart in the previous layer).

On CUDA, a GGUF file's larger staging arrays are made by a device op instead and filled by model/pinned.py
(`pread` into page-locked buffers, DMA to the GPU): no host staging. (Taking a staging array's address through
numpy moves it into managed memory first, MLX's `Buffer::raw_ptr`; found on 2026-12-03, the load's 14.1 s was
measured so.)
`DS4_LOAD=mapped` keeps every tensor on the mapped-file path (to compare the two).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from ..kernels.machinery.cudagraph import address
from .gguf import GGUFFile, TensorInfo
from .pinned import CudaRuntime, PinnedReader

if TYPE_CHECKING:
    from .weights import ModelWeights

Convert = Callable[[mx.array], Sequence[mx.array]]
"""Raw rows, uint8 (n_rows, row_bytes), to the arrays the model keeps, each with n_rows leading rows."""

CUDA_CHUNK_BYTES = 512 << 20
"""Host staging per chunk or batch on CUDA: large, so that conversions run in few big evaluations."""
UNIFIED_CHUNK_BYTES = 8 << 20
"""Elsewhere host memory is device memory and every staged byte counts against the loaded model: small chunks."""
PINNED_MIN_BYTES = 1 << 20
"""Smaller tensors (norms, biases, the small projections' scales) take the mapped path: their few pages cost less
than a device allocation and its evaluation."""

_LAYER = re.compile(r"^(blk|mtp)\.(\d+)\.")


class TensorSource(Protocol):
    """What the weight classes (model/linear.py) read tensors through."""

    def info(self, name: str) -> TensorInfo: ...

    def read(self, name: str, convert: Convert) -> list[mx.array]: ...


def on_cuda() -> bool:
    """Whether arrays are evaluated by MLX's CUDA backend (host and device memory apart)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def device_memory_bytes() -> int:
    """Memory the current MLX device can use: the GPU's (MLX says `memory_size` on Metal, `total_memory` on CUDA),
    or the machine's RAM for the CPU backend."""
    info = mx.device_info()
    for key in ("memory_size", "total_memory"):
        if key in info:
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def to_device(arrays: Sequence[mx.array]) -> list[mx.array]:
    """The arrays as outputs of a device op, so that once evaluated they live in device memory.

    Why: on CUDA an array made from host bytes, and any view of it (a reshape, the float32 or int32 view of raw
    bytes), shares that host buffer: kept as it is, it would hold host RAM until the GPU first touched it, and keep
    the whole staging buffer alive. Adding zero on the device writes a fresh device allocation; for an
    intermediate that nothing else holds (a converted tensor) MLX does it in place, so it costs nothing. Call it
    while the staging array is still referenced, so that a view of it is copied, never donated. On the CPU and on
    Metal's unified memory host memory is the device's: the arrays are returned as they are.
    """
    if not on_cuda():
        return list(arrays)
    return [mx.add(a, mx.array(0, a.dtype)) for a in arrays]


@dataclass
class LoadStats:
    """Where a load's time went; the reader's copies overlap the device's conversions."""

    file_bytes: int = 0
    """Tensor bytes read from the file."""
    resident_bytes: int = 0
    """Bytes the loaded arrays hold."""
    seconds: float = 0.0
    copy_seconds: float = 0.0
    """Host copies from the mapped file into staging arrays (mostly on the reader thread)."""
    wait_seconds: float = 0.0
    """The loading thread waiting for a copy."""
    device_seconds: float = 0.0
    """Evaluating conversions and device copies."""
    evaluations: int = 0
    pinned_bytes: int = 0
    """File bytes copied to the device through page-locked buffers (model/pinned.py), a wrongly guessed prefetch's
    included; the rest came through the mapped file."""
    prefetched: int = 0
    """Chunks the reader had copied before they were asked for."""
    chunks: int = 0

    @property
    def gb_per_second(self) -> float:
        return self.file_bytes / self.seconds / 1e9 if self.seconds else 0.0


class TensorStream:
    """Reads tensors of a ModelWeights into resident arrays, in batches and chunks, with a reader thread ahead."""

    def __init__(self, weights: ModelWeights, progress: Callable[[int, int], None] | None = None,
                 chunk_bytes: int | None = None) -> None:
        self.weights = weights
        self.progress = progress
        self.chunk_bytes = chunk_bytes or (CUDA_CHUNK_BYTES if on_cuda() else UNIFIED_CHUNK_BYTES)
        self.stats = LoadStats()
        self.total = weights.nbytes
        self._start = time.perf_counter()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ds4-mlx-reader")
        self._ahead: tuple[tuple[str, int], Future[mx.array]] | None = None
        self._staged: list[mx.array] = []  # staging arrays of the pending batch
        self._outputs: list[mx.array] = []  # its lazy resident arrays
        self._pending_bytes = 0
        self._read: set[str] = set()
        self._last: str | None = None
        self._successor: dict[str, tuple[str, int]] = {}
        self._file_order = sorted(weights.file.tensors, key=lambda n: weights.file.tensors[n].offset)
        self._position = {name: i for i, name in enumerate(self._file_order)}
        self._pinned = _pinned_reader(weights)

    def info(self, name: str) -> TensorInfo:
        return self.weights.info(name)

    def read(self, name: str, convert: Convert) -> list[mx.array]:
        """The arrays `convert` makes of the tensor's raw rows, on their way to device memory.

        They may still be lazy: they are evaluated with the rest of their batch (or by `finish`)."""
        info = self.weights.info(name)
        self._learn(name)
        chunks = self._chunks(info)
        if len(chunks) == 1:
            staged = self._stage(name, *chunks[0])
            self._prefetch_next(name)
            outputs = to_device(convert(staged))
            self._staged.append(staged)
            self._outputs += outputs
            self._pending_bytes += info.nbytes
            del staged
            if self._pending_bytes >= self.chunk_bytes:
                self.flush()
            return outputs
        self.flush()
        outputs: list[mx.array] = []
        for i, (first, end) in enumerate(chunks):
            staged = self._stage(name, first, end)
            if i + 1 < len(chunks):
                self._prefetch(name, *chunks[i + 1])
            else:
                self._prefetch_next(name)
            parts = convert(staged)
            outputs = outputs or [mx.zeros((chunks[-1][1], *p.shape[1:]), p.dtype) for p in parts]
            _write(outputs, parts, first)
            del staged, parts
            self._evaluate(outputs, (end - first) * info.row_bytes)
        return outputs

    def copy(self, name: str, arrays: Sequence[mx.array]) -> list[mx.array]:
        """Stands for tensor `name`: device copies of the resident arrays of a tensor with the same bytes, made
        with the pending batch (a synthetic layout's layers share their draws but each keeps its own memory)."""
        self._learn(name)
        outputs = [mx.add(a, mx.array(0, a.dtype)) for a in arrays]
        self._outputs += outputs
        self._pending_bytes += self.weights.info(name).nbytes
        if self._pending_bytes >= self.chunk_bytes:
            self.flush()
        return outputs

    def flush(self) -> None:
        """Evaluates the pending batch and frees its staging arrays."""
        if not self._outputs:
            return
        outputs, self._outputs = self._outputs, []
        self._staged.clear()
        done, self._pending_bytes = self._pending_bytes, 0
        self._evaluate(outputs, done)

    def finish(self) -> LoadStats:
        """Evaluates what is pending, stops the reader and returns the load's figures."""
        self.flush()
        self._drop_ahead()
        self._reader.shutdown()
        if self._pinned is not None:
            self._pinned.close()
        self.stats.seconds = time.perf_counter() - self._start
        return self.stats

    def _evaluate(self, arrays: list[mx.array], file_bytes: int) -> None:
        """Evaluates the resident arrays; the staging arrays they came from must no longer be referenced here, so
        that clearing the cache returns their memory."""
        t = time.perf_counter()
        mx.eval(arrays)
        self.stats.device_seconds += time.perf_counter() - t
        self.stats.evaluations += 1
        mx.clear_cache()
        self.stats.file_bytes += file_bytes
        if self.progress is not None:
            self.progress(self.stats.file_bytes, self.total)

    def _chunks(self, info: TensorInfo) -> list[tuple[int, int]]:
        """Row ranges [first, end) of at most chunk_bytes each (one row at least)."""
        rows = info.nbytes // info.row_bytes
        if info.nbytes <= self.chunk_bytes:
            return [(0, rows)]
        step = max(1, self.chunk_bytes // info.row_bytes)
        return [(first, min(first + step, rows)) for first in range(0, rows, step)]

    def _copy(self, name: str, first: int, end: int) -> Callable[[], mx.array]:
        """A function that copies rows [first, end) of a tensor into a new MLX array, to be called on any thread.

        Through page-locked buffers into device memory where the reader allows it (the array is made and
        evaluated here, on the calling thread: MLX is driven from the loading thread only), else a host copy of
        the mapped rows."""
        info = self.weights.info(name)
        nbytes = (end - first) * info.row_bytes
        if self._pinned is None or nbytes < PINNED_MIN_BYTES:
            return lambda: self._mapped_copy(info, first, end)
        staged = mx.zeros((end - first, info.row_bytes), mx.uint8)  # `address` moves it to managed memory
        mx.eval(staged)
        at, offset, reader = address(staged), info.offset + first * info.row_bytes, self._pinned

        def fill() -> mx.array:
            t = time.perf_counter()
            reader.fill(at, offset, nbytes)
            self.stats.copy_seconds += time.perf_counter() - t
            self.stats.pinned_bytes += nbytes
            return staged

        return fill

    def _mapped_copy(self, info: TensorInfo, first: int, end: int) -> mx.array:
        """Rows [first, end) of a tensor copied from the mapped file into a new MLX array (host memory)."""
        t = time.perf_counter()
        rows = self.weights.tensor_rows(info.name, first, end)
        staged = mx.array(rows)
        self.stats.copy_seconds += time.perf_counter() - t
        return staged

    def _stage(self, name: str, first: int, end: int) -> mx.array:
        """The staging array of rows [first, end): the reader's copy if it made that one, else a copy now."""
        self.stats.chunks += 1
        t = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == (name, first):
            staged = self._ahead[1].result()
            self._ahead = None
            self.stats.prefetched += 1
        else:
            self._drop_ahead()
            staged = self._copy(name, first, end)()
        self.stats.wait_seconds += time.perf_counter() - t
        return staged

    def _prefetch(self, name: str, first: int, end: int) -> None:
        self._drop_ahead()
        self._ahead = ((name, first), self._reader.submit(self._copy(name, first, end)))

    def _drop_ahead(self) -> None:
        """Forgets a copy made for a wrong guess (waiting for it, so that at most one is ever in flight)."""
        if self._ahead is not None:
            self._ahead[1].result()
            self._ahead = None

    def _learn(self, name: str) -> None:
        """Remembers which tensor followed the previous one, in layer-independent terms."""
        self._read.add(name)
        if self._last is not None:
            (previous, layer), (following, next_layer) = _split(self._last), _split(name)
            self._successor[previous] = (following, next_layer - layer)
        self._last = name

    def _prefetch_next(self, name: str) -> None:
        """Starts copying the first chunk of the tensor most likely read after `name`."""
        guess = self._guess(name)
        if guess is not None:
            self._prefetch(guess, *self._chunks(self.weights.info(guess))[0])

    def _guess(self, name: str) -> str | None:
        """What followed this tensor's counterpart in an earlier layer, else the next unread tensor in the file."""
        pattern, layer = _split(name)
        if pattern in self._successor:
            following, delta = self._successor[pattern]
            guess = following.replace("{}", str(layer + delta), 1)
            if self.weights.has(guess) and guess not in self._read:
                return guess
        later = self._file_order[self._position[name] + 1:]
        return next((n for n in later if n not in self._read and self.weights.has(n)), None)


def _pinned_reader(weights: ModelWeights) -> PinnedReader | None:
    """The page-locked path for a GGUF file on CUDA, or None (elsewhere, `DS4_LOAD=mapped`, or no CUDA runtime
    found: the mapped path then serves every tensor)."""
    if (not on_cuda() or os.environ.get("DS4_LOAD", "").lower() == "mapped" or not isinstance(weights.file, GGUFFile)
            or not weights.whole_tensors):
        return None
    try:
        return PinnedReader(weights.file.path, CudaRuntime.load())
    except OSError as error:
        warnings.warn(f"loading through mapped memory (slower: {error})", stacklevel=3)
        return None


def _write(outputs: list[mx.array], parts: Sequence[mx.array], first: int) -> None:
    """Writes converted rows into the resident arrays from row `first` on (in place once evaluated)."""
    for out, part in zip(outputs, parts):
        out[first:first + part.shape[0]] = part


def _split(name: str) -> tuple[str, int]:
    """'blk.7.attn_kv.weight' -> ('blk.{}.attn_kv.weight', 7); names outside a layer get layer 0."""
    match = _LAYER.match(name)
    if match is None:
        return name, 0
    return f"{match.group(1)}.{{}}.{name[match.end():]}", int(match.group(2))
