"""The Metal rendering of custom kernels, compiled for the CPU: one std::thread per GPU thread.

No Apple GPU and no Metal compiler are needed: the text MLX 0.32's `mx.fast.metal_kernel` would hand to the Metal
compiler is C++ once Metal's words are defined for threads on the CPU. `metal_text` writes that text as MLX's
write_signature does (mlx/backend/common/metal_kernel.cpp): the header, `template <int N, bool B, ...>` for the
template constants, `[[kernel]] void custom_kernel_<name>_<template>_<dtypes>(...)` with each input `const device
T* x [[buffer(i)]]` (`const constant T*` when it has fewer than 8 elements, `const constant T&` when it has no
dimension), each output `device T* y [[buffer(i)]]`, then one `uint3 thread_position_in_threadgroup
[[thread_position_in_threadgroup]]` and the like for every thread attribute whose name the body contains, the body,
and the explicit instantiation `template [[host_name("...")]] [[kernel]] decltype(f<...>) f<...>;`.

METAL (below, after emulated_threads.MACHINERY) stands in for what MLX puts before that text (its kernels' utils.h:
metal_stdlib, `using namespace metal`, float16_t and bfloat16_t) and for the Metal standard library functions the
kernels and the dialect's Metal prelude call (threadgroup and SIMD-group barriers, simd_sum, simd_max,
simd_shuffle_xor, threadgroup and device atomics, as_type, half, vector types, metal::precise math, popcount,
rint). The address spaces `device`, `constant` and `thread` are nothing on the CPU, `threadgroup` too where it
qualifies a pointer; a `threadgroup` variable becomes a static one (shared by the threads running the group, as in
emulated_cuda.py's __shared__) whose bytes are counted. g++ ignores Metal's attributes ([[kernel]], [[buffer(i)]],
[[thread_position_in_grid]], ...), so the declared text compiles as written.

Each launch is checked against Apple's limits (`APPLE_LIMITS`): at most 1024 threads a threadgroup, a multiple of
the 32-lane SIMD width, at most 32 KB of threadgroup memory; and the text against what Metal lacks: a threadgroup
variable outside the kernel function, C's f-suffixed math functions, CUDA's words. Every launch is logged in
LAUNCHES (kernel, threads, threadgroup bytes). What the emulation cannot say: whether Apple's compiler accepts what
g++ does (it is stricter about address spaces), the pipeline's own thread limit (registers), timing, and the
last bits of Metal's math functions (std:: float functions here). bfloat16 arrays are not emulated (numpy has no
such dtype, g++ 12 no __bf16).
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery.dialect import METAL, Kernel
from emulated_threads import compile_library, numpy_dtype, runner

APPLE_LIMITS = {"threads_per_threadgroup": 1024, "simd_width": 32, "threadgroup_bytes": 32 << 10}
"""Apple GPUs (Apple7 and later): threads a threadgroup may hold, the SIMD group's width, threadgroup memory."""

