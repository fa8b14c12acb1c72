"""The CUDA rendering of custom kernels, compiled for the CPU: one std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, ...) and the dialect's helpers (barriers, SIMD sums and shuffles, threadgroup
atomics) defined for threads on the CPU, it computes what the GPU would. Each threadgroup runs as its threads
meeting at std::barriers, one threadgroup after the other, so staging, SIMD reductions and indexing are all
exercised, and a barrier or SIMD operation that not every thread reaches hangs instead of passing. The signature
is the one MLX generates for a custom CUDA kernel (inputs, outputs, template constants at the top of the body).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from ds4_mlx.kernels.dialect import CUDA, Kernel

HOST = r"""
#include <atomic>
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
int exchange_int[32][32];
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
inline int ds4_simd_xor(int v, int mask) {
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  exchange_int[simd][lane] = v;
  ds4_simd_barrier();
  const int other = exchange_int[simd][lane ^ mask];
  ds4_simd_barrier();
  return other;
}
inline void ds4_atomic_add(int* p, int v) { std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline unsigned int ds4_bits(float v) { unsigned int u; std::memcpy(&u, &v, 4); return u; }
inline float ds4_float(unsigned int u) { float v; std::memcpy(&v, &u, 4); return v; }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }

template <class Body>
void run_groups(int groups_x, int groups_y, int threads, Body body) {
  for (int y = 0; y < groups_y; ++y) {
    for (int x = 0; x < groups_x; ++x) {
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
          blockIdx = {(unsigned)x, (unsigned)y, 0};
          body();
        });
      }
      for (auto& thread : pool) thread.join();
    }
  }
}
"""


def kernel_function(kernel: Kernel, params: list[str], template: dict[str, int]) -> str:
    """The kernel as MLX's CUDA backend declares it: a function named after it taking `params` ("type name",
    inputs then outputs), with the template constants at the top of the body, after its rendered header."""
    source = CUDA.render(kernel.header)
    source += f"void {kernel.name}({', '.join(params)}) {{\n"
    source += "".join(f"  constexpr int {name} = {value};\n" for name, value in template.items())
    return source + CUDA.render(kernel.source) + "\n}\n"


def compile_library(source: str, path: Path) -> ctypes.CDLL:
    """HOST + source (kernel functions and extern "C" launchers calling run_groups) as a loaded shared library."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")
    path.with_suffix(".cpp").write_text(HOST + source)
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(path.with_suffix(".cpp")),
                            "-o", str(path.with_suffix(".so"))], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return ctypes.CDLL(str(path.with_suffix(".so")))
