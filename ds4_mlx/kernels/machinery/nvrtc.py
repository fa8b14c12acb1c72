"""CUDA custom kernels compiled once per machine and kept on disk, instead of once per process.

MLX compiles each `mx.fast.cuda_kernel` instance with NVRTC at its first launch in every process and keeps no copy:
custom kernels skip the disk cache MLX's own kernels use (`use_disk_cache` is false in MLX 0.32.4's
custom_kernel.cpp). A Flash session launches ~100 kernel instances (kernel x template constants), and the H200 spent
~140 s compiling them before each process's first token (bench/RESULTS.md, 2026-12-02).

Here the text MLX would build (`kernel_text`: MLX's layout, with the standard CUDA headers in place of MLX's
utils.cuh, which these kernels never use) is compiled by the NVRTC library MLX itself loaded, through ctypes, to a
cubin for the device's architecture with MLX's options; the cubin is stored under the cache directory, keyed by a
hash of text, options and NVRTC version, and launched with `mx.fast.precompiled_cuda_kernel`. A later process reads
it back instead of compiling. The launch hands MLX a ~55-byte handle rather than the cubin, which MLX would hash
at every launch: the cubin waits for MLX as a module file under that handle's name (`Modules`).

`CachedKernel` takes the place of the callable `mx.fast.cuda_kernel` returns, with the same keywords. Where NVRTC
can't be found or fails, or the cache can't be written, it launches through `mx.fast.cuda_kernel` as before, after
one warning. The first-use checks (registry.py) compare each kernel with its reference whichever way it was built.
DS4_CUDA_CACHE=off turns this off; DS4_CUDA_CACHE=DIR moves the cache (default $XDG_CACHE_HOME/ds4-mlx/cuda, or
~/.cache/ds4-mlx/cuda).

Inside `recording()` every launch is also listed (`Launch`: the cubin, the launch dimensions, the arrays), so that
kernels/machinery/cudagraph.py can hand the same launches to the driver as one graph of our own.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import mlx.core as mx

from . import cudalib

ENV = "DS4_CUDA_CACHE"
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
              mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.int16: "int16_t",
              mx.uint16: "uint16_t", mx.int8: "int8_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
HEADER = """#ifdef __CUDACC_RTC__
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""
"""What these kernels use of MLX's default header (utils.cuh, cooperative_groups.h, which they never call: left out,
their parsing is most of a compile). NVRTC has no C++ library, so the fixed-width integer types are spelled out
there (nvcc, bench/nvcc_check.py, takes them from <cstdint>)."""
MAGIC = b"ds4-mlx cubin 1\n"


class CudaCacheWarning(RuntimeWarning):
    """The cached route was not taken: kernels compile through MLX's own route, once per process."""


class CompileError(RuntimeError):
    """NVRTC refused a kernel's text; the message holds its log."""


Template = Sequence[tuple[str, "bool | int | mx.Dtype"]]


