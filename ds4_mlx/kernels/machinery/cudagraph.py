"""A recorded decode step replayed as one CUDA graph of our own, through the CUDA driver (CUDA only).

MLX evaluates a decode step node by node: ~20 µs of host work a node on the H200 (bench/RESULTS.md, 2026-12-02),
18 ms a token for the ~900 nodes of Flash's step against ~12.7 ms of GPU work, so the host sets the pace. Every
node of that step that does work is one of our custom kernels, launched from a cubin we compiled (nvrtc.py), so
its launches can be recorded (`nvrtc.recording`) and given to the driver as one graph: one launch a token, whatever
the node count. This module holds what that needs and nothing model-specific: the driver through ctypes, the
dependencies between launches from the address ranges they read and write (`dependencies`: a kernel waits for the
last writer of what it reads and for the readers of what it overwrites; independent kernels may overlap, as in
MLX's graphs), and the graph built from recorded launches (`ReplayGraph`).

A recording is only valid while every array it names is alive and unchanged in place, and it replays the launches
with the same addresses: bench/graph_replay.py measures a step that way (same inputs, same outputs).
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from . import cudalib
from .nvrtc import Launch

Span = tuple[int, int]
"""[start, end) of device addresses."""


def dependencies(reads: Sequence[Sequence[Span]], writes: Sequence[Sequence[Span]]) -> list[list[int]]:
    """For each launch, the earlier launches it must wait for: those that wrote what it reads (read after write)
    and those that read or wrote what it writes (write after read or write). Spans overlap when they share a
    byte. Launches are given in the order a stream would run them."""
    written, read = _Spans(), _Spans()
    out: list[list[int]] = []
    for index, (r, w) in enumerate(zip(reads, writes)):
        deps: set[int] = set()
        for span in r:
            deps |= written.overlapping(span)
        for span in w:
            deps |= written.overlapping(span) | read.overlapping(span)
        out.append(sorted(deps))
        for span in r:
            read.add(span, index)
        for span in w:
            written.add(span, index)
    return out


class _Spans:
    """Spans tagged with launch indices, found by overlap (sorted by start; any span starts at most `longest`
    bytes before a span it overlaps ends)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: list[tuple[int, int, int]] = []
        self.longest = 0

    def add(self, span: Span, index: int) -> None:
        at = bisect.bisect_right(self.starts, span[0])
        self.starts.insert(at, span[0])
        self.items.insert(at, (span[0], span[1], index))
        self.longest = max(self.longest, span[1] - span[0])

    def overlapping(self, span: Span) -> set[int]:
        start, end = span
        lo = bisect.bisect_right(self.starts, start - self.longest)
        hi = bisect.bisect_left(self.starts, end)
        return {index for s, e, index in self.items[lo:hi] if s < end and start < e}


ADDRESS_SOURCE = """
out[0] = (unsigned long long)(const void*)a;
bool contiguous = true;
long long expected = 1;
for (int i = a_ndim - 1; i >= 0; --i) {
  if (a_shape[i] != 1) {
    contiguous = contiguous && a_strides[i] == expected;
    expected *= a_shape[i];
  }
}
out[1] = contiguous;
"""
"""One thread writes the device address its input `a` was given (the buffer's, plus the array's offset) and
whether `a` is row-contiguous (MLX's own test of its shape and strides): what MLX passes a kernel, read without
touching the array on the host."""


