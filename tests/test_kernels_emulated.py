"""The CUDA rendering of the dequant-matvec kernels, run on the CPU: one std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, ...) and the dialect's helpers (barriers, SIMD sums) defined for threads on the
CPU, it computes what the GPU would. Each threadgroup runs as `threadgroup` threads that meet at std::barriers, so
the staging, the SIMD reductions and the row and unit indexing are all exercised. The signature is the one MLX
generates for a custom CUDA kernel (inputs, outputs, template constants at the top of the body).

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py
check the same kernels through MLX on the device.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.dialect import CUDA
from ds4_mlx.kernels.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.q2_k import Q2_K_MATVEC
from ds4_mlx.model.gguf import BLOCK_SIZES

pytestmark = pytest.mark.slow

HOST = r"""
#include <barrier>
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
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
"""

LAUNCH = r"""
extern "C" void launch(const float* x, const uint8_t* w, const uint32_t* ids, float* y, int groups, int slots,
                       int threads) {
  for (int slot = 0; slot < slots; ++slot) {
    for (int group = 0; group < groups; ++group) {
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
          blockIdx = {(unsigned)group, (unsigned)slot, 0};
          kernel(x, w, ids, y);
        });
      }
      for (auto& thread : pool) thread.join();
    }
  }
}
"""


def emulated(matvec: QuantMatvec, n_out: int, n_in: int, tmp_path):
    """The kernel for (n_out, n_in) compiled for the CPU: a function of (x, blocks, ids) -> y."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")
    block_values, block_bytes = BLOCK_SIZES[matvec.ggml_type]
    row_bytes = n_in // block_values * block_bytes
    simds, rows = launch_plan(row_bytes)
    template = {"OUT": n_out, "IN": n_in, "ROW_BYTES": row_bytes, "UNITS": n_in // matvec.unit_values,
                "SIMDS": simds, "ROWS": rows}
    source = HOST + CUDA.render(matvec.kernel.header)
    source += "void kernel(const float* x, const uint8_t* w, const uint32_t* ids, float* y) {\n"
    source += "".join(f"  constexpr int {name} = {value};\n" for name, value in template.items())
    source += CUDA.render(matvec.kernel.source) + "\n}\n" + LAUNCH
    path = tmp_path / f"{matvec.kernel.name}_{n_out}_{n_in}"
    path.with_suffix(".cpp").write_text(source)
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(path.with_suffix(".cpp")),
                            "-o", str(path.with_suffix(".so"))], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    library = ctypes.CDLL(str(path.with_suffix(".so")))
    groups = -(-n_out // (simds * rows))

    def run(x: np.ndarray, blocks: np.ndarray, ids: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        blocks = np.ascontiguousarray(blocks, np.uint8)
        ids = np.ascontiguousarray(ids, np.uint32)
        y = np.full((ids.size, n_out), np.nan, np.float32)
        pointer = ctypes.c_void_p
        library.launch(pointer(x.ctypes.data), pointer(blocks.ctypes.data), pointer(ids.ctypes.data),
                       pointer(y.ctypes.data), groups, ids.size, simds * 32)
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
    got = emulated(matvec, n_out, n_in, tmp_path)(np.array(x), np.array(blocks), np.array(ids))
    assert np.isfinite(got).all()  # every output row was written
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