METAL_HOST = r"""
#include <mutex>
#include <set>
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef half float16_t;
template <class T, int N> struct vec;
template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
typedef vec<float, 2> float2;
typedef vec<float, 4> float4;
typedef vec<uint, 2> uint2;
typedef vec<uint, 4> uint4;
typedef vec<half, 2> half2;
typedef vec<half, 4> half4;
struct uint3 { uint x, y, z; };
template <class T, class U> inline T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of one size");
  T t;
  std::memcpy(&t, &v, sizeof(T));
  return t;
}
std::mutex threadgroup_lock;
std::set<const void*> threadgroup_variables;
size_t threadgroup_total = 0;
// each thread of the group registers the variable it declares; a variable counts once
inline void emulated_threadgroup_variable(const void* at, size_t bytes) {
  std::lock_guard<std::mutex> hold(threadgroup_lock);
  if (threadgroup_variables.insert(at).second) threadgroup_total += (bytes + 15) / 16 * 16;
}
namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup,
                          thread_scope_device };
constexpr thread_scope thread_scope_device = thread_scope::thread_scope_device;
constexpr thread_scope thread_scope_threadgroup = thread_scope::thread_scope_threadgroup;
inline void threadgroup_barrier(mem_flags) { emulated_group_barrier(); }
inline void simdgroup_barrier(mem_flags) { emulated_simd_barrier(); }
inline float simd_sum(float v) { return lane_sum(v); }
inline int simd_sum(int v) { return lane_sum(v); }
inline float simd_max(float v) { return lane_max(v); }
template <class T> inline T simd_shuffle_xor(T v, ushort mask) { return lane_xor(v, mask); }
inline uint popcount(uint v) { return __builtin_popcount(v); }
inline float rint(float v) { return std::rint(v); }
inline float sqrt(float v) { return std::sqrt(v); }
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
inline float exp(float v) { return std::exp(v); }
inline float log(float v) { return std::log(v); }
inline float fabs(float v) { return std::fabs(v); }
inline float abs(float v) { return std::fabs(v); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float ceil(float v) { return std::ceil(v); }
inline float floor(float v) { return std::floor(v); }
inline bool isnan(float v) { return std::isnan(v); }
inline bool isinf(float v) { return std::isinf(v); }
inline bool isfinite(float v) { return std::isfinite(v); }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
namespace precise {
inline float exp(float v) { return std::exp(v); }
inline float log(float v) { return std::log(v); }
inline float cos(float v) { return std::cos(v); }
inline float sin(float v) { return std::sin(v); }
inline float divide(float a, float b) { return a / b; }
inline float sqrt(float v) { return std::sqrt(v); }
}  // namespace precise
struct atomic_int { int value; };
struct atomic_uint { uint value; };
inline int atomic_fetch_add_explicit(atomic_int* p, int v, memory_order) {
  return std::atomic_ref<int>(p->value).fetch_add(v);
}
inline uint atomic_fetch_add_explicit(atomic_uint* p, uint v, memory_order) {
  return std::atomic_ref<uint>(p->value).fetch_add(v);
}
inline void atomic_store_explicit(atomic_uint* p, uint v, memory_order) { std::atomic_ref<uint>(p->value).store(v); }
inline uint atomic_load_explicit(atomic_uint* p, memory_order) { return std::atomic_ref<uint>(p->value).load(); }
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
}  // namespace metal
using namespace metal;
#define device
#define constant
#define thread
#define threadgroup
"""

TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "float16_t", np.dtype(np.int32): "int32_t",
         np.dtype(np.uint32): "uint32_t", np.dtype(np.uint8): "uint8_t", np.dtype(np.bool_): "bool",
         np.dtype(np.int64): "int64_t", np.dtype(np.uint16): "uint16_t", np.dtype(np.int8): "int8_t"}
"""MLX's get_type_string for the dtypes the kernels take."""

MAX_CONSTANT_ARRAY_SIZE = 8
"""Inputs with fewer elements than this are passed in Metal's constant address space (MLX's rule)."""

ATTRIBUTES = {  # MLX's metal_attributes, each with its value for thread t of threadgroup (x, y)
    "dispatch_quadgroups_per_threadgroup": ("uint", "(threads + 3) / 4"),
    "dispatch_simdgroups_per_threadgroup": ("uint", "(threads + 31) / 32"),
    "dispatch_threads_per_threadgroup": ("uint3", "uint3{(uint)threads, 1u, 1u}"),
    "grid_origin": ("uint3", "uint3{0u, 0u, 0u}"),
    "grid_size": ("uint3", "uint3{(uint)(groups_x * threads), (uint)groups_y, 1u}"),
    "quadgroup_index_in_threadgroup": ("uint", "t / 4"),
    "quadgroups_per_threadgroup": ("uint", "(threads + 3) / 4"),
    "simdgroup_index_in_threadgroup": ("uint", "t / 32"),
    "simdgroups_per_threadgroup": ("uint", "(threads + 31) / 32"),
    "thread_execution_width": ("uint", "32u"),
    "thread_index_in_quadgroup": ("uint", "t % 4"),
    "thread_index_in_simdgroup": ("uint", "t % 32"),
    "thread_index_in_threadgroup": ("uint", "t"),
    "thread_position_in_grid": ("uint3", "uint3{emulated_group.x * threads + t, emulated_group.y, 0u}"),
    "thread_position_in_threadgroup": ("uint3", "uint3{t, 0u, 0u}"),
    "threadgroup_position_in_grid": ("uint3", "uint3{emulated_group.x, emulated_group.y, 0u}"),
    "threadgroups_per_grid": ("uint3", "uint3{(uint)groups_x, (uint)groups_y, 1u}"),
    "threads_per_grid": ("uint3", "uint3{(uint)(groups_x * threads), (uint)groups_y, 1u}"),
    "threads_per_simdgroup": ("uint", "32u"),
    "threads_per_threadgroup": ("uint3", "uint3{(uint)threads, 1u, 1u}"),
}

NOT_METAL = re.compile(r"\b(__\w+|threadIdx|blockIdx|blockDim|(?:exp|log|sqrt|rsqrt|fabs|fmax|fmin|pow|floor|ceil"
                       r"|sin|cos|tanh|rint|round)f|ds4_(?:mma|wgmma|ldmatrix|copy16_async|copy4_async|async|bar_|"
                       r"bulk_copy|tf32|half2|quant_half2|quant_fma|fence_async)\w*)\b")
