"""The CUDA rendering of custom kernels, run on the CPU: one std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, ...) and the dialect's helpers (barriers, SIMD sums and shuffles) defined for
threads on the CPU, it computes what the GPU would. Each threadgroup runs as `threadgroup` threads that meet at
std::barriers, so the staging, the SIMD and threadgroup reductions and the indexing are all exercised (a SIMD
shuffle that not all 32 lanes reach hangs here as it would misbehave there). The signature is the one MLX generates
for a custom CUDA kernel (inputs, outputs, template constants at the top of the body).

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py,
test_kernels_compressor.py and test_kernels_actquant.py check the same kernels through MLX on the device.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.actquant import FP8_KERNEL, FP8_THREADS
from ds4_mlx.kernels.compressor import LAYOUTS, STEP_KERNEL
from ds4_mlx.kernels.compressor import TOLERANCE as STEP_TOLERANCE
from ds4_mlx.kernels.dialect import CUDA, Kernel
from ds4_mlx.kernels.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.q2_k import Q2_K_MATVEC
from ds4_mlx.model.compressor import Frontier, pool_step
from ds4_mlx.model.gguf import BLOCK_SIZES
from ds4_mlx.model.quant_sim import kv_fp8

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
inline float ds4_simd_xor(float v, int mask) {
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  exchange[simd][lane] = v;
  ds4_simd_barrier();
  const float other = exchange[simd][lane ^ mask];
  ds4_simd_barrier();
  return other;
}
inline float ds4_simd_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += ds4_simd_xor(v, offset);
  return v;
}
inline float ds4_simd_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = std::fmax(v, ds4_simd_xor(v, offset));
  return v;
}
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline float ds4_exp(float v) { return std::exp(v); }
inline unsigned int ds4_bits(float v) { unsigned int u; std::memcpy(&u, &v, 4); return u; }
inline float ds4_float(unsigned int u) { float v; std::memcpy(&v, &u, 4); return v; }
inline float ds4_rint(float v) { return std::rint(v); }
inline float ds4_div(float a, float b) { return a / b; }
"""

LAUNCH = r"""
extern "C" void launch(void** buffers, int groups_x, int groups_y, int threads) {
  for (int group_y = 0; group_y < groups_y; ++group_y) {
    for (int group_x = 0; group_x < groups_x; ++group_x) {
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
          blockIdx = {(unsigned)group_x, (unsigned)group_y, 0};
          kernel(ARGUMENTS);
        });
      }
      for (auto& thread : pool) thread.join();
    }
  }
}
"""

C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.uint8): "uint8_t", np.dtype(np.uint32): "uint32_t",
           np.dtype(np.int32): "int"}