def function_name(name: str, template: Template) -> str:
    """The kernel function's name as MLX derives it (custom_kernel.cpp): profiles keep naming kernels alike."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{CUDA_TYPES[value]}")
    return f"custom_kernel_{name}{''.join(parts)}"


def kernel_text(function: str, header: str, source: str, inputs: Sequence[tuple[str, mx.Dtype]],
                outputs: Sequence[tuple[str, mx.Dtype]], template: Template,
                launch_bounds: tuple[int, int] | None = None) -> str:
    """A kernel's whole text laid out as MLX's CUDA backend lays it out for NVRTC (`build_kernel`): the default
    header (HEADER here), the kernel's header, a `__global__` function in namespace mlx::core::cu taking the inputs
    then the outputs (with `__launch_bounds__` where given), the template constants at the top of the body.
    `header` and `source` are already in CUDA's spelling."""
    params = [f"    const {CUDA_TYPES[dtype]}* {name}" for name, dtype in inputs]
    params += [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in outputs]
    constants = []
    for name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {str(value).lower()};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {name} = {value};")
        else:
            constants.append(f"  using {name} = {CUDA_TYPES[value]};")
    return (HEADER + header + "namespace mlx::core::cu {\n\n"
            f"__global__ void {_bounds(launch_bounds)}{function}(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(constants) + "\n\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


def _bounds(launch_bounds: tuple[int, int] | None) -> str:
    return f"__launch_bounds__({launch_bounds[0]}, {launch_bounds[1]}) " if launch_bounds else ""


class Nvrtc:
    """The few NVRTC calls a compile needs, over a loaded libnvrtc."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        c_char_pp = ctypes.POINTER(ctypes.c_char_p)
        for name, args in {
            "nvrtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2,
            "nvrtcCreateProgram": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                   c_char_pp, c_char_pp],
            "nvrtcDestroyProgram": [ctypes.POINTER(ctypes.c_void_p)],
            "nvrtcAddNameExpression": [ctypes.c_void_p, ctypes.c_char_p],
            "nvrtcCompileProgram": [ctypes.c_void_p, ctypes.c_int, c_char_pp],
            "nvrtcGetProgramLogSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetProgramLog": [ctypes.c_void_p, ctypes.c_char_p],
            "nvrtcGetLoweredName": [ctypes.c_void_p, ctypes.c_char_p, c_char_pp],
            "nvrtcGetCUBINSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetCUBIN": [ctypes.c_void_p, ctypes.c_char_p],
        }.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p

    @classmethod
    def load(cls) -> Nvrtc:
        """The libnvrtc MLX loaded (found in this process's mappings), else one in pip's nvidia packages (beside MLX
        or on sys.path) or on the library path."""
        return cudalib.load("nvrtc", cls)

    def _check(self, status: int, what: str) -> None:
        if status:
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, text: str, function: str, options: Sequence[str]) -> tuple[bytes, str]:
        """The cubin of `text` and the lowered (mangled) name of `function` in it, or CompileError with the log.
        ctypes releases the GIL inside the compile: threads compile in parallel."""
        program = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), text.encode(), f"{function}.cu".encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            expression = f"mlx::core::cu::{function}".encode()
            self._check(self.lib.nvrtcAddNameExpression(program, expression), "nvrtcAddNameExpression")
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(program, len(options), argv)
            if status:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(program, log)
                raise CompileError(f"{function}: {log.value.decode(errors='replace').strip()}")
            lowered = ctypes.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(program, expression, ctypes.byref(lowered)),
                        "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
            return cubin.raw, lowered.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))


def include_paths() -> list[Path]:
    """Where the CUDA headers are, searched as MLX searches them (jit_module.cpp): headers bundled with MLX, the
    nvidia Python packages beside it, then CUDA_HOME, CUDA_PATH and /usr/local/cuda."""
    root = cudalib.mlx_root()
    paths = [root / "include", root / "include" / "cccl"]
    paths += sorted(root.parent.glob("nvidia/cu*/include")) + [root.parent / "nvidia" / "cuda_runtime" / "include"]
    paths += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    paths.append(Path("/usr/local/cuda/include"))
    return [p for p in paths if p.is_dir()]


def compile_options(major: int, minor: int) -> list[str]:
    """MLX's NVRTC options for a device of compute capability major.minor (SASS, `a` features from sm_90)."""
    arch = f"--gpu-architecture=sm_{major}{minor}{'a' if major >= 9 else ''}"
    return ["--device-as-default-execution-space", arch] + [f"--include-path={p}" for p in include_paths()]


def cache_directory() -> Path | None:
    """Where cubins are kept: DS4_CUDA_CACHE, or $XDG_CACHE_HOME/ds4-mlx/cuda; None when DS4_CUDA_CACHE=off."""
    value = os.environ.get(ENV, "")
    if value.lower() in ("off", "0", "no", "false"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ds4-mlx" / "cuda"


@dataclass
class DiskCache:
    """Cubins on disk, one file each: a magic line, the lowered name, the cubin's SHA-256, the cubin. A file that
    does not read back whole is removed and compiled again; writes go through a rename, so readers never see half a
    file."""

    directory: Path

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def get(self, key: str) -> tuple[bytes, str] | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head, _, rest = data.partition(b"\n")
        name, _, rest = rest.partition(b"\n")
        digest, _, cubin = rest.partition(b"\n")
        if head + b"\n" != MAGIC or not name or hashlib.sha256(cubin).hexdigest().encode() != digest:
            path.unlink(missing_ok=True)
            return None
        return cubin, name.decode()

    def put(self, key: str, cubin: bytes, name: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = MAGIC + name.encode() + b"\n" + hashlib.sha256(cubin).hexdigest().encode() + b"\n" + cubin
        with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".part", delete=False) as part:
            part.write(data)
        os.replace(part.name, self.path(key))


@dataclass
class Route:
    """A compiler, its options and where its results are kept: what a CachedKernel needs to skip MLX's compile."""

    compiler: Nvrtc
    options: list[str]
    cache: DiskCache
    stamp: str  # the compiler's version: part of every key
    unstored: int = 0  # cubins that could not be written to the cache
    modules: Modules | None = None  # where MLX reads cubins launched by handle (check_route's second probe)

    def binary(self, text: str, function: str) -> tuple[bytes, str]:
        """`text`'s cubin and kernel name: from the disk when a process compiled it before, else compiled now (and
        used even when it cannot be stored: a full or read-only disk costs the next process a compile, once
        warned)."""
        key = hashlib.sha256("\0".join([self.stamp, *self.options, text]).encode()).hexdigest()[:40]
        found = self.cache.get(key)
        if found is None:
            found = self.compiler.compile(text, function, self.options)
            try:
                self.cache.put(key, *found)
            except OSError as error:
                if not self.unstored:
                    warnings.warn(f"compiled CUDA kernels are not kept in {self.cache.directory}: {error}",
                                  CudaCacheWarning, stacklevel=2)
                self.unstored += 1
        return found

    def source(self, cubin: bytes, lowered: str) -> bytes:
        """What MLX is handed for `cubin`: its handle where the route launches by handle, else the cubin itself
        (also when its module file cannot be written: then only MLX's per-launch hash costs more)."""
        if self.modules is not None:
            try:
                return self.modules.handle(cubin, lowered)
            except OSError as error:
                warnings.warn(f"{lowered} launches with its whole cubin ({error})", CudaCacheWarning, stacklevel=3)
        return cubin


_MURMUR = (0xC6A4A793 << 32) + 0x5BD1E995
_U64 = (1 << 64) - 1


def std_hash(data: bytes) -> int:
    """`std::hash<std::string>` of libstdc++ on 64-bit Linux (`_Hash_bytes`, a MurmurHash2 variant with seed
    0xc70f6907): the number in the module name MLX gives a custom kernel (`{name}_{hash:x}`, custom_kernel.cpp)."""
    def mix(v: int) -> int:
        return v ^ (v >> 47)

    size = len(data)
    whole = size & ~7
    value = (0xC70F6907 ^ (size * _MURMUR)) & _U64
    for at in range(0, whole, 8):
        word = mix(int.from_bytes(data[at:at + 8], "little") * _MURMUR & _U64) * _MURMUR & _U64
        value = (value ^ word) * _MURMUR & _U64
    if size & 7:
        value = (value ^ int.from_bytes(data[whole:], "little")) * _MURMUR & _U64
    return mix(mix(value) * _MURMUR & _U64)


def mlx_module_directory() -> Path:
    """Where MLX's CUDA backend looks for compiled modules before it builds one (jit_module.cpp `ptx_cache_dir`):
    MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"])
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def module_file(directory: Path, module: str) -> Path:
    """MLX's file for a module (`get_ptx_path`): names longer than 245 characters are cut into folders."""
    path, cut = directory, 245
    while len(module) > cut:
        path, module = path / module[:cut], module[cut:]
    return path / f"{module}.ptx"


@dataclass
class Modules:
    """Cubins handed to MLX as files under its module directory, launched by a short handle.

    MLX 0.32.4 hashes a precompiled kernel's whole source at every launch to name its module (10-220 KB of cubin:
    ~1.5-30 us of host time a launch, a decode step launches ~850), but builds a module from the source only when
    no file of that name is in its module directory, which it reads for custom kernels too. So each cubin is written
    there (with the `.txt` line naming its kernel) under the name its handle hashes to, and the handle, 55 bytes,
    is what MLX hashes per launch. `check_route` launches a probe this way first; where MLX does not find the file
    (another naming, a directory set before this process chose its own) the launch fails there and the route keeps
    passing whole cubins."""

    directory: Path

    def handle(self, cubin: bytes, lowered: str) -> bytes:
        """The short source for `cubin`, its module file written (atomically) unless it is there, byte for byte."""
        handle = b"ds4-mlx module " + hashlib.sha256(cubin).hexdigest()[:40].encode()
        path = module_file(self.directory, f"{lowered}_{std_hash(handle):x}")
        try:
            if path.read_bytes() == cubin:
                return handle
        except OSError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, data in ((path.with_suffix(".txt"), f"{lowered}\t{lowered}\n".encode()), (path, cubin)):
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as part:
                part.write(data)
            os.replace(part.name, target)
        return handle


PROBE = "const int i = threadIdx.x;\nif (i < N) y[i] = x[i] * 2.0f + 1.0f;"
"""The kernel a new route compiles and launches once before any other: the whole way (NVRTC, the disk, MLX's
precompiled launch) must give the right numbers, or MLX's own compile is used."""


def check_route(chosen: Route) -> None:
    """Compiles PROBE through `chosen`, launches it as the route launches kernels (by handle where it has modules)
    and compares; raises RuntimeError on a wrong result, or MLX's error where it found no module file."""
    template = [("N", 32)]
    function = function_name("ds4_route_probe", template)
    text = kernel_text(function, "", PROBE, [("x", mx.float32)], [("y", mx.float32)], template)
    cubin, lowered = chosen.binary(text, function)
    x = mx.arange(32, dtype=mx.float32)
    y = mx.fast.precompiled_cuda_kernel(name=lowered, compiled_source=chosen.source(cubin, lowered), inputs=[x],
                                        output_shapes=[(32,)], output_dtypes=[mx.float32], scalars=[],
                                        grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
    if not mx.array_equal(y, x * 2 + 1).item():
        raise RuntimeError("the probe kernel launched from its cubin gave wrong numbers")


@cache
def route() -> Route | None:
    """The cached route on this machine, checked once (check_route), or None (one warning saying why, unless
    DS4_CUDA_CACHE=off)."""
    directory = cache_directory()
    if directory is None:
        return None
    try:
        info = mx.device_info()
        major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
        compiler = Nvrtc.load()
        chosen = Route(compiler, compile_options(major, minor), DiskCache(directory),
                       "nvrtc %d.%d" % compiler.version())
        check_route(chosen)
    except Exception as error:  # noqa: BLE001 - whatever breaks the route, MLX's own compile remains
        warnings.warn(f"CUDA kernels compile in every process (no cache: {error})", CudaCacheWarning, stacklevel=2)
        return None
    try:
        chosen.modules = Modules(mlx_module_directory())
        check_route(chosen)
    except Exception as error:  # noqa: BLE001 - whatever breaks launching by handle, whole cubins remain
        chosen.modules = None
        warnings.warn(f"CUDA kernels launch with their whole cubin, which MLX hashes at every launch ({error})",
                      CudaCacheWarning, stacklevel=2)
    return chosen


@dataclass(frozen=True)
class Launch:
    """One launch as MLX's CUDA backend makes it (custom_kernel.cpp): the cubin's `function` over blocks of `block`
    threads, the input then output arrays' addresses as its parameters (no scalars, no shapes). `cubin` is None
    for a launch MLX compiled itself (no cubin of ours to launch again)."""

    cubin: bytes | None
    function: str
    blocks: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_memory: int
    inputs: tuple[mx.array, ...]
    outputs: tuple[mx.array, ...]
    row_contiguous: bool
    init_value: float | None


@dataclass
class Recording:
    """The CachedKernel launches made inside `recording()`, in order, and the arrays a replay is to place in
    another array's buffer (`bind`): a launch that writes a row into a buffer in place, say."""

    launches: list[Launch] = field(default_factory=list)
    bound: list[tuple[mx.array, mx.array | int]] = field(default_factory=list)


_recorders: list[Recording | None] = []  # None: paused


@contextmanager
def recording() -> Iterator[Recording]:
    """Records every CachedKernel launch made inside the block (kernels/machinery/cudagraph.py replays them)."""
    recorded = Recording()
    _recorders.append(recorded)
    try:
        yield recorded
    finally:
        _recorders.remove(recorded)


@contextmanager
def paused() -> Iterator[None]:
    """Launches inside the block are not recorded (a fast path's first-use check, made while a step is)."""
    _recorders.append(None)
    try:
        yield
    finally:
        _recorders.pop()


def is_recording() -> bool:
    return bool(_recorders) and _recorders[-1] is not None


def bind(array: mx.array, target: mx.array | int) -> None:
    """While recording: in the replay, `array`'s buffer is `target`'s (an array of as many bytes, or a device
    address), so that a launch writing `array` writes `target` in place and its readers read `target`."""
    if is_recording():
        _recorders[-1].bound.append((array, target))


def launch_dims(grid: tuple, threadgroup: tuple) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(blocks, block) of a launch, as MLX derives them from grid (threads) and threadgroup."""
    block = tuple(min(t, g) for t, g in zip(threadgroup, grid))
    blocks = tuple((g + t - 1) // t for g, t in zip(grid, threadgroup))
    return blocks, block


class CachedKernel:
    """What `mx.fast.cuda_kernel(...)` returns, called the same way, launched from a cubin compiled once per
    machine (`route()`); a kernel the route can't build launches through `mx.fast.cuda_kernel` instead."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0,
                 launch_bounds: tuple[int, int] | None = None):
        self.name, self.source, self.header, self.launch_bounds = name, source, header, launch_bounds
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous, self.shared_memory = ensure_row_contiguous, shared_memory
        self._binaries: dict[tuple, tuple[bytes, str, bytes] | None] = {}
        self._mlx: Callable | None = None
        self._route: Route | None = None

    def _mlx_kernel(self) -> Callable:
        """MLX's own kernel object, made the first time a launch needs it."""
        if self._mlx is None:
            self._mlx = mx.fast.cuda_kernel(
                name=self.name, input_names=self.input_names, output_names=self.output_names, source=self.source,
                header=self.header, ensure_row_contiguous=self.ensure_row_contiguous, shared_memory=self.shared_memory)
        return self._mlx

    def _binary(self, input_dtypes: tuple, output_dtypes: tuple, template: tuple
                ) -> tuple[bytes, str, bytes] | None:
        """(what MLX is handed, the lowered name, the cubin) of one instance, or None where MLX compiles it."""
        chosen = route()
        if chosen is not self._route:  # another route (a test's, or DS4_CUDA_CACHE changed): what it builds
            self._route, self._binaries = chosen, {}
        key = (input_dtypes, output_dtypes, template)
        if key not in self._binaries:
            self._binaries[key] = None
            if chosen is not None:
                function = function_name(self.name, template)
                text = kernel_text(function, self.header, self.source, list(zip(self.input_names, input_dtypes)),
                                   list(zip(self.output_names, output_dtypes)), template, self.launch_bounds)
                try:
                    cubin, lowered = chosen.binary(text, function)
                    self._binaries[key] = chosen.source(cubin, lowered), lowered, cubin
                except (OSError, CompileError) as error:
                    warnings.warn(f"{function} compiles through MLX in every process ({error})",
                                  CudaCacheWarning, stacklevel=3)
        return self._binaries[key]

    def __call__(self, *, inputs: list, output_shapes: list, output_dtypes: list, grid: tuple, threadgroup: tuple,
                 template: Template | None = None, init_value: float | None = None, verbose: bool = False,
                 stream: mx.Stream | mx.Device | None = None) -> list[mx.array]:
        template = tuple(template or ())
        binary = None
        if all(isinstance(x, mx.array) for x in inputs) and not verbose:
            binary = self._binary(tuple(x.dtype for x in inputs), tuple(output_dtypes), template)
        if binary is None:
            outputs = self._mlx_kernel()(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                         grid=grid, threadgroup=threadgroup, template=list(template) or None,
                                         init_value=init_value, verbose=verbose, stream=stream)
            cubin, lowered = None, function_name(self.name, template)
        else:
            source, lowered, cubin = binary
            outputs = mx.fast.precompiled_cuda_kernel(
                name=lowered, compiled_source=source, inputs=inputs, output_shapes=output_shapes,
                output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                shared_memory=self.shared_memory, init_value=init_value,
                ensure_row_contiguous=self.ensure_row_contiguous, stream=stream)
        if is_recording():
            blocks, block = launch_dims(grid, threadgroup)
            _recorders[-1].launches.append(Launch(cubin, lowered, blocks, block, self.shared_memory, tuple(inputs),
                                         tuple(outputs), self.ensure_row_contiguous, init_value))
        return outputs