"""Words of CUDA (its intrinsics, thread indices, the dialect's CUDA-only helpers) and C's float math functions,
which Metal does not have: none may appear in Metal text."""

_DECLARATION = re.compile(r"\bthreadgroup\s+((?:(?:const|unsigned|signed|long|short)\s+)*[A-Za-z_][\w:]*(?:<[^<>;]*>)?)"
                          r"\s+([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);")
"""A threadgroup variable's declaration (not a pointer's qualifier: no * or & between the type and the name)."""


@dataclasses.dataclass
class Launch:
    """One emulated Metal launch: the kernel, its template, threads per threadgroup and threadgroup bytes."""

    kernel: str
    template: tuple[tuple[str, object], ...]
    threads: int
    threadgroup_bytes: int


LAUNCHES: list[Launch] = []
"""Every emulated Metal launch of this process, in order."""


def mlx_arguments(kernel: Kernel) -> dict[str, object]:
    """What dialect.METAL hands to mx.fast.metal_kernel for `kernel` (name, input and output names, source,
    header)."""
    received: dict[str, object] = {}
    dataclasses.replace(METAL, make=lambda **kw: received.update(kw)).compile(kernel)
    return received


MLX_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
             mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
"""get_type_string for dtypes given as template arguments (`typename` parameters)."""


def template_text(value: object) -> str:
    """A template argument as MLX writes it (bools as 1 / 0, dtypes by their Metal type)."""
    if isinstance(value, mx.Dtype):
        return MLX_TYPES[value]
    return str(int(value)) if isinstance(value, bool) else str(value)


def metal_text(kernel: Kernel, template: Sequence[tuple[str, object]], inputs: Sequence[np.ndarray],
               output_dtypes: Sequence[np.dtype]) -> tuple[str, str, list[str]]:
    """(the host name, the text MLX's write_signature makes, the thread attributes in signature order)."""
    args = mlx_arguments(kernel)
    source, header = str(args["source"]), str(args["header"])
    name = f"custom_kernel_{args['name']}"
    definition = ""
    if template:
        definition = "<" + ", ".join(template_text(v) for _, v in template) + ">"
        name += "_" + definition.replace(", ", "_").replace("<", "_").replace(">", "_")[1:-1]
    for a in inputs:
        name += "_" + TYPES[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    name += "".join("_" + TYPES[d] for d in output_dtypes)
    for input_name in args["input_names"]:
        assert not any(input_name + suffix in source for suffix in ("_shape", "_strides", "_ndim")), (
            f"{kernel.name}: shapes, strides and ndim of inputs are not emulated")
    text = header
    if template:
        kinds = ["typename" if isinstance(v, mx.Dtype) else "bool" if isinstance(v, bool) else "int"
                 for _, v in template]
        text += "template <" + ", ".join(f"{kind} {n}" for kind, (n, _) in zip(kinds, template)) + ">\n"
    params = []
    for i, (input_name, a) in enumerate(zip(args["input_names"], inputs, strict=True)):
        space = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        params.append(f"  const {space} {TYPES[a.dtype]}{'&' if a.ndim == 0 else '*'} {input_name} [[buffer({i})]]")
    for i, (output_name, d) in enumerate(zip(args["output_names"], output_dtypes, strict=True)):
        params.append(f"  device {TYPES[d]}* {output_name} [[buffer({len(inputs) + i})]]")
    attributes = [attr for attr in ATTRIBUTES if attr in source]
    params += [f"  {ATTRIBUTES[attr][0]} {attr} [[{attr}]]" for attr in attributes]
    text += f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {\n" + source + "\n}\n"
    if template:
        text += (f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{definition}) '
                 f"{name}{definition};\n")
    return name + definition, text, attributes


def checked_text(kernel: Kernel) -> None:
    """Fail where `kernel`'s Metal text holds what Metal lacks (NOT_METAL) or declares a threadgroup variable
    outside the kernel function (Metal allows them at kernel function scope only)."""
    args = mlx_arguments(kernel)
    words = sorted(set(NOT_METAL.findall(str(args["header"]) + str(args["source"]))))
    assert not words, f"{kernel.name}'s Metal text uses {', '.join(words)}, which Metal does not have"
    outside = _DECLARATION.findall(str(args["header"]))
    assert not outside, f"{kernel.name} declares threadgroup variables outside its kernel function: {outside}"


