"""The CUDA rendering of custom kernels, compiled for the CPU: one std::thread per GPU thread.

Without a GPU the kernels cannot run through MLX, but their CUDA text is C++: compiled by the host's g++ with the
CUDA words (threadIdx, __shared__, __half, ...) and every helper of the dialect's prelude (barriers, SIMD sums,
maxima and shuffles, threadgroup atomics, byte permutes, bit casts, rounding, division) defined for threads on the
CPU, it computes what the GPU would. A launch runs its threadgroups one after the other, each as its threads meeting
at std::barriers, so staging, SIMD and threadgroup reductions and indexing are all exercised, and a barrier or SIMD
operation that not every thread reaches hangs instead of passing. The kernel is declared as MLX declares a custom
CUDA kernel (inputs then outputs, element types from the arrays' dtypes, template constants at the top of the body).

`emulated` runs a kernel on numpy arrays; `emulated_build` stands in for dialect.build, so that a wrapper's own
templates and grids are what runs. The threads, barriers and lane exchange are emulated_threads.py's, shared with
emulated_metal.py. Used by test_kernels_emulated.py, test_kernels_indexer.py and others (slow tests).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery.dialect import CUDA, Kernel
from emulated_threads import compile_library, numpy_dtype, runner

HOST = r"""
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __constant__
#define threadIdx emulated_thread
#define blockIdx emulated_group
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint2 { unsigned int x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
struct __half { unsigned short bits; };
inline void ds4_barrier() { emulated_group_barrier(); }
inline void ds4_simd_barrier() { emulated_simd_barrier(); }
inline float ds4_simd_xor(float v, int mask) { return lane_xor(v, mask); }
inline int ds4_simd_xor(int v, int mask) { return lane_xor(v, mask); }
inline float ds4_simd_sum(float v) { return lane_sum(v); }
inline float ds4_simd_max(float v) { return lane_max(v); }
inline void ds4_atomic_add(int* p, int v) { std::atomic_ref<int>(*p).fetch_add(v); }
inline bool ds4_last_group(const unsigned int* counter, unsigned int groups, unsigned int* flag, unsigned int tid) {
  ds4_barrier();
  if (tid == 0) {
    std::atomic_ref<unsigned int> count(*const_cast<unsigned int*>(counter));
    const unsigned int done = count.fetch_add(1u) + 1u;
    flag[0] = done == groups ? 1u : 0u;
    if (done == groups) count.store(0u);
  }
  ds4_barrier();
  return flag[0] != 0u;
}
inline float ds4_load_fresh(const float* p) { return *p; }
inline unsigned int ds4_popcount(unsigned int v) { return __builtin_popcount(v); }
inline float ds4_exp(float v) { return std::exp(v); }
inline float ds4_log1p(float v) { return std::log1p(v); }
inline float ds4_cos(float v) { return std::cos(v); }
inline float ds4_sin(float v) { return std::sin(v); }
inline float ds4_rint(float v) { return std::rint(v); }
inline float ds4_div(float a, float b) { return a / b; }
inline float __uint_as_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned int ds4_bits(float v) { unsigned int u; std::memcpy(&u, &v, 4); return u; }
inline float ds4_float(unsigned int v) { return __uint_as_float(v); }
inline float ds4_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline float ds4_round_half(float v) { return (float)(_Float16)v; }
// CUDA's __byte_perm: byte n of the result is byte (s >> 4n) & 7 of {y, x} (x the low four)
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long both = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned int)((both >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
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
// cvt.rna.tf32.f32: round to nearest, ties away from zero, at the 13th mantissa bit (adding half a TF32 unit to
// the magnitude bits carries into the exponent as rounding up does); infinities and NaNs pass unchanged
inline unsigned int tf32_rna(float v) {
  const unsigned int bits = ds4_bits(v);
  return (bits & 0x7F800000u) == 0x7F800000u ? bits : (bits + 0x1000u) & 0xFFFFE000u;
}
inline void ds4_tf32_split(float v, unsigned int& hi, unsigned int& lo) {
  hi = tf32_rna(v);
  lo = tf32_rna(v - __uint_as_float(hi));
}
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: the warp's fragments gathered as in lane_xor, the matrices
// rebuilt from them by PTX's fragment layout (g = lane >> 2, t = lane & 3: a0 A[g][t], a1 A[g+8][t], a2 A[g][t+4],
// a3 A[g+8][t+4]; b0 B[t][g], b1 B[t+4][g]; c0 C[g][2t], c1 C[g][2t+1], c2 C[g+8][2t], c3 C[g+8][2t+1]), each
// lane given its C elements: c + the 8 products (each exact) summed in double, then truncated to float32, as the
// tensor cores round toward zero (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021) where an IEEE
// float32 sum would round to nearest: a kernel that lets the truncation drift over a long K shows it here
inline void ds4_mma_tf32_16x8x8(float* c, const unsigned int* a, const unsigned int* b) {
  static unsigned int as[32][32][4], bs[32][32][2];
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) as[simd][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) bs[simd][lane][i] = b[i];
  ds4_simd_barrier();
  float A[16][8], B[8][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) A[g + 8 * (i & 1)][t + 4 * (i >> 1)] = __uint_as_float(as[simd][l][i] & 0xFFFFE000u);
    for (int i = 0; i < 2; ++i) B[t + 4 * i][g] = __uint_as_float(bs[simd][l][i] & 0xFFFFE000u);
  }
  ds4_simd_barrier();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double sum = c[i];
    for (int k = 0; k < 8; ++k) sum += (double)A[row][k] * B[k][col];
    const float nearest = (float)sum;
    c[i] = std::fabs((double)nearest) > std::fabs(sum) ? std::nextafter(nearest, 0.0f) : nearest;
  }
}

