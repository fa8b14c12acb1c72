"""The CUDA rendering of the dequant-matvec and fused expert kernels, run on the CPU: one std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, ...) and the dialect's helpers (barriers, SIMD sums) defined for threads on the
CPU, it computes what the GPU would. Each threadgroup runs as `threadgroup` threads that meet at std::barriers, so
the staging, the SIMD reductions and the row and unit indexing are all exercised. The signature is the one MLX
generates for a custom CUDA kernel (inputs, outputs, template constants at the top of the body).

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py and
test_kernels_experts.py check the same kernels through MLX on the device.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels import experts
from ds4_mlx.kernels.dialect import CUDA, Kernel
from ds4_mlx.kernels.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.q2_k import Q2_K_MATVEC
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType
from ds4_mlx.model.moe import DOWN_SUM, GATE_UP

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
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline float ds4_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float ds4_exp(float v) { return std::exp(v); }
inline float ds4_div(float a, float b) { return a / b; }
// PTX prmt, as CUDA runs ds4_byte_perm: a selector nibble with bit 3 set replicates the selected byte's sign bit
inline unsigned int ds4_byte_perm(unsigned int lo, unsigned int hi, unsigned int selector) {
  const unsigned long long bytes = lo | ((unsigned long long)hi << 32);
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned int s = (selector >> (4 * n)) & 15u;
    const unsigned int byte = (unsigned int)(bytes >> (8 * (s & 7u))) & 255u;
    r |= (s & 8u ? (byte & 128u ? 255u : 0u) : byte) << (8 * n);
  }
  return r;
}
inline float ds4_magic_byte(unsigned int word, int j) {
  return ds4_float(ds4_byte_perm(word, 0x4B000000u, 0x7440u + j));
}
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


# ---------------------------------------------------------------------------------------------------------------
# The fused expert kernels (kernels/experts.py), through their own launch code: `experts.build` is replaced by a
# function with an MLX custom kernel's call that runs the CUDA text here.

FUSED_LAUNCH = r"""
extern "C" void launch(void** args, int groups_x, int groups_y, int threads) {
  std::barrier<> all(threads);
  group_barrier = &all;
  std::vector<std::unique_ptr<std::barrier<>>> simds;
  for (int s = 0; s < threads / 32; ++s) {
    simds.emplace_back(new std::barrier<>(32));
    simd_barriers[s] = simds.back().get();
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=, &all] {
      threadIdx = {(unsigned)t, 0, 0};
      for (int gy = 0; gy < groups_y; ++gy) {
        for (int gx = 0; gx < groups_x; ++gx) {
          blockIdx = {(unsigned)gx, (unsigned)gy, 0};
          kernel(ARGS);
          all.arrive_and_wait();  // the next threadgroup reuses the static threadgroup memory
        }
      }
    });
  }
  for (auto& thread : pool) thread.join();
}
"""

C_TYPES = {mx.float32: "float", mx.int32: "int32_t", mx.uint8: "uint8_t"}


def emulated_build(tmp_path):
    """A stand-in for dialect.build on "cuda": the kernel's CUDA text compiled by g++, called like MLX's kernels."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")

    def build(kernel: Kernel, backend: str):
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            dtypes = [a.dtype for a in inputs] + list(output_dtypes)
            names = kernel.inputs + kernel.outputs
            params = [("const " if i < len(inputs) else "") + f"{C_TYPES[d]}* {n}"
                      for i, (n, d) in enumerate(zip(names, dtypes))]
            source = HOST + CUDA.render(kernel.header) + f"void kernel({', '.join(params)}) {{\n"
            source += "".join(f"  constexpr int {name} = {value};\n" for name, value in template)
            source += CUDA.render(kernel.source) + "\n}\n" + FUSED_LAUNCH.replace("ARGS", ", ".join(
                f"({param.rsplit(' ', 1)[0]})args[{i}]" for i, param in enumerate(params)))
            path = tmp_path / f"{kernel.name}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
            if not path.with_suffix(".so").exists():
                path.with_suffix(".cpp").write_text(source)
                done = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                                       str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                                      capture_output=True, text=True)
                assert done.returncode == 0, done.stderr[-3000:]
            arrays = [np.ascontiguousarray(np.array(a)) for a in inputs]
            arrays += [np.full(shape, np.nan, np.float32) for shape in output_shapes]  # unwritten stays NaN
            pointers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
            threads = threadgroup[0]
            assert grid[0] % threads == 0 and grid[2] == 1 and tuple(threadgroup[1:]) == (1, 1)
            ctypes.CDLL(str(path.with_suffix(".so"))).launch(pointers, grid[0] // threads, grid[1], threads)
            return [mx.array(a) for a in arrays[len(inputs):]]
        return call

    return build


FUSED_CASES = {  # (OUT, IN) and the (T, k) routing
    "tiny": ((256, 256), [[1, 3]]),
    "two_tokens": ((64, 512), [[0, 2, 2, 1], [3, 3, 0, 1]]),
    "three_tokens": ((96, 1024), [[1, 2], [0, 0], [3, 1]]),
    "eight_simds": ((1024, 2048), [[3, 0, 1, 2, 2, 1]]),
}


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_emulated_fused_expert_kernels_equal_their_references(ggml_type, case, tmp_path, monkeypatch):
    """Rows staged in 2-, 4- and 16-byte words, several tokens, repeated experts, 1 to 8 SIMD groups per
    threadgroup; each kernel as its FastPath launches it (templates, grid), against the FastPath's reference."""
    monkeypatch.setattr(experts, "build", emulated_build(tmp_path))
    monkeypatch.setattr(experts, "current_backend", lambda: "cuda")
    (n_out, n_in), routing = FUSED_CASES[case]
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (4, n_out, n_in)
    gate, up, down = (random_blocks(ggml_type, 4 * n_out, n_in, seed=s).reshape(4, -1) for s in (1, 2, 3))
    x = random_activations((ids.shape[0], n_in), seed=4)
    w = mx.array(np.random.default_rng(5).uniform(0.1, 1.5, ids.shape).astype(np.float32))
    args = (x, ids, w, gate, up, ggml_type, shape, 10.0)
    got, want = GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)
    assert np.isfinite(np.array(got)).all()
    assert mx.abs(got - want).max().item() <= experts.GATE_UP_TOLERANCE * mx.abs(want).max().item()
    h = random_activations((ids.size, n_in), seed=6)
    got, want = DOWN_SUM.fast_path.fast(h, ids, down, ggml_type, shape), DOWN_SUM.fast_path.reference(
        h, ids, down, ggml_type, shape)
    assert np.isfinite(np.array(got)).all()
    assert mx.abs(got - want).max().item() <= experts.TOLERANCE * mx.abs(want).max().item()
