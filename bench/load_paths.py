"""How fast file bytes become device-resident MLX arrays, by each path MLX offers, and the host memory each takes.

    python bench/load_paths.py /mnt/ram/flash.gguf --gb 16          # on the GPU machine, after make-model
    python bench/load_paths.py FILE --json

The streaming loader (model/stream.py) uses the first path; this measures it against the alternative, chunk by
chunk over the first --gb of FILE (every chunk checked against the file):

- array: `mx.array(numpy view of the mapped file)` makes a host copy (CUDA managed memory, touched first by the
  host), then a device op (`+ 0`) writes a device allocation and the copy is freed;
- load: `mx.load` of a file object that presents the chunk as an .npy file. MLX's CUDA Load primitive reads it into a
  malloc'd host buffer and cudaMemcpyAsync's it into device memory: no managed memory. `--threads N` copies into
  that buffer with N threads (numpy copies release the GIL);
- memcpy: a device allocation (`mx.zeros`, written by the GPU, so its managed pages live in device memory) filled
  by the CUDA runtime's cudaMemcpy straight from the mapped file (ctypes; the array's pointer through the buffer
  protocol): one copy by the DMA engines, no host staging array. `--threads N` splits each chunk over N threads.
- pinned: the streaming loader's path on CUDA (model/pinned.py): the same device allocation filled by N threads,
  each `pread`ing PIECE_BYTES pieces of the file into its page-locked buffer and copying it with cudaMemcpyAsync on its
  own stream: no page faults on either side.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx import hostmem
from ds4_mlx.model.pinned import CudaRuntime, PinnedReader
from ds4_mlx.model.stream import on_cuda, to_device


class NpyView(io.RawIOBase):
    """A read-only file object holding `data` (uint8, 1-D) as a .npy file, copied out with `threads` threads."""

    def __init__(self, data: np.ndarray, pool: ThreadPoolExecutor | None = None, threads: int = 1) -> None:
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": "|u1", "fortran_order": False, "shape": (data.size,)})
        self._head = np.frombuffer(head.getvalue(), np.uint8)
        self._data = data
        self._pool = pool
        self._threads = threads
        self._pos = 0
        self.name = "chunk.npy"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self._head.size + self._data.size
        self._pos = {0: offset, 1: self._pos + offset, 2: size + offset}[whence]
        return self._pos

    def readinto(self, buffer) -> int:
        out = np.frombuffer(buffer, np.uint8)
        pieces, pos, done = [], self._pos, 0
        for part in (self._head, self._data):
            if pos < part.size and done < out.size:
                n = min(part.size - pos, out.size - done)
                pieces.append((out[done:done + n], part[pos:pos + n]))
                done += n
            pos = max(0, pos - part.size)
        for dst, src in pieces:
            self._copy(dst, src)
        self._pos += done
        return done

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self._pool is None or src.size < 1 << 24:
            dst[:] = src
            return
        bounds = np.linspace(0, src.size, self._threads + 1, dtype=np.int64)
        list(self._pool.map(lambda i: dst.__setitem__(slice(bounds[i], bounds[i + 1]), src[bounds[i]:bounds[i + 1]]),
                            range(len(bounds) - 1)))


def via_array(chunk: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> mx.array:
    staged = mx.array(chunk)
    (resident,) = to_device([staged])
    mx.eval(resident)
    return resident


def via_load(chunk: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> mx.array:
    return mx.load(NpyView(chunk, pool, threads), format="npy")


def cudart() -> ctypes.CDLL:
    """The CUDA runtime MLX's CUDA build loaded into this process (the loader's, model/pinned.py)."""
    return CudaRuntime.load().lib


def device_bytes(n: int) -> tuple[mx.array, int]:
    """A uint8 array of n bytes written by the GPU (its managed pages in device memory) and its address (no page
    is touched)."""
    resident = mx.zeros((n,), mx.uint8)
    mx.eval(resident)
    mx.synchronize()
    return resident, np.asarray(resident).ctypes.data


def via_memcpy(chunk: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> mx.array:
    resident, dst = device_bytes(chunk.size)
    src = chunk.ctypes.data
    rt = cudart()

    def copy(first: int, end: int) -> None:
        err = rt.cudaMemcpy(ctypes.c_void_p(dst + first), ctypes.c_void_p(src + first), ctypes.c_size_t(end - first),
                            ctypes.c_int(4))  # cudaMemcpyDefault
        if err:
            raise SystemExit(f"cudaMemcpy failed: error {err}")

    bounds = np.linspace(0, chunk.size, max(1, threads) + 1, dtype=np.int64)
    if pool is None:
        copy(0, chunk.size)
    else:
        list(pool.map(lambda i: copy(int(bounds[i]), int(bounds[i + 1])), range(len(bounds) - 1)))
    rt.cudaDeviceSynchronize()
    return resident


_READER: PinnedReader | None = None
_BASE = 0  # the mapping's address: a chunk's file offset is its address minus this


def via_pinned(chunk: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> mx.array:
    resident, dst = device_bytes(chunk.size)
    _READER.fill(dst, chunk.ctypes.data - _BASE, chunk.size)
    return resident


PATHS = {"array": via_array, "load": via_load, "memcpy": via_memcpy, "pinned": via_pinned}


def measure(data: np.ndarray, path: str, chunk_bytes: int, threads: int) -> dict:
    """GB/s of one path over `data`, with the host memory it took; every chunk checked against the file."""
    make = PATHS[path]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    hostmem.reset_peak()
    before = hostmem.status().get("RssAnon", 0)
    seconds = 0.0
    with hostmem.Sampler(interval=0.01) as sampler:
        for first in range(0, data.size, chunk_bytes):
            chunk = data[first:first + chunk_bytes]
            t = time.perf_counter()
            resident = make(chunk, pool, threads)
            seconds += time.perf_counter() - t
            sample = np.asarray(resident[:: 1 << 16])  # reads back a strided sample: copies little
            if not np.array_equal(sample, chunk[:: 1 << 16]):
                raise SystemExit(f"{path}: chunk at {first} differs from the file")
            del resident
            mx.clear_cache()
    return {"path": path, "threads": threads, "gb": data.size / 1e9, "seconds": round(seconds, 3),
            "gb_per_second": round(data.size / seconds / 1e9, 3),
            "peak_anon_added_bytes": sampler.peaks.anon - before, "min_available_bytes": sampler.peaks.min_available}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path, help="a large file (the tmpfs GGUF on the GPU machine)")
    p.add_argument("--gb", type=float, default=8.0, help="how much of the file to move (default 8 GB)")
    p.add_argument("--chunk-mb", type=int, default=512, help="bytes per array (default 512 MB)")
    p.add_argument("--threads", type=int, default=4, help="copy threads for the second load run (default 4)")
    p.add_argument("--path", choices=sorted(PATHS), help="measure only this path (with --threads)")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    args = p.parse_args(argv)
    with open(args.file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, np.uint8, count=min(len(mapped), int(args.gb * 1e9)))
    if on_cuda():
        global _READER, _BASE
        _READER, _BASE = PinnedReader(args.file, CudaRuntime.load(), workers=args.threads), data.ctypes.data
    runs = [("array", 1), ("load", 1), ("load", args.threads)]
    if on_cuda():  # the memcpy path needs MLX's CUDA backend: its arrays are CUDA allocations
        runs += [("memcpy", 1), ("memcpy", args.threads), ("pinned", args.threads)]
    elif args.path in ("memcpy", "pinned"):
        raise SystemExit(f"--path {args.path} needs MLX's CUDA backend")
    for path, threads in runs if args.path is None else [(args.path, args.threads)]:
        result = measure(data, path, args.chunk_mb << 20, threads)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{path:<5} threads {threads}: {result['gb']:.2f} GB in {result['seconds']:.2f} s "
                  f"({result['gb_per_second']:.2f} GB/s), host anonymous +{result['peak_anon_added_bytes'] / 2**30:.2f}"
                  f" GiB at peak", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