def emulated(kernel: Kernel, template: dict[str, int], inputs: list[np.ndarray], tmp_path):
    """The kernel compiled for the CPU for these constants and input dtypes: a function of (inputs, output
    shapes, groups (x, y), threads) -> float32 outputs, which start as NaN so that unwritten values show."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")
    signature = [f"const {C_TYPES[a.dtype]}* {name}" for name, a in zip(kernel.inputs, inputs)]
    signature += [f"float* {name}" for name in kernel.outputs]
    casts = [f"({part.rsplit(' ', 1)[0]})buffers[{i}]" for i, part in enumerate(signature)]
    source = HOST + CUDA.render(kernel.header) + f"void kernel({', '.join(signature)}) {{\n"
    source += "".join(f"  constexpr int {name} = {value};\n" for name, value in template.items())
    source += CUDA.render(kernel.source) + "\n}\n" + LAUNCH.replace("ARGUMENTS", ", ".join(casts))
    path = tmp_path / f"{kernel.name}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
    if not path.with_suffix(".so").exists():
        path.with_suffix(".cpp").write_text(source)
        build = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                                str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-3000:]
    library = ctypes.CDLL(str(path.with_suffix(".so")))

    def run(inputs: list[np.ndarray], output_shapes: list[tuple[int, ...]], groups: tuple[int, int],
            threads: int) -> list[np.ndarray]:
        inputs = [np.ascontiguousarray(a) for a in inputs]
        outputs = [np.full(shape, np.nan, np.float32) for shape in output_shapes]
        buffers = (ctypes.c_void_p * len(signature))(*[a.ctypes.data for a in inputs + outputs])
        library.launch(buffers, *groups, threads)
        return outputs

    return run


@pytest.mark.parametrize("matvec", [IQ2_XXS_MATVEC, Q2_K_MATVEC], ids=lambda m: m.ggml_type.name)
@pytest.mark.parametrize("size", [(64, 256), (40, 512), (24, 2048), (20, 4096)], ids=str)
def test_emulated_cuda_kernel_equals_the_reference(matvec: QuantMatvec, size, tmp_path):
    """Rows staged by 2-byte (256, 512) and 16-byte loads (2048, 4096), threadgroups left partly idle by row
    counts that do not divide, several experts and slots."""
    n_out, n_in = size
    shape = (3, n_out, n_in)
    block_values, block_bytes = BLOCK_SIZES[matvec.ggml_type]
    row_bytes = n_in // block_values * block_bytes
    simds, rows = launch_plan(row_bytes)
    blocks = random_blocks(matvec.ggml_type, 3 * n_out, n_in, seed=n_in).reshape(3, -1)
    ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    x = random_activations((4, n_in), seed=n_out)
    want = np.array(gathered_reference(x, blocks, ids, matvec.ggml_type, shape))
    inputs = [np.array(x), np.array(blocks), np.array(ids)]
    template = {"OUT": n_out, "IN": n_in, "ROW_BYTES": row_bytes, "UNITS": n_in // matvec.unit_values,
                "SIMDS": simds, "ROWS": rows}
    (got,) = emulated(matvec.kernel, template, inputs, tmp_path)(
        inputs, [want.shape], (-(-n_out // (simds * rows)), ids.size), simds * 32)
    assert np.isfinite(got).all()  # every output row was written
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize(("ratio", "width", "positions"), [(4, 512, range(10)), (4, 128, (3, 4, 1001)),
                                                           (128, 512, (5, 127, 128))], ids=str)
def test_emulated_compressor_step_equals_the_reference(ratio, width, positions, tmp_path):
    """Tokens fed through window boundaries (the frontier shifting or emptying), each on the frontier the
    reference left; every pooled dim and frontier value written."""
    coff = 2 if ratio == 4 else 1
    cols, threads = LAYOUTS[ratio]
    template = {"R": ratio, "D": width, "COFF": coff, "COLS": cols, "THREADS": threads}
    frontier = Frontier.empty(ratio, width)
    frontier_kv = mx.where(mx.arange(coff * ratio)[:, None] < coff * ratio - 1,
                           random_activations(frontier.kv.shape, seed=3), 0.0)
    frontier_score = mx.where(frontier_kv != 0, 3 * random_activations(frontier.kv.shape, seed=4), -mx.inf)
    ape = random_activations((ratio, coff * width), seed=5)
    run = None
    for position in positions:
        kv, score = (random_activations((1, coff * width), seed=10 * position + k) for k in range(2))
        args = (kv, score, ape, frontier_kv, frontier_score, mx.array(position, dtype=mx.int32))
        want = [np.array(w) for w in pool_step(*args, ratio, width)]
        inputs = [np.array(a) for a in args[:5]] + [np.array([position], np.int32)]
        run = run or emulated(STEP_KERNEL, template, inputs, tmp_path)
        pooled, new_kv, new_score = run(inputs, [w.shape for w in want], (width // cols, 1), threads)
        assert np.isfinite(pooled).all() and not np.isnan(new_kv).any() and not np.isnan(new_score).any()
        assert np.abs(pooled - want[0]).max() <= STEP_TOLERANCE * np.abs(want[0]).max()
        assert np.array_equal(new_kv, want[1]) and np.array_equal(new_score, want[2])
        frontier_kv, frontier_score = mx.array(want[1]), mx.array(want[2])


@pytest.mark.parametrize(("rows", "width", "n_rot"), [(1, 512, 64), (7, 512, 64), (3, 192, 64), (2, 512, 0)])
def test_emulated_fp8_kv_is_exact(rows, width, n_rot, tmp_path):
    """Rows from 1e-8 to 1e4 in scale (floors, subnormal steps, saturation); a threadgroup partly idle (3 x 3)."""
    x = random_activations((rows, width), seed=rows) * mx.power(10.0, mx.linspace(-8, 4, rows))[:, None]
    want = np.array(kv_fp8(x, n_rot))
    threads = rows * (width // 64) * 32
    template = {"R": rows, "W": width, "NROT": n_rot, "THREADS": FP8_THREADS}
    (got,) = emulated(FP8_KERNEL, template, [np.array(x)], tmp_path)(
        [np.array(x)], [want.shape], (-(-threads // FP8_THREADS), 1), FP8_THREADS)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
