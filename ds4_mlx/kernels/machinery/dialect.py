"""One kernel definition, rendered for CUDA (`mx.fast.cuda_kernel`, through nvrtc.py's disk cache) or Metal
(`mx.fast.metal_kernel`).

A kernel is written once, as the body of an MLX custom kernel: MLX generates the signature from the input and
output names (inputs are read-only pointers, outputs writable ones, template arguments compile-time constants)
and launches `grid` threads in groups of `threadgroup`, on both backends. The body is the C++ both languages
share, plus a few neutral words that each dialect spells its own way:

- thread position: THREAD_IN_GROUP, GROUP_X, GROUP_Y (threadgroup / block indices), SIMD_LANE (0..31) and
  SIMD_INDEX (the 32-thread SIMD group / warp within the group). They are replaced in the text because MLX's
  Metal backend adds a thread attribute to the signature only when its name appears in the body;
- qualifiers: SHARED declares threadgroup memory; SHARED_MEM and GLOBAL_MEM are the address spaces of pointers
  into threadgroup and device memory (CUDA's pointers are generic, Metal's are qualified); CONSTANT declares
  program-scope tables and DEVICE_FN helper functions;
- helper functions each dialect's prelude defines: ds4_barrier() (all threads of the group), ds4_simd_barrier()
  (the 32 threads of a SIMD group), ds4_simd_sum(float), ds4_popcount(unsigned int), ds4_half_to_float(unsigned
  short) (IEEE half bits to float), ds4_exp(float) (full-precision e^x), ds4_simd_max(float), ds4_simd_xor(float
  or int, int mask) (the value of the lane whose index differs by that xor mask; all 32 lanes must take part),
  ds4_atomic_add(SHARED_MEM int*, int) (an atomic add to threadgroup memory, result unused), ds4_bits(float) /
  ds4_float(unsigned int) (reinterpret), ds4_byte_float(unsigned int w, int k) (the float 2^23 + byte k of w, so
  that subtracting 2^23 gives the byte's value exactly: one byte permute on CUDA), ds4_rint(float) (ties to even),
  ds4_div(float, float) (correctly rounded, whatever fast-math setting the backend compiles with), ds4_log1p(float)
  (Metal has no log1p: its prelude sums 2 atanh(x / (2 + x))'s series near 0, log(1 + x) elsewhere), ds4_byte_perm(lo, hi, selector) (CUDA's __byte_perm: byte n of the result is
  byte (selector >> 4n) & 7 of the eight bytes hi:lo; selector nibbles stay below 8) and ds4_magic_byte(word,
  j) (2^23 + byte j of word, an exact float made by one byte permute: quants become floats without an
  int-to-float conversion, which runs at a quarter of the FMA rate on NVIDIA GPUs). Also ds4_cos(float) and
  ds4_sin(float) (full precision, with full range reduction) and ds4_round_half(float) (to the nearest float16
  value, ties to even, back as a float).
- ds4_last_group(counter, groups, SHARED_MEM flag, THREAD_IN_GROUP) (every thread of every threadgroup calls it
  once, after its writes: true in the one threadgroup that arrives last, which then sees the others' writes
  through ds4_load_fresh(GLOBAL_MEM float*); `counter`, a uint32 input that is zero between launches, is counted
  up and put back to zero; each call site owns its counter, since launches that share one must not overlap).
  The counter must live in device memory: MLX's CUDA allocator puts arrays of 8 bytes or less in managed memory.
  Written for Metal too, but run only on CUDA: the fast path that uses it (router.py's GatedRoute) is CUDA-only,
  and Metal keeps two launches where CUDA makes one.
- CUDA only (tensor cores; kernels that call them are CUDA-only fast paths, Metal keeps a SIMT kernel):
  ds4_tf32_split(float v, unsigned int& hi, unsigned int& lo) (hi = v rounded to TF32, 10 mantissa bits, nearest
  with ties away from zero as cvt.rna rounds; lo = v - hi rounded the same way: hi + lo carries ~21 bits of v) and
  ds4_mma_tf32_16x8x8(float* c, const unsigned int* a, const unsigned int* b) (c += A B for one warp: A 16 x 8 in
  a[0..3], B 8 x 8 in b[0..1], C 16 x 8 in c[0..3], each lane holding the fragment elements PTX's mma.m16n8k8
  .tf32 layout gives it: with g = lane / 4 and t = lane % 4, a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4];
  b = B[t][g], B[t+4][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]; all 32 lanes take part);
  ds4_half2_bits(float lo, float hi) (two floats rounded to IEEE halves, nearest even, packed: lo in bits 0-15),
  ds4_half2_split(float a, float b, unsigned int& hi, unsigned int& lo) (hi = the pair as halves, lo = the pair's
  residues a - hi.a, b - hi.b as halves: hi + lo carries ~22 bits of each where lo stays normal) and
  ds4_mma_f16_16x8x16(float* c, const unsigned int* a, const unsigned int* b) (c += A B for one warp, A 16 x 16 and
  B 16 x 8 halves, two per register, low half first, C float32, mma.m16n8k16.f16's layout: a = A[g][2t, 2t+1],
  A[g+8][2t, 2t+1], A[g][2t+8, 2t+9], A[g+8][2t+8, 2t+9]; b = B[2t, 2t+1][g], B[2t+8, 2t+9][g]; c as above);
  ds4_ldmatrix_x4(unsigned int* r, const unsigned int* row) (ldmatrix.m8n8.x4: lane 8 m + i gives the threadgroup
  memory address of row i of 8 x 8 half matrix m, 16 bytes, 16-byte aligned; lane 4 g + t receives in r[m] word
  t of matrix m's row g: one instruction for a whole mma A fragment, or two B fragments) and ds4_ldmatrix_x4_trans
  (the same matrices transposed: lane 4 g + t receives halves g of rows 2t and 2t + 1, so that B fragments come
  from a matrix stored k-major);
  ds4_copy16_async(float* dst, const float* src, bool full) (16 bytes from global to threadgroup memory without
  passing through registers, cp.async; zeros where not `full`; both addresses 16-byte aligned), ds4_async_commit()
  (the copies issued since the last commit become one group), ds4_async_wait_all() and ds4_async_wait_prior()
  (this thread's groups all landed, or all but the newest): a stage's keys load while the previous one is used;
  ds4_copy4_async (the same for 4 bytes, 4-byte aligned) and ds4_async_wait_keep<N>() (all but the N newest
  groups landed), for pipelines several stages deep; ds4_quant_half2(w, selector, bias) (two bytes of w, chosen as
  prmt's selector 0x4140 or 0x4342 chooses bytes 0, 1 or 2, 3 with 0x64 above each, as the halves 1024 + byte,
  less the two halves of `bias`: 0x64806480 makes a byte b the exact half b - 128); ds4_quant_fma_half2(w,
  selector, scale, offset) (the same halves 1024 + byte times `scale` plus `offset`, both half pairs, one fused
  rounding: scale k, offset -1024 k make a byte b the half b k, exact while b k is);
  sm_90a only (Hopper's warpgroup products, dense_wgmma.py): ds4_wgmma_f16_64x128x16<LBO, SBO>(float* d, const
  unsigned int* a, const unsigned int* b, int accumulate) (wgmma.mma_async m64n128k16, called by the 128 threads of
  a warpgroup together: d, 64 floats a thread, = A B (+ d where accumulate), A 64 x 16 halves from registers, warp w
  of the warpgroup holding rows 16 w.. as mma.m16n8k16's A fragment, B 16 x 128 halves in threadgroup memory at b,
  K-major without swizzling: 8 x 8 core matrices of 16-byte rows (a column's 8 consecutive K), the next along K LBO
  bytes on, along N SBO bytes on; d's n8 block j in d[4 j..4 j + 3] as mma's C) and ds4_wgmma_f16_64x64x16 (the
  same for 64 columns of B, 32 floats of d), ds4_wgmma_split<N, LBO, SBO>(d, a, hi, lo_words, accumulate) (A times
  x split in two planes, the lo plane lo_words on from the hi plane: lo first, then hi into the same sums; N 128 or
  64 columns), ds4_wgmma_fence() (before a wgmma whose registers other instructions touched), ds4_wgmma_commit()
  (the wgmma issued since become one group), ds4_wgmma_wait<N>(float* d) (all but the N newest groups done; naming
  the 64 accumulators keeps the compiler from reading them before), ds4_wgmma_hold(unsigned int* a) (after the wait
  that covers a wgmma, its four A registers: the compiler sees them read there, so it gives their registers to
  nothing else while the tensor cores may still read them, which PTX leaves undefined) and
  ds4_fence_async_shared() (threadgroup memory written by threads or cp.async made visible to the tensor cores'
  reads); and the bulk copies (the TMA unit's, one instruction a whole block where cp.async takes one a thread
  and 16 bytes): ds4_bar_init(bar, count) (a transaction barrier in threadgroup memory, `count` arrivals a phase;
  barriers made before a ds4_barrier()), ds4_bar_expect(bar, bytes) (one arrival, and `bytes` more to land this
  phase), ds4_bulk_copy(dst, src, bytes, bar) (bytes, a multiple of 16, from global to threadgroup memory, both
  16-byte aligned; their landing counted on bar) and ds4_bar_wait(bar, parity) (until the phase of that parity
  is done: its copies landed, visible to this thread and to the tensor cores).

Both backends run 32-thread SIMD groups (NVIDIA warps, Apple SIMD groups), which the kernels rely on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from .nvrtc import CachedKernel

SIMD_WIDTH = 32


SIMD_EXCLUSIVE_SUM = """
DEVICE_FN int ds4_simd_exclusive_sum(int v, int lane) {
  int before = 0;
  int group = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = ds4_simd_xor(group, offset);
    before += (lane & offset) != 0 ? other : 0;
    group += other;
  }
  return before;
}
"""
"""A helper for kernel headers (neutral text): the sum of v over the SIMD group's lower lanes, all 32 lanes taking
part (a butterfly: each step adds the lower partner block's total)."""


@dataclass(frozen=True)
class Kernel:
    """A custom kernel in the neutral dialect: its name, input and output names, body and helper header."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    header: str = ""
    launch_bounds: tuple[int, int] | None = None
    """CUDA only: (most threads a threadgroup launches with, fewest threadgroups an SM should hold), which makes the
    compiler keep registers within 64K / (their product): occupancy bought with a few spilled registers."""
    shared_memory: int = 0
    """CUDA only: bytes of dynamic threadgroup memory, the float array `ds4_shared` that the header then declares
    (static threadgroup memory stops at 48 KB; this may take up to 227 KB on the H200)."""


@dataclass(frozen=True)
class Dialect:
    """How one backend spells the neutral words, and the helper functions it defines."""

    name: str
    words: Mapping[str, str]
    prelude: str
    make: Callable[..., Callable]  # nvrtc.CachedKernel (mx.fast.cuda_kernel's stand-in) or mx.fast.metal_kernel

    def render(self, text: str) -> str:
        """The text with every neutral word replaced by this dialect's spelling."""
        return _WORD.sub(lambda m: self.words[m.group(0)], text)

    def header(self, kernel: Kernel) -> str:
        dynamic = ""
        if kernel.shared_memory and self.name == "cuda":
            dynamic = "extern __shared__ __align__(16) float ds4_shared[];\n"
        return self.prelude + dynamic + self.render(kernel.header)

    def compile(self, kernel: Kernel) -> Callable:
        """The kernel object for this backend (compiled at its first launch: by MLX, or from nvrtc.py's cache; only
        the latter takes launch bounds, MLX's own route compiles without them)."""
        options: dict[str, object] = {}
        if self.name == "cuda" and kernel.launch_bounds:
            options["launch_bounds"] = kernel.launch_bounds
        if self.name == "cuda" and kernel.shared_memory:
            options["shared_memory"] = kernel.shared_memory
        return self.make(
            name=kernel.name,
            input_names=list(kernel.inputs),
            output_names=list(kernel.outputs),
            source=self.render(kernel.source),
            header=self.header(kernel),
            **options,
        )


def _wgmma_product(n: int) -> str:
    """The helper for wgmma.mma_async m64nNk16 with A from registers: n / 2 accumulators a thread."""
    regs = n // 2
    return f"""
template <int LBO, int SBO>
__device__ __forceinline__ void ds4_wgmma_f16_64x{n}x16(float* d, const unsigned int* a, const unsigned int* b,
                                                        int accumulate) {{
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(b);
  const unsigned long long desc = (unsigned long long)((at & 0x3FFFFu) >> 4) | ((unsigned long long)(LBO >> 4) << 16)
                                  | ((unsigned long long)(SBO >> 4) << 32);
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{", ".join(f"%{i}" for i in range(regs))}}}, "
               "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, 0;\\n}}"
               : {", ".join(f'"+f"(d[{i}])' for i in range(regs))}
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}}
"""


_WGMMA = _wgmma_product(128) + _wgmma_product(64) + """template <int N, int LBO, int SBO>
__device__ __forceinline__ void ds4_wgmma_split(float* d, const unsigned int* a, const unsigned int* hi, int lo_words,
                                                int accumulate) {
  if constexpr (N == 128) {
    ds4_wgmma_f16_64x128x16<LBO, SBO>(d, a, hi + lo_words, accumulate);
    ds4_wgmma_f16_64x128x16<LBO, SBO>(d, a, hi, 1);
  } else {
    ds4_wgmma_f16_64x64x16<LBO, SBO>(d, a, hi + lo_words, accumulate);
    ds4_wgmma_f16_64x64x16<LBO, SBO>(d, a, hi, 1);
  }
}
__device__ __forceinline__ void ds4_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void ds4_wgmma_hold(unsigned int* a) {
  asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3]));
}
__device__ __forceinline__ void ds4_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void ds4_wgmma_wait(float* d) {
  asm volatile("wgmma.wait_group.sync.aligned %64;"
               : """ + ", ".join(f'"+f"(d[{i}])' for i in range(64)) + """
               : "n"(N) : "memory");
}
__device__ __forceinline__ void ds4_fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void ds4_bar_init(unsigned long long* bar, unsigned int count) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(at), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void ds4_bar_expect(unsigned long long* bar, unsigned int bytes) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(at), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ds4_bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
  const unsigned int b = (unsigned int)__cvta_generic_to_shared(bar);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(at), "l"(src), "r"(bytes), "r"(b) : "memory");
}
__device__ __forceinline__ void ds4_bar_wait(unsigned long long* bar, unsigned int parity) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(bar);
  unsigned int done = 0;
  while (!done) {
    asm volatile("{\\n.reg .pred p;\\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\\nselp.u32 %0, 1, 0, p;\\n}"
                 : "=r"(done) : "r"(at), "r"(parity) : "memory");
  }
}
"""
"""The CUDA prelude's warpgroup products (sm_90a, Hopper's wgmma), written out here for their 64 accumulators."""


NEUTRAL_WORDS = (
    "THREAD_IN_GROUP", "GROUP_X", "GROUP_Y", "SIMD_LANE", "SIMD_INDEX",
    "SHARED", "SHARED_MEM", "GLOBAL_MEM", "CONSTANT", "DEVICE_FN",
)
_WORD = re.compile(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b")

CUDA = Dialect(
    name="cuda",
    words={
        "THREAD_IN_GROUP": "threadIdx.x",
        "GROUP_X": "blockIdx.x",
        "GROUP_Y": "blockIdx.y",
        "SIMD_LANE": "(threadIdx.x & 31)",
        "SIMD_INDEX": "(threadIdx.x >> 5)",
        "SHARED": "__shared__",
        "SHARED_MEM": "",
        "GLOBAL_MEM": "",
        "CONSTANT": "__constant__",
        "DEVICE_FN": "__device__ __forceinline__",
    },
    prelude="""
#include <cuda_fp16.h>

__device__ __forceinline__ void ds4_barrier() { __syncthreads(); }
__device__ __forceinline__ void ds4_simd_barrier() { __syncwarp(); }
__device__ __forceinline__ float ds4_simd_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
__device__ __forceinline__ unsigned int ds4_popcount(unsigned int v) { return __popc(v); }
__device__ __forceinline__ float ds4_exp(float v) { return expf(v); }
__device__ __forceinline__ float ds4_simd_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}
__device__ __forceinline__ float ds4_simd_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ unsigned int ds4_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ float ds4_float(unsigned int v) { return __uint_as_float(v); }
__device__ __forceinline__ float ds4_byte_float(unsigned int w, int k) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650u | (unsigned int)k));
}
__device__ __forceinline__ float ds4_rint(float v) { return rintf(v); }
__device__ __forceinline__ float ds4_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float ds4_log1p(float v) { return log1pf(v); }
__device__ __forceinline__ float ds4_cos(float v) { return cosf(v); }
__device__ __forceinline__ float ds4_sin(float v) { return sinf(v); }
__device__ __forceinline__ float ds4_half_to_float(unsigned short bits) {
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ float ds4_round_half(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ int ds4_simd_xor(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ void ds4_atomic_add(int* p, int v) { atomicAdd(p, v); }
__device__ __forceinline__ bool ds4_last_group(const unsigned int* counter, unsigned int groups, unsigned int* flag,
                                               unsigned int tid) {
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    unsigned int* count = const_cast<unsigned int*>(counter);
    const unsigned int done = atomicAdd(count, 1u) + 1u;
    flag[0] = done == groups ? 1u : 0u;
    if (done == groups) {
      atomicExch(count, 0u);
    }
  }
  __syncthreads();
  const bool last = flag[0] != 0u;
  if (last) {
    __threadfence();
  }
  return last;
}
__device__ __forceinline__ float ds4_load_fresh(const float* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned int ds4_byte_perm(unsigned int lo, unsigned int hi, unsigned int selector) {
  unsigned int r;  // prmt itself: __byte_perm would first mask the selector to 3-bit nibbles
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
  return r;
}
__device__ __forceinline__ float ds4_magic_byte(unsigned int word, int j) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u + (unsigned int)j));
}
__device__ __forceinline__ void ds4_tf32_split(float v, unsigned int& hi, unsigned int& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(v));
  hi &= 0xFFFFE000u;  // a float again: PTX leaves the low bits of a .tf32 register to the implementation
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
}
__device__ __forceinline__ unsigned int ds4_half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned int*>(&h);
}
__device__ __forceinline__ void ds4_half2_split(float a, float b, unsigned int& hi, unsigned int& lo) {
  hi = ds4_half2_bits(a, b);
  lo = ds4_half2_bits(a - ds4_half_to_float((unsigned short)(hi & 0xFFFFu)),
                      b - ds4_half_to_float((unsigned short)(hi >> 16)));
}
__device__ __forceinline__ void ds4_mma_f16_16x8x16(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ds4_ldmatrix_x4(unsigned int* r, const unsigned int* row) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
__device__ __forceinline__ void ds4_ldmatrix_x4_trans(unsigned int* r, const unsigned int* row) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
__device__ __forceinline__ void ds4_copy16_async(float* dst, const float* src, bool full) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(at), "l"(src), "r"(full ? 16 : 0) : "memory");
}
__device__ __forceinline__ void ds4_copy4_async(float* dst, const float* src, bool full) {
  const unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(at), "l"(src), "r"(full ? 4 : 0) : "memory");
}
__device__ __forceinline__ void ds4_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void ds4_async_wait_keep() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ unsigned int ds4_quant_half2(unsigned int w, unsigned int selector, unsigned int bias) {
  const unsigned int h = ds4_byte_perm(w, 0x64646464u, selector);
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&bias));
  return *reinterpret_cast<const unsigned int*>(&r);
}
__device__ __forceinline__ unsigned int ds4_quant_fma_half2(unsigned int w, unsigned int selector, unsigned int scale,
                                                           unsigned int offset) {
  const unsigned int h = ds4_byte_perm(w, 0x64646464u, selector);
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&scale),
                            *reinterpret_cast<const __half2*>(&offset));
  return *reinterpret_cast<const unsigned int*>(&r);
}
__device__ __forceinline__ void ds4_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void ds4_async_wait_prior() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void ds4_mma_tf32_16x8x8(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
""" + _WGMMA,
    make=CachedKernel,
)

METAL = Dialect(
    name="metal",
    words={
        "THREAD_IN_GROUP": "thread_position_in_threadgroup.x",
        "GROUP_X": "threadgroup_position_in_grid.x",
        "GROUP_Y": "threadgroup_position_in_grid.y",
        "SIMD_LANE": "thread_index_in_simdgroup",
        "SIMD_INDEX": "simdgroup_index_in_threadgroup",
        "SHARED": "threadgroup",
        "SHARED_MEM": "threadgroup",
        "GLOBAL_MEM": "device",
        "CONSTANT": "constant",
        "DEVICE_FN": "inline",
    },
    prelude="""
inline void ds4_barrier() { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }
inline void ds4_simd_barrier() { metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup); }
inline float ds4_simd_sum(float v) { return metal::simd_sum(v); }
inline unsigned int ds4_popcount(unsigned int v) { return metal::popcount(v); }
inline float ds4_exp(float v) { return metal::precise::exp(v); }
inline float ds4_simd_max(float v) { return metal::simd_max(v); }
inline float ds4_simd_xor(float v, int mask) { return metal::simd_shuffle_xor(v, (ushort)mask); }
inline unsigned int ds4_bits(float v) { return as_type<unsigned int>(v); }
inline float ds4_float(unsigned int v) { return as_type<float>(v); }
inline float ds4_byte_float(unsigned int w, int k) { return as_type<float>(0x4B000000u | ((w >> (8 * k)) & 0xFFu)); }
inline float ds4_rint(float v) { return metal::rint(v); }
inline float ds4_div(float a, float b) { return metal::precise::divide(a, b); }
inline float ds4_log1p(float v) {
  if (v > -0.25f && v < 0.375f) {  // 1 + v would drop v's low bits: 2 atanh(s), s = v / (2 + v), by its series
    const float s = metal::precise::divide(v, 2.0f + v);
    const float s2 = s * s;
    return 2.0f * s * (1.0f + s2 * (0.33333334f + s2 * (0.2f + s2 * (0.14285715f + s2 * 0.11111111f))));
  }
  return metal::precise::log(1.0f + v);
}
inline float ds4_cos(float v) { return metal::precise::cos(v); }
inline float ds4_sin(float v) { return metal::precise::sin(v); }
inline float ds4_half_to_float(unsigned short bits) { return float(as_type<half>(bits)); }
inline float ds4_round_half(float v) { return float(half(v)); }
inline int ds4_simd_xor(int v, int mask) { return metal::simd_shuffle_xor(v, (ushort)mask); }
inline void ds4_atomic_add(threadgroup int* p, int v) {
  metal::atomic_fetch_add_explicit((threadgroup metal::atomic_int*)p, v, metal::memory_order_relaxed);
}
inline bool ds4_last_group(const device unsigned int* counter, unsigned int groups, threadgroup unsigned int* flag,
                           unsigned int tid) {
  metal::atomic_thread_fence(metal::mem_flags::mem_device, metal::memory_order_seq_cst, metal::thread_scope_device);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  if (tid == 0) {
    device metal::atomic_uint* count = (device metal::atomic_uint*)counter;
    const unsigned int done = metal::atomic_fetch_add_explicit(count, 1u, metal::memory_order_relaxed) + 1u;
    flag[0] = done == groups ? 1u : 0u;
    if (done == groups) {
      metal::atomic_store_explicit(count, 0u, metal::memory_order_relaxed);
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  metal::atomic_thread_fence(metal::mem_flags::mem_device, metal::memory_order_seq_cst, metal::thread_scope_device);
  return flag[0] != 0u;
}
inline float ds4_load_fresh(const device float* p) { return *p; }
inline unsigned int ds4_byte_perm(unsigned int lo, unsigned int hi, unsigned int selector) {
  unsigned int r = 0u;
  for (int n = 0; n < 4; ++n) {
    const unsigned int k = (selector >> (4 * n)) & 7u;
    r |= (((k < 4u ? lo : hi) >> (8u * (k & 3u))) & 255u) << (8 * n);
  }
  return r;
}
inline float ds4_magic_byte(unsigned int word, int j) {
  return as_type<float>(0x4B000000u | ((word >> (8 * j)) & 255u));
}
""",
    make=mx.fast.metal_kernel,
)

DIALECTS = {"cuda": CUDA, "metal": METAL}


STAND_INS = False
"""Set (by registry.planning) while graphs are built for counting only: build() then returns stand_in."""


def build(kernel: Kernel, backend: str) -> Callable:
    """The kernel compiled for `backend` ("cuda" or "metal"), made once per kernel and backend."""
    if STAND_INS:
        return stand_in
    return _compiled(kernel, backend)


@cache
def _compiled(kernel: Kernel, backend: str) -> Callable:
    if backend not in DIALECTS:
        raise ValueError(f"no custom kernels for the {backend} backend; expected one of {', '.join(DIALECTS)}")
    return DIALECTS[backend].compile(kernel)


def stand_in(*, inputs: list[mx.array], output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
             **launch: object) -> list[mx.array]:
    """A launch's place in a graph without its work: zero outputs of the launch's shapes that depend on all its
    inputs, through one Depends node (the node that stands for the kernel when a graph is counted)."""
    zeros = [mx.array(np.zeros(shape, dtype=np.float32), dtype=dtype)  # leaves: no nodes of their own
             for shape, dtype in zip(output_shapes, output_dtypes)]
    return mx.depends(zeros, [x for x in inputs if isinstance(x, mx.array)])