def counted_declarations(text: str) -> str:
    """Threadgroup variables made static, each registering its bytes once declared."""

    def static(match: re.Match) -> str:
        kind, name, rest = match.groups()
        return f"static {kind} {name}{rest}; emulated_threadgroup_variable(&{name}, sizeof({name}));"

    return _DECLARATION.sub(static, text)


def kernel_library(kernel: Kernel, template: Sequence[tuple[str, object]], inputs: Sequence[np.ndarray],
                   output_dtypes: Sequence[np.dtype], directory: Path) -> ctypes.CDLL:
    """The kernel's Metal text as MLX declares it, compiled after METAL_HOST, with an extern "C" launch(void**
    buffers, groups_x, groups_y, threads) running it over the grid and threadgroup_bytes() after it."""
    checked_text(kernel)
    function, text, attributes = metal_text(kernel, template, inputs, output_dtypes)
    header = len(str(mlx_arguments(kernel)["header"]))
    text = text[:header] + counted_declarations(text[header:])
    arguments = [f"{'*' if a.ndim == 0 else ''}(const {TYPES[a.dtype]}*)buffers[{i}]" for i, a in enumerate(inputs)]
    arguments += [f"({TYPES[d]}*)buffers[{len(inputs) + i}]" for i, d in enumerate(output_dtypes)]
    arguments += [ATTRIBUTES[attr][1] for attr in attributes]
    text += ('extern "C" void launch(void** buffers, int groups_x, int groups_y, int threads) {\n'
             "  threadgroup_variables.clear();\n  threadgroup_total = 0;\n"
             "  run_groups(groups_x, groups_y, threads, [=] {\n    const uint t = emulated_thread.x;\n"
             f"    {function}({', '.join(arguments)});\n  }});\n}}\n"
             'extern "C" size_t threadgroup_bytes() { return threadgroup_total; }\n')
    library = compile_library(METAL_HOST + text, directory, kernel.name, ["-Wno-attributes"])
    library.threadgroup_bytes.restype = ctypes.c_size_t
    return library


class CheckedLaunches:
    """A kernel library whose launches are held to APPLE_LIMITS and logged in LAUNCHES."""

    def __init__(self, library: ctypes.CDLL, kernel: Kernel, template: Sequence[tuple[str, object]]):
        self.library, self.kernel, self.template = library, kernel, tuple(template)

    def launch(self, buffers: ctypes.Array, groups_x: int, groups_y: int, threads: int) -> None:
        name = self.kernel.name
        assert threads <= APPLE_LIMITS["threads_per_threadgroup"], f"{name}: {threads} threads a threadgroup"
        assert threads % APPLE_LIMITS["simd_width"] == 0, f"{name}: {threads} threads, not whole SIMD groups"
        self.library.launch(buffers, groups_x, groups_y, threads)
        used = self.library.threadgroup_bytes()
        assert used <= APPLE_LIMITS["threadgroup_bytes"], f"{name}: {used} bytes of threadgroup memory"
        LAUNCHES.append(Launch(name, self.template, threads, used))


def emulated(kernel: Kernel, template: Mapping[str, object] | Sequence[tuple[str, object]],
             directory: Path) -> Callable:
    """`kernel` with these template constants (in MLX's order), its Metal text run on the CPU: a function of
    (inputs, output shapes, groups (x, y), threads per group, output dtypes) -> outputs, as emulated_cuda's."""
    template = list(template.items()) if isinstance(template, Mapping) else list(template)

    def library(inputs: Sequence[np.ndarray], output_dtypes: Sequence[np.dtype]) -> CheckedLaunches:
        return CheckedLaunches(kernel_library(kernel, template, inputs, output_dtypes, directory), kernel, template)

    return runner(library)


def emulated_build(directory: Path) -> Callable:
    """A stand-in for dialect.build(kernel, "metal"): the kernel's Metal text run on the CPU, called as MLX's
    metal_kernel is (template as (name, value) pairs, `grid` in threads, whole threadgroups of one dimension)."""

    def build(kernel: Kernel, backend: str) -> Callable:
        assert backend == "metal", f"{kernel.name} built for {backend} where Metal was emulated"

        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **options) -> list[mx.array]:
            assert set(options) <= {"init_value", "verbose", "stream"} and options.get("init_value") is None
            threads = threadgroup[0]
            assert grid[0] % threads == 0 and grid[2] == 1 and tuple(threadgroup[1:]) == (1, 1)
            run = emulated(kernel, list(template or []), directory)
            outputs = run([np.array(a) for a in inputs], output_shapes, (grid[0] // threads, grid[1]), threads,
                          [numpy_dtype(d) for d in output_dtypes])
            return [mx.array(y) for y in outputs]

        return call

    return build