def _layout(array: mx.array) -> tuple[int, bool]:
    """The device address of an evaluated array's first element and whether it is row-contiguous.

    On CUDA a kernel reads them (ADDRESS_SOURCE), so the array stays where MLX put it: in the device's memory pool.
    numpy's view of it would move it into managed memory first (MLX's `Buffer::raw_ptr` copies a device buffer
    into a new managed one), and the decode graphs name every weight: the whole model copied into managed memory
    while its device buffers were still held, which the driver made room for by evicting pages to the host (the
    weights' size in host RAM, or the process killed on a host without it; bench/RESULTS.md). Managed pages can be
    evicted, pool allocations cannot. An array whose address a graph holds must therefore never be read on the
    host (that would move it): the graphs copy out what the host reads (GraphDecoder.logits). Elsewhere (the CPU,
    Metal's unified memory) numpy's view is the array's own memory."""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        view = _numpy(array)
        return view.ctypes.data, bool(view.flags.c_contiguous)
    (out,) = _address_kernel()(inputs=[array.reshape(1) if array.ndim == 0 else array], grid=(1, 1, 1),
                               threadgroup=(1, 1, 1), output_shapes=[(2,)], output_dtypes=[mx.uint64])
    at, contiguous = (int(v) for v in out.tolist())
    return at, bool(contiguous)


_kernel = None


def _address_kernel():  # made on first use: mx.fast.cuda_kernel exists only in MLX's CUDA build
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="ds4_address", input_names=["a"], output_names=["out"],
                                      source=ADDRESS_SOURCE, ensure_row_contiguous=False)
    return _kernel


def address(array: mx.array) -> int:
    """The device address of an evaluated array's first element, read without moving it (see `_layout`)."""
    return _layout(array)[0]


def is_row_contiguous(array: mx.array) -> bool:
    return _layout(array)[1]


def _numpy(array: mx.array) -> np.ndarray:
    """numpy's view of the array's memory (a same-size integer view for dtypes numpy lacks)."""
    return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


