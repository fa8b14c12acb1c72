"""File bytes to device memory on CUDA through page-locked host buffers: the streaming loader's fast path.

Why: copying a tensor out of the mapped file into a host MLX array costs a page fault for every 4 KB page on both
sides (the file's mapping, and the CUDA managed memory the array is made in), and the GPU then pulls that managed
memory over on demand, page by page. The 81 GB q2 file loaded at 1.4 GB/s that way (H200, the file in a tmpfs).
Here worker threads `pread` the file into page-locked buffers (the kernel copies from its page cache, no faults)
and hand each buffer to the GPU's copy engines (`cudaMemcpyAsync` into an array a device op made; see stream.py),
each worker on its own non-blocking stream, so MLX's work on its own streams goes on meanwhile. The same file then
loads in 14.1 s (6.1 GB/s, the loader's part 7.7 GB/s) with 1.65 GB of host RSS at most.

The CUDA runtime is the one MLX's CUDA build loaded into the process, reached through ctypes; anything missing
(another backend, no runtime found, page-locked memory refused) leaves the loader on its mapped-file path.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ..kernels.machinery import cudalib

PIECE_BYTES = 16 << 20
"""One worker's read and copy: large enough that a copy's fixed cost is small, small enough that the workers share
a 512 MB chunk evenly."""
WORKERS = max(4, min(16, os.cpu_count() or 4))
"""Read-and-copy threads, one a core up to 16: one `pread` from a page cache runs at 1-2 GB/s (8 threads reached
8.35 GB/s on the H200 machine's 16 cores, bench/RESULTS.md)."""


class Runtime(Protocol):
    """The CUDA runtime calls a PinnedReader makes (CudaRuntime; tests substitute host memory)."""

    def host_alloc(self, nbytes: int) -> int: ...

    def free_host(self, pointer: int) -> None: ...

    def new_stream(self) -> int: ...

    def destroy_stream(self, stream: int) -> None: ...

    def copy(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """Copies host `source` to `destination` and waits for it."""


class CudaRuntime:
    """libcudart through ctypes: page-locked allocations, streams, copies."""

    NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit ordering with the legacy default stream
    COPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        p, size, uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        for name, args in {"cudaHostAlloc": [ctypes.POINTER(p), size, uint], "cudaFreeHost": [p],
                           "cudaStreamCreateWithFlags": [ctypes.POINTER(p), uint], "cudaStreamDestroy": [p],
                           "cudaMemcpyAsync": [p, p, size, ctypes.c_int, p], "cudaStreamSynchronize": [p],
                           "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)], "cudaSetDevice": [ctypes.c_int]}.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        device = ctypes.c_int()
        self._check(lib.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice")
        self.device = device.value  # the loading thread's device: every worker copies to it
        self._bound = threading.local()

    @classmethod
    def load(cls) -> CudaRuntime:
        """The libcudart MLX loaded (found in this process's mappings), else one in pip's nvidia packages or on the
        library path; OSError when none loads."""
        return cudalib.load("cudart", cls)

    def _check(self, status: int, what: str) -> None:
        if status:
            raise OSError(f"{what}: {self.lib.cudaGetErrorString(status).decode()} (error {status})")

    def _bind(self) -> None:
        """Makes this thread's CUDA calls go to the loading thread's device (a new thread starts on device 0)."""
        if not getattr(self._bound, "done", False):
            self._check(self.lib.cudaSetDevice(self.device), "cudaSetDevice")
            self._bound.done = True

    def host_alloc(self, nbytes: int) -> int:
        self._bind()
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(pointer), nbytes, 0), "cudaHostAlloc")
        return pointer.value

    def free_host(self, pointer: int) -> None:
        self._check(self.lib.cudaFreeHost(ctypes.c_void_p(pointer)), "cudaFreeHost")

    def new_stream(self) -> int:
        self._bind()
        stream = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), self.NON_BLOCKING),
                    "cudaStreamCreateWithFlags")
        return stream.value

    def destroy_stream(self, stream: int) -> None:
        self._check(self.lib.cudaStreamDestroy(ctypes.c_void_p(stream)), "cudaStreamDestroy")

    def copy(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        self._bind()
        s = ctypes.c_void_p(stream)
        self._check(self.lib.cudaMemcpyAsync(ctypes.c_void_p(destination), ctypes.c_void_p(source), nbytes,
                                             self.COPY_DEFAULT, s), "cudaMemcpyAsync")
        self._check(self.lib.cudaStreamSynchronize(s), "cudaStreamSynchronize")


class PinnedReader:
    """Copies byte ranges of one file to device addresses, WORKERS threads at a time, each through its own
    page-locked buffer of PIECE_BYTES and its own stream."""

    def __init__(self, path: str | os.PathLike, runtime: Runtime, workers: int = WORKERS,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.runtime = runtime
        self.piece_bytes = piece_bytes
        self._fd = os.open(path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ds4-mlx-pinned")
        self._local = threading.local()
        self._owned: list[tuple[int, int]] = []  # (buffer, stream) of every worker, freed by close
        self._lock = threading.Lock()

    def fill(self, destination: int, offset: int, nbytes: int) -> None:
        """Copies file bytes [offset, offset + nbytes) to `destination` (a device address) and returns once all
        of them are there; OSError if the file ends early or a CUDA call fails."""
        pieces = split(nbytes, self.piece_bytes)
        list(self._pool.map(lambda p: self._piece(destination + p[0], offset + p[0], p[1]), pieces))

    def _piece(self, destination: int, offset: int, nbytes: int) -> None:
        buffer, stream = self._resources()
        view = (ctypes.c_ubyte * nbytes).from_address(buffer)
        got = 0
        while got < nbytes:
            n = os.preadv(self._fd, [memoryview(view)[got:]], offset + got)
            if n <= 0:
                raise OSError(f"the file ends at byte {offset + got}, {nbytes - got} bytes short of a tensor")
            got += n
        self.runtime.copy(destination, buffer, nbytes, stream)

    def _resources(self) -> tuple[int, int]:
        """This worker's page-locked buffer and stream, made at its first piece."""
        if not hasattr(self._local, "owned"):
            buffer = self.runtime.host_alloc(self.piece_bytes)
            self._local.owned = (buffer, self.runtime.new_stream())
            with self._lock:
                self._owned.append(self._local.owned)
        return self._local.owned

    def close(self) -> None:
        """Stops the workers and frees their buffers and streams."""
        self._pool.shutdown()
        for buffer, stream in self._owned:
            self.runtime.free_host(buffer)
            self.runtime.destroy_stream(stream)
        self._owned.clear()
        os.close(self._fd)


def split(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(start, length) pieces of at most piece_bytes covering [0, nbytes)."""
    return [(start, min(piece_bytes, nbytes - start)) for start in range(0, nbytes, piece_bytes)]