// cp.async: the copy lands at once (earlier than on the GPU, so a stage read before its wait still reads right
// here; one overwritten while another warp reads it shows), commits and waits are nothing to do
inline void ds4_copy16_async(float* dst, const float* src, bool full) {
  if (full) {
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}
inline void ds4_copy4_async(float* dst, const float* src, bool full) { *dst = full ? *src : 0.0f; }
inline void ds4_async_commit() {}
template <int N> inline void ds4_async_wait_keep() {}
inline void ds4_async_wait_all() {}
inline void ds4_async_wait_prior() {}
// bulk copies and their transaction barriers: a barrier word holds its completed phases (high 32 bits) and the
// bytes still to land this phase (low); a copy lands at once, and the one that lands a phase's last bytes ends it
inline void ds4_bar_init(unsigned long long* bar, unsigned int) { *bar = 0; }
inline void ds4_bar_expect(unsigned long long* bar, unsigned int bytes) {
  std::atomic_ref<unsigned long long>(*bar).fetch_add(bytes);
}
inline void ds4_bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  std::memcpy(dst, src, bytes);
  std::atomic_ref<unsigned long long> word(*bar);
  if ((word.fetch_sub(bytes) & 0xFFFFFFFFull) == bytes) word.fetch_add(1ull << 32);
}
inline void ds4_bar_wait(unsigned long long* bar, unsigned int parity) {
  while (((std::atomic_ref<unsigned long long>(*bar).load() >> 32) & 1) == parity) std::this_thread::yield();
}