class Moves:
    """Where arrays' bytes are in a replay: at their own addresses, except those bound to another buffer
    (`nvrtc.bind`), whose bytes, and those of every view into them, are at the target's."""

    def __init__(self, bound: Sequence[tuple[mx.array, mx.array | int]]) -> None:
        moves: dict[int, tuple[int, int]] = {}  # start -> (end, target): bound arrays are buffers of their own
        for array, target in bound:
            if isinstance(target, mx.array) and target.nbytes != array.nbytes:
                raise ValueError(f"an array of {array.nbytes} bytes bound to one of {target.nbytes}")
            start = address(array)
            moves.setdefault(start, (start + array.nbytes, target if isinstance(target, int) else address(target)))
        self.starts = sorted(moves)
        self.moves = [moves[s] for s in self.starts]

    def span(self, array: mx.array) -> Span:
        start = self.address(address(array))
        return start, start + array.nbytes

    def address(self, at: int) -> int:
        i = bisect.bisect_right(self.starts, at) - 1
        if i >= 0 and at < self.moves[i][0]:
            return self.moves[i][1] + (at - self.starts[i])
        return at


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names it and the driver's reason."""


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12 and later)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_memory", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Driver:
    """libcuda through ctypes, in the context MLX's CUDA runtime made current (its device's primary context)."""

    MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
    IS_MANAGED = 8  # CU_POINTER_ATTRIBUTE_IS_MANAGED
    PREFERRED_LOCATION = 3  # CU_MEM_ADVISE_SET_PREFERRED_LOCATION

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, pp, u, size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_size_t
        self.lib = lib
        signatures = {
            "cuInit": [u], "cuCtxGetCurrent": [pp], "cuModuleLoadData": [pp, p],
            "cuModuleGetFunction": [pp, p, ctypes.c_char_p], "cuFuncSetAttribute": [p, ctypes.c_int, ctypes.c_int],
            "cuStreamCreate": [pp, u], "cuStreamSynchronize": [p], "cuGraphCreate": [pp, u],
            "cuGraphAddKernelNode_v2": [pp, p, p, size, ctypes.POINTER(_KernelNodeParams)],
            "cuGraphInstantiateWithFlags": [pp, p, ctypes.c_ulonglong], "cuGraphLaunch": [p, p],
            "cuMemsetD8Async": [ctypes.c_ulonglong, ctypes.c_ubyte, size, p], "cuGraphDestroy": [p],
            "cuGraphExecDestroy": [p], "cuStreamDestroy_v2": [p],
            "cuPointerGetAttribute": [p, ctypes.c_int, ctypes.c_ulonglong],
            "cuMemAdvise": [ctypes.c_ulonglong, size, ctypes.c_int, ctypes.c_int],
            "cuMemPrefetchAsync": [ctypes.c_ulonglong, size, ctypes.c_int, p],
            "cuDeviceGetDefaultMemPool": [pp, ctypes.c_int], "cuMemPoolTrimTo": [p, size],
            "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
        }
        for name, args in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._modules: dict[bytes, int] = {}
        self._functions: dict[tuple[bytes, str], int] = {}
        self.check(lib.cuInit(0), "cuInit")
        context = ctypes.c_void_p()
        self.check(lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise DriverError("no CUDA context is current: evaluate an array on the GPU first")

    @classmethod
    def load(cls) -> Driver:
        return cudalib.load("cuda", cls)

    def check(self, status: int, what: str) -> None:
        if status != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(text))
            raise DriverError(f"{what} failed: {(text.value or b'?').decode()} ({status})")

    def new_stream(self) -> int:
        return self.handle("cuStreamCreate", Driver.NON_BLOCKING)

    def destroy_stream(self, stream: int) -> None:
        self.lib.cuStreamDestroy_v2(ctypes.c_void_p(stream))

    def synchronize(self, stream: int) -> None:
        self.check(self.lib.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")

    def is_managed(self, address: int) -> bool:
        flag = ctypes.c_uint(0)
        status = self.lib.cuPointerGetAttribute(ctypes.byref(flag), Driver.IS_MANAGED, address)
        return status == 0 and bool(flag.value)

    def keep_on_device(self, spans: Sequence[Span], stream: int) -> None:
        """Managed ranges advised to stay on the context's GPU and moved there now (in `stream`'s order): a
        kernel that reads a managed page the driver evicted to the host faults it back a page at a time."""
        device = self.device()
        for start, end in spans:
            self.check(self.lib.cuMemAdvise(start, end - start, Driver.PREFERRED_LOCATION, device), "cuMemAdvise")
            self.check(self.lib.cuMemPrefetchAsync(start, end - start, device, ctypes.c_void_p(stream)),
                       "cuMemPrefetchAsync")

    def trim_memory_pool(self) -> None:
        """The device's default memory pool (where MLX's stream-ordered allocations come from) gives back the
        memory it holds unused."""
        pool = self.handle("cuDeviceGetDefaultMemPool", self.device())
        self.check(self.lib.cuMemPoolTrimTo(ctypes.c_void_p(pool), 0), "cuMemPoolTrimTo")

    def device(self) -> int:
        """The current context's device (MLX's)."""
        device = ctypes.c_int()
        self.check(self.lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
        return device.value

    def function(self, cubin: bytes, name: str, shared_memory: int) -> int:
        """The kernel `name` of `cubin`, its module loaded once for the process (graphs of one step share them)."""
        key = (cubin, name)
        if key not in self._functions:
            if cubin not in self._modules:
                buffer = ctypes.create_string_buffer(cubin, len(cubin))
                self._modules[cubin] = self.handle("cuModuleLoadData", ctypes.cast(buffer, ctypes.c_void_p))
            function = self.handle("cuModuleGetFunction", ctypes.c_void_p(self._modules[cubin]), name.encode())
            if shared_memory > 48000:
                self.check(self.lib.cuFuncSetAttribute(ctypes.c_void_p(function), Driver.MAX_DYNAMIC_SHARED,
                                                       shared_memory), "cuFuncSetAttribute")
            self._functions[key] = function
        return self._functions[key]

    def handle(self, function: str, *args) -> int:
        """Calls `function(&out, *args)` and returns out."""
        out = ctypes.c_void_p()
        self.check(getattr(self.lib, function)(ctypes.byref(out), *args), function)
        return out.value or 0


class ReplayGraph:
    """Recorded launches as one instantiated CUDA graph: `launch()` runs them all, in the order and with the
    overlap their dependencies allow (`chain=True`: each after the one before, as one stream runs them). Graphs
    launched on one `stream` run one after the other; `bound` places arrays in other buffers (`nvrtc.bind`).
    Launches must come from our cubins, read row-contiguous arrays (or make none contiguous), and take no initial
    fill: anything else is refused with ValueError before any graph is made."""

    def __init__(self, driver: Driver, launches: Sequence[Launch], chain: bool = False,
                 bound: Sequence[tuple[mx.array, mx.array | int]] = (), stream: int | None = None) -> None:
        for launch in launches:
            if launch.cubin is None:
                raise ValueError(f"{launch.function} was compiled by MLX: no cubin to launch")
            if launch.init_value is not None:
                raise ValueError(f"{launch.function} takes an initial fill")
            if launch.row_contiguous and not all(is_row_contiguous(a) for a in launch.inputs):
                raise ValueError(f"{launch.function} reads an array MLX would copy first (not row-contiguous)")
        self.driver, self.launches, self.bound = driver, list(launches), list(bound)
        moved = Moves(bound)
        arrays = [([moved.span(a) for a in launch.inputs], [moved.span(a) for a in launch.outputs])
                  for launch in launches]
        self.spans = arrays
        order = [[i - 1] if i else [] for i in range(len(launches))] if chain else \
            dependencies([r for r, _ in arrays], [w for _, w in arrays])
        self.edges = sum(map(len, order))
        self._keep: list = []  # parameter buffers, alive while the graph is
        self.graph = driver.handle("cuGraphCreate", 0)
        nodes: list[int] = []
        for launch, (reads, writes), deps in zip(launches, arrays, order):
            nodes.append(self._add(launch, [s for s, _ in reads] + [s for s, _ in writes],
                                   [nodes[d] for d in deps]))
        self.exec = driver.handle("cuGraphInstantiateWithFlags", ctypes.c_void_p(self.graph), 0)
        self._own_stream = stream is None
        self.stream = driver.new_stream() if stream is None else stream

    def _add(self, launch: Launch, pointers: list[int], deps: list[int]) -> int:
        values = (ctypes.c_void_p * len(pointers))(*pointers)
        params = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(values) + 8 * i for i in range(len(pointers))])
        function = self.driver.function(launch.cubin, launch.function, launch.shared_memory)
        node_params = _KernelNodeParams(func=function, shared_memory=launch.shared_memory,
                                        params=ctypes.addressof(params))
        node_params.grid[:] = launch.blocks
        node_params.block[:] = launch.block
        dep_array = (ctypes.c_void_p * max(len(deps), 1))(*deps)
        self._keep += [values, params]
        return self.driver.handle("cuGraphAddKernelNode_v2", ctypes.c_void_p(self.graph),
                                  ctypes.cast(dep_array, ctypes.c_void_p), len(deps),
                                  ctypes.byref(node_params))

    def launch(self) -> None:
        self.driver.check(self.driver.lib.cuGraphLaunch(ctypes.c_void_p(self.exec), ctypes.c_void_p(self.stream)),
                          "cuGraphLaunch")

    def synchronize(self) -> None:
        self.driver.synchronize(self.stream)

    def clear_outputs(self) -> None:
        """Zeroes every recorded output (on the graph's stream), so that a launch must write them all again."""
        for _, writes in self.spans:
            for start, end in writes:
                self.driver.check(self.driver.lib.cuMemsetD8Async(start, 0, end - start,
                                                                  ctypes.c_void_p(self.stream)), "cuMemsetD8Async")

    def close(self) -> None:
        lib = self.driver.lib
        lib.cuGraphExecDestroy(ctypes.c_void_p(self.exec))
        lib.cuGraphDestroy(ctypes.c_void_p(self.graph))
        if self._own_stream:
            self.driver.destroy_stream(self.stream)
