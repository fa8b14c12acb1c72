"""The CUDA rendering of custom kernels (dequant-matvec, affine matvec, hyper-connection), run on the CPU: one
std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, ...) and the dialect's helpers (barriers, SIMD sums) defined for threads on the
CPU, it computes what the GPU would. Each threadgroup runs as `threadgroup` threads that meet at std::barriers, so
the staging, the SIMD reductions and the row and unit indexing are all exercised. The signature is the one MLX
generates for a custom CUDA kernel (inputs, outputs, template constants at the top of the body).

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py,
test_kernels_affine_matvec.py and test_kernels_hc.py check the same kernels through MLX on the device.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels import affine_matvec, hc
from ds4_mlx.kernels.affine import to_affine
from ds4_mlx.kernels.dialect import CUDA, Kernel
from ds4_mlx.kernels.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.q2_k import Q2_K_MATVEC
from ds4_mlx.kernels.quants import dequantize
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType
from ds4_mlx.model.hyper_connection import pre, split

pytestmark = pytest.mark.slow

HOST = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __constant__
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct Index { unsigned int x, y, z; };
thread_local Index threadIdx, blockIdx;
std::barrier<>* group_barrier;
std::barrier<>* simd_barriers[32];
float exchange[32][32];
inline void ds4_barrier() { group_barrier->arrive_and_wait(); }
inline void ds4_simd_barrier() { simd_barriers[threadIdx.x >> 5]->arrive_and_wait(); }
inline float ds4_simd_sum(float v) {
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (unsigned int offset = 16; offset > 0; offset >>= 1) {
    exchange[simd][lane] = v;
    ds4_simd_barrier();
    const float other = exchange[simd][lane ^ offset];
    ds4_simd_barrier();
    v += other;
  }
  return v;
}
inline float ds4_simd_xor(float v, int mask) {
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  exchange[simd][lane] = v;
  ds4_simd_barrier();
  const float other = exchange[simd][lane ^ mask];
  ds4_simd_barrier();
  return other;
}
inline float ds4_exp(float v) { return std::exp(v); }
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline float __uint_as_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float ds4_float(unsigned int v) { return __uint_as_float(v); }
// PTX prmt, default mode: byte n of the result is byte (s >> 4n) & 7 of {y, x} (x the low four)
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long both = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned int)((both >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
"""


def cuda_helper(name: str) -> str:
    """A helper's definition as the CUDA prelude spells it, for helpers whose CUDA intrinsics HOST defines."""
    return re.search(rf"__device__ __forceinline__ \w+ {name}\(.*?\n}}\n", CUDA.prelude, re.S).group(0)


HOST += cuda_helper("ds4_byte_float")

LAUNCH = r"""
extern "C" void launch(void** args, int groups_x, int groups_y, int threads) {
  for (int y = 0; y < groups_y; ++y) {
    for (int group = 0; group < groups_x; ++group) {
      std::barrier<> all(threads);
      group_barrier = &all;
      std::vector<std::unique_ptr<std::barrier<>>> simds;
      for (int s = 0; s < threads / 32; ++s) {
        simds.emplace_back(new std::barrier<>(32));
        simd_barriers[s] = simds.back().get();
      }
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
          threadIdx = {(unsigned)t, 0, 0};
          blockIdx = {(unsigned)group, (unsigned)y, 0};
          kernel(ARGS);
        });
      }
      for (auto& thread : pool) thread.join();
    }
  }
}
"""