inline unsigned int half_bits(float v) {
  const _Float16 h = (_Float16)v;  // IEEE conversion: round to nearest, ties to even, as __floats2half2_rn
  unsigned short bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
inline unsigned int ds4_half2_bits(float lo, float hi) { return half_bits(lo) | (half_bits(hi) << 16); }
inline void ds4_half2_split(float a, float b, unsigned int& hi, unsigned int& lo) {
  hi = ds4_half2_bits(a, b);
  lo = ds4_half2_bits(a - ds4_half_to_float(hi & 0xFFFFu), b - ds4_half_to_float(hi >> 16));
}
// two bytes as halves 1024 + byte (prmt with 0x64 above each), less the halves of bias: exact for these values
inline unsigned int ds4_quant_half2(unsigned int w, unsigned int selector, unsigned int bias) {
  const unsigned int h = ds4_byte_perm(w, 0x64646464u, selector);
  return half_bits(ds4_half_to_float(h & 0xFFFFu) - ds4_half_to_float(bias & 0xFFFFu))
         | (half_bits(ds4_half_to_float(h >> 16) - ds4_half_to_float(bias >> 16)) << 16);
}
// __hfma2 with one rounding: the halves' product is exact in a double, the sum rounded there and then to a half
// (exact wherever the kernels use it: small integer results).
inline unsigned int ds4_quant_fma_half2(unsigned int w, unsigned int selector, unsigned int scale,
                                        unsigned int offset) {
  const unsigned int h = ds4_byte_perm(w, 0x64646464u, selector);
  unsigned int r = 0u;
  for (int k = 0; k < 2; ++k) {
    const float value = ds4_half_to_float((h >> (16 * k)) & 0xFFFFu);
    const double v = (double)value * ds4_half_to_float((scale >> (16 * k)) & 0xFFFFu)
                     + ds4_half_to_float((offset >> (16 * k)) & 0xFFFFu);
    r |= half_bits((float)v) << (16 * k);
  }
  return r;
}
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: the warp's row addresses gathered as in lane_xor.
inline void ds4_ldmatrix_x4(unsigned int* r, const unsigned int* row) {
  static const unsigned int* rows[32][32];
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  rows[simd][lane] = row;
  ds4_simd_barrier();
  for (int m = 0; m < 4; ++m) r[m] = rows[simd][8 * m + (lane >> 2)][lane & 3];
  ds4_simd_barrier();
}
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane 4g + t receives halves g of rows 2t and 2t + 1 of matrix m.
inline void ds4_ldmatrix_x4_trans(unsigned int* r, const unsigned int* row) {
  static const unsigned int* rows[32][32];
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  rows[simd][lane] = row;
  ds4_simd_barrier();
  const unsigned int g = lane >> 2, t = lane & 3;
  for (int m = 0; m < 4; ++m) {
    unsigned short a, b;
    std::memcpy(&a, reinterpret_cast<const unsigned short*>(rows[simd][8 * m + 2 * t]) + g, 2);
    std::memcpy(&b, reinterpret_cast<const unsigned short*>(rows[simd][8 * m + 2 * t + 1]) + g, 2);
    r[m] = a | ((unsigned int)b << 16);
  }
  ds4_simd_barrier();
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, as the TF32 one above: halves two to a register, low half
// first (g = lane >> 2, t = lane & 3: a0 A[g][2t..2t+1], a1 A[g+8][2t..], a2 A[g][2t+8..], a3 A[g+8][2t+8..];
// b0 B[2t..2t+1][g], b1 B[2t+8..2t+9][g]), exact products summed in double, truncated toward zero
inline void ds4_mma_f16_16x8x16(float* c, const unsigned int* a, const unsigned int* b) {
  static unsigned int as[32][32][4], bs[32][32][2];
  const unsigned int simd = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) as[simd][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) bs[simd][lane][i] = b[i];
  ds4_simd_barrier();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) {
      for (int h = 0; h < 2; ++h) {
        A[g + 8 * (i & 1)][2 * t + 8 * (i >> 1) + h] = ds4_half_to_float((as[simd][l][i] >> (16 * h)) & 0xFFFFu);
      }
    }
    for (int i = 0; i < 2; ++i) {
      for (int h = 0; h < 2; ++h) B[2 * t + 8 * i + h][g] = ds4_half_to_float((bs[simd][l][i] >> (16 * h)) & 0xFFFFu);
    }
  }
  ds4_simd_barrier();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double sum = c[i];
    for (int k = 0; k < 16; ++k) sum += (double)A[row][k] * B[k][col];
    const float nearest = (float)sum;
    c[i] = std::fabs((double)nearest) > std::fabs(sum) ? std::nextafter(nearest, 0.0f) : nearest;
  }
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16 with A from registers: the warpgroup's fragments gathered
// (warp w holds rows 16 w.. of A as mma.m16n8k16's A fragment), B (16 x N) read from threadgroup memory as the
// descriptor of a K-major tile without swizzling lays it out: 8 x 8 core matrices of 16-byte rows (an N row's 8
// consecutive K), the next core matrix along K LBO bytes on, along N SBO bytes on; each D element (lane's
// fragment as mma's C, n8 block j in d[4 j..4 j + 3]) is its exact products summed in double onto D (or onto zero)
// and truncated toward zero, as the mma above. It runs at once: the fence, commit and wait are nothing to do. The
// exchange passes the whole threadgroup's barrier: every warpgroup of the kernels that use it calls it together.
template <int N, int LBO, int SBO>
inline void emulated_wgmma(float* d, const unsigned int* a, const unsigned int* b, int accumulate) {
  static unsigned int as[8][128][4];
  const unsigned int group = threadIdx.x >> 7, me = threadIdx.x & 127;
  for (int i = 0; i < 4; ++i) as[group][me][i] = a[i];
  ds4_barrier();
  float A[64][16];
  for (int l = 0; l < 128; ++l) {
    const int row0 = 16 * (l >> 5), g = (l & 31) >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) {
      for (int h = 0; h < 2; ++h) {
        const unsigned int bits = (as[group][l][i] >> (16 * h)) & 0xFFFFu;
        A[row0 + g + 8 * (i & 1)][2 * t + 8 * (i >> 1) + h] = ds4_half_to_float(bits);
      }
    }
  }
  ds4_barrier();
  const unsigned char* tile = reinterpret_cast<const unsigned char*>(b);
  const int row0 = 16 * (me >> 5), g = (me & 31) >> 2, t = me & 3;
  for (int j = 0; j < N / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
      double sum = accumulate ? d[4 * j + i] : 0.0;
      for (int k = 0; k < 16; ++k) {
        unsigned short bits;
        std::memcpy(&bits, tile + (col >> 3) * SBO + (col & 7) * 16 + (k >> 3) * LBO + (k & 7) * 2, 2);
        sum += (double)A[row][k] * ds4_half_to_float(bits);
      }
      const float nearest = (float)sum;
      d[4 * j + i] = std::fabs((double)nearest) > std::fabs(sum) ? std::nextafter(nearest, 0.0f) : nearest;
    }
  }
}
template <int LBO, int SBO>
inline void ds4_wgmma_f16_64x128x16(float* d, const unsigned int* a, const unsigned int* b, int accumulate) {
  emulated_wgmma<128, LBO, SBO>(d, a, b, accumulate);
}
template <int LBO, int SBO>
inline void ds4_wgmma_f16_64x64x16(float* d, const unsigned int* a, const unsigned int* b, int accumulate) {
  emulated_wgmma<64, LBO, SBO>(d, a, b, accumulate);
}
template <int N, int LBO, int SBO>
inline void ds4_wgmma_split(float* d, const unsigned int* a, const unsigned int* hi, int lo_words, int accumulate) {
  emulated_wgmma<N, LBO, SBO>(d, a, hi + lo_words, accumulate);
  emulated_wgmma<N, LBO, SBO>(d, a, hi, 1);
}
inline void ds4_wgmma_fence() {}
inline void ds4_wgmma_hold(unsigned int*) {}
inline void ds4_wgmma_commit() {}
template <int N> inline void ds4_wgmma_wait(float*) {}
inline void ds4_fence_async_shared() {}

"""


def cuda_helper(name: str) -> str:
    """A helper's definition as the CUDA prelude spells it, for helpers whose CUDA intrinsics HOST defines."""
    return re.search(rf"__device__ __forceinline__ \w+ {name}\(.*?\n}}\n", CUDA.prelude, re.S).group(0)


HOST += cuda_helper("ds4_byte_float") + cuda_helper("ds4_magic_byte")

C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", np.dtype(np.int32): "int32_t",
           np.dtype(np.uint32): "uint32_t", np.dtype(np.uint8): "uint8_t", np.dtype(np.bool_): "bool"}


def kernel_library(kernel: Kernel, template: Mapping[str, int], types: Sequence[str], directory: Path,
                   prelude: str = "") -> ctypes.CDLL:
    """The kernel declared as MLX declares it (`types`: C element types of inputs then outputs, any `prelude`
    defining types of its own), with an extern "C" launch(void** buffers, groups_x, groups_y, threads) running it
    over the grid of threadgroups."""
    params = [f"{'const ' if i < len(kernel.inputs) else ''}{c_type}* {name}"
              for i, (c_type, name) in enumerate(zip(types, kernel.inputs + kernel.outputs, strict=True))]
    dynamic = f"alignas(16) static float ds4_shared[{kernel.shared_memory // 4}];\n" if kernel.shared_memory else ""
    source = HOST + prelude + dynamic + CUDA.render(kernel.header)
    source += f"void emulated_kernel({', '.join(params)}) {{\n"
    source += "".join(f"  constexpr bool {name} = {str(value).lower()};\n" if isinstance(value, bool)
                      else f"  constexpr int {name} = {value};\n" for name, value in template.items())
    source += CUDA.render(kernel.source) + "\n}\n"
    arguments = ", ".join(f"({param.rsplit(' ', 1)[0]})buffers[{i}]" for i, param in enumerate(params))
    source += ('extern "C" void launch(void** buffers, int groups_x, int groups_y, int threads) {\n'
               f"  run_groups(groups_x, groups_y, threads, [=] {{ emulated_kernel({arguments}); }});\n}}\n")
    return compile_library(source, directory, kernel.name)


def emulated(kernel: Kernel, template: Mapping[str, int], directory: Path) -> Callable:
    """`kernel` with these template constants, run on the CPU: a function of (inputs, output shapes, groups (x, y),
    threads per group, output dtypes (float32 unless given)) -> outputs, which start as UNWRITTEN. Inputs' dtypes
    type the signature, as MLX's do; it is compiled once per signature."""

    def library(inputs: Sequence[np.ndarray], output_dtypes: Sequence[np.dtype]) -> ctypes.CDLL:
        types = [C_TYPES[a.dtype] for a in inputs] + [C_TYPES[d] for d in output_dtypes]
        return kernel_library(kernel, template, types, directory)

    return runner(library)


def emulated_build(directory: Path) -> Callable:
    """A stand-in for dialect.build(kernel, backend): the kernel's CUDA text run on the CPU, called as MLX's custom
    kernels are (template as (name, value) pairs, `grid` in threads, whole threadgroups of one dimension)."""

    def build(kernel: Kernel, backend: str) -> Callable:
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes) -> list[mx.array]:
            threads = threadgroup[0]
            assert grid[0] % threads == 0 and grid[2] == 1 and tuple(threadgroup[1:]) == (1, 1)
            run = emulated(kernel, dict(template), directory)
            outputs = run([np.array(a) for a in inputs], output_shapes, (grid[0] // threads, grid[1]), threads,
                          [numpy_dtype(d) for d in output_dtypes])
            return [mx.array(y) for y in outputs]

        return call

    return build