def emulated(kernel: Kernel, types: tuple[str, ...], template: dict[str, int], tmp_path) -> Callable:
    """`kernel` compiled for the CPU with its template constants: a function of (inputs, output shapes, grid of
    threadgroups (x, y), threads per group) -> outputs. `types` are the C element types of inputs then outputs."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")
    names = kernel.inputs + kernel.outputs
    params = [f"{'const ' if i < len(kernel.inputs) else ''}{c_type}* {name}"
              for i, (c_type, name) in enumerate(zip(types, names))]
    source = HOST + CUDA.render(kernel.header) + f"void kernel({', '.join(params)}) {{\n"
    source += "".join(f"  constexpr int {name} = {value};\n" for name, value in template.items())
    source += CUDA.render(kernel.source) + "\n}\n"
    source += LAUNCH.replace("ARGS", ", ".join(f"({c_type}*)args[{i}]" for i, c_type in enumerate(types)))
    path = tmp_path / ("_".join([kernel.name, *map(str, template.values())]))
    path.with_suffix(".cpp").write_text(source)
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                            str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    library = ctypes.CDLL(str(path.with_suffix(".so")))
    dtypes = {"float": np.float32, "uint8_t": np.uint8, "uint32_t": np.uint32}

    def run(inputs, output_shapes, groups: tuple[int, int], threads: int) -> list[np.ndarray]:
        arrays = [np.ascontiguousarray(a, dtypes[c_type]) for a, c_type in zip(inputs, types)]
        outputs = [np.full(shape, np.nan, dtypes[c_type]) for shape, c_type in zip(output_shapes, types[len(inputs):])]
        pointers = (ctypes.c_void_p * len(names))(*(a.ctypes.data for a in arrays + outputs))
        library.launch(pointers, groups[0], groups[1], threads)
        return outputs

    return run


def emulated_matvec(matvec: QuantMatvec, n_out: int, n_in: int, tmp_path):
    """The kernel for (n_out, n_in) compiled for the CPU: a function of (x, blocks, ids) -> y."""
    block_values, block_bytes = BLOCK_SIZES[matvec.ggml_type]
    row_bytes = n_in // block_values * block_bytes
    simds, rows = launch_plan(row_bytes)
    template = {"OUT": n_out, "IN": n_in, "ROW_BYTES": row_bytes, "UNITS": n_in // matvec.unit_values,
                "SIMDS": simds, "ROWS": rows}
    kernel = emulated(matvec.kernel, ("float", "uint8_t", "uint32_t", "float"), template, tmp_path)
    groups = -(-n_out // (simds * rows))

    def run(x: np.ndarray, blocks: np.ndarray, ids: np.ndarray) -> np.ndarray:
        (y,) = kernel([x, blocks, ids], [(ids.size, n_out)], (groups, ids.size), simds * 32)
        return y

    return run


@pytest.mark.parametrize("matvec", [IQ2_XXS_MATVEC, Q2_K_MATVEC], ids=lambda m: m.ggml_type.name)
@pytest.mark.parametrize("size", [(64, 256), (40, 512), (24, 2048), (20, 4096)], ids=str)
def test_emulated_cuda_kernel_equals_the_reference(matvec, size, tmp_path):
    """Rows staged by 2-byte (256, 512) and 16-byte loads (2048, 4096), threadgroups left partly idle by row
    counts that do not divide, several experts and slots."""
    n_out, n_in = size
    shape = (3, n_out, n_in)
    blocks = random_blocks(matvec.ggml_type, 3 * n_out, n_in, seed=n_in).reshape(3, -1)
    ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    x = random_activations((4, n_in), seed=n_out)
    want = np.array(gathered_reference(x, blocks, ids, matvec.ggml_type, shape))
    got = emulated_matvec(matvec, n_out, n_in, tmp_path)(np.array(x), np.array(blocks), np.array(ids))
    assert np.isfinite(got).all()  # every output row was written
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


def through_emulation(monkeypatch, tmp_path) -> None:
    """kernels/hc.py's `build` made to return the emulated kernel behind MLX's calling convention (float32 buffers,
    `grid` in threads), so the wrappers' own templates and grids are what runs."""

    def build(kernel: Kernel, backend: str) -> Callable:
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes) -> list[mx.array]:
            assert all(a.dtype == mx.float32 for a in inputs) and set(output_dtypes) == {mx.float32}
            run = emulated(kernel, ("float",) * (len(inputs) + len(output_shapes)), dict(template), tmp_path)
            groups = (-(-grid[0] // threadgroup[0]), grid[1])
            return [mx.array(y) for y in run([np.array(a) for a in inputs], output_shapes, groups, threadgroup[0])]

        return call

    monkeypatch.setattr(hc, "build", build)


def assert_close(got: tuple, want: tuple) -> None:
    for g, w in zip(got, want, strict=True):
        g, w = np.array(g), np.array(w)
        assert g.shape == w.shape and np.isfinite(g).all()  # every output was written
        assert np.abs(g - w).max() <= hc.TOLERANCE * np.abs(w).max()


@pytest.mark.parametrize("shape", [(1, 4, 4096), (5, 4, 512), (3, 2, 320)], ids=str)
def test_emulated_hc_pre_equals_the_reference(shape, monkeypatch, tmp_path):
    """Flash's width for one token; several tokens, and a width that leaves a collapse group partly idle (n = 2)."""
    tokens, n, d = shape
    m = (2 + n) * n
    args = (random_activations((tokens, n, d), seed=d), random_activations((m, n * d), seed=1) * (2 / (n * d) ** 0.5),
            1.0 + 0.2 * random_activations((3,), seed=2), 0.5 * random_activations((m,), seed=3), 20, 1e-6, 1e-6)
    assert hc.HCPre.fits(*args[:2])
    want = pre(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close(hc.HCPre._kernel(*args), want)


@pytest.mark.parametrize("n", [4, 2])
def test_emulated_hc_split_equals_the_reference(n, monkeypatch, tmp_path):
    """The split kernel of prefill chunks, its Sinkhorn one lane per comb entry."""
    tokens, d, m = 3, 1000, (2 + n) * n
    args = (random_activations((tokens, m), seed=5) * 3.0, random_activations((3,), seed=6),
            random_activations((m,), seed=7), random_activations((tokens, n, d), seed=8), 20, 1e-6)
    want = split(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close(hc.HCSplit._kernel(*args), want)


C_TYPES = {mx.float32: "float", mx.uint32: "uint32_t"}


@pytest.mark.parametrize(("bits", "size", "tokens", "plan"), [
    (8, (9, 512), 1, (4, 1)),  # the last threadgroup one row deep
    (8, (7, 1024), 3, (2, 2)),
    (8, (5, 4096), 5, (2, 4)),
    (8, (3, 768), 8, (1, 3)),  # 48 loads a row for 96 threads: some idle in the only step
    (8, (17, 2048), 1, (4, 1)),  # two steps a thread
    (4, (9, 512), 1, (4, 1)),
    (4, (5, 1024), 2, (4, 2)),
    (4, (3, 2048), 8, (2, 1)),
], ids=str)
def test_emulated_affine_matvec_equals_the_reference(bits, size, tokens, plan, monkeypatch, tmp_path):
    """One matrix for several tokens, or (one token) a bank of three matrices with four slots picking them; through
    kernels/affine_matvec.py's own wrapper (templates, grid), with `build` returning the emulated kernel."""

    def build(kernel: Kernel, backend: str) -> Callable:
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes) -> list[mx.array]:
            types = tuple(C_TYPES[a.dtype] for a in inputs) + tuple(C_TYPES[d] for d in output_dtypes)
            run = emulated(kernel, types, dict(template), tmp_path)
            groups = (-(-grid[0] // threadgroup[0]), grid[1])
            return [mx.array(y) for y in run([np.array(a) for a in inputs], output_shapes, groups, threadgroup[0])]

        return call

    monkeypatch.setattr(affine_matvec, "build", build)
    n_out, n_in = size
    ggml_type = GGMLType.Q8_0 if bits == 8 else GGMLType.Q4_K
    experts = 3 if tokens == 1 else 1
    shape = (experts, n_out, n_in)
    blocks = random_blocks(ggml_type, experts * n_out, n_in, seed=n_in + tokens)
    w = np.array(dequantize(blocks, ggml_type, shape))
    if experts > 1:
        weight, ids = to_affine(blocks, ggml_type, shape), mx.array([2, 0, 2, 1], dtype=mx.uint32)
        x = random_activations((ids.size, n_in), seed=n_out)
        want = np.stack([np.array(x[i]) @ w[ids[i].item()].T for i in range(ids.size)])
    else:
        weight, ids = to_affine(blocks, ggml_type, shape[1:]), None
        x = random_activations((tokens, n_in), seed=n_out)
        want = np.array(x) @ w[0].T
    got = np.array(affine_matvec.AFFINE_MATVEC.fast(x, weight, ids, plan))
    assert got.shape == want.shape and np.isfinite(got).all()  # every output was written
    assert np.abs(got - want).max() <= affine_matvec.TOLERANCE * np.abs(want).max()
