"""The 3xTF32 grouped GEMM kernel (kernels/tensor_cores/grouped_tf32.py) and its two tensor-core helpers.

Without a GPU the mma is emulated (emulated_cuda.py): the warp's fragments are gathered and rebuilt into the 16 x 8
and 8 x 8 matrices by PTX's mma.m16n8k8 .tf32 layout. A layout mistake shared by the emulation and the kernel would
pass the kernel tests, so the helpers have their own tests: a probe kernel loads each lane's fragments from global
memory with the layout written out again here, against numpy on matrices whose every element differs (a transposed
or swapped fragment changes the product), in emulation and, gpu-marked, on the device itself. The kernel must
equal one float64 product per pair within the SIMT kernel's float32 bound (TOLERANCE) for odd shapes and routings,
and plain TF32 must fail that bound at Flash's K (the bound tells the two apart).
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.tensor_cores import grouped_tf32
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.prefill.batch import TOLERANCE
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, Kernel, build
from ds4_mlx.kernels.prefill.grouped import scratch_matmul
from ds4_mlx.kernels.tensor_cores.grouped_tf32 import (GROUPED_GEMM_TF32, KERNEL, LD, TK, tensor_core_matmul,
    tf32_grouped_gemm)
from emulated_cuda import emulated, emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_grouped_gemm import FLASH_WIDTHS, assert_per_expert, flash_pairs, pairs, products, within

pytestmark = pytest.mark.usefixtures("kernels_unforced")

HELPERS = ("ds4_tf32_split", "ds4_mma_tf32_16x8x8")

MMA_PROBE = Kernel("ds4_mma_probe", ("a", "b", "c"), ("d",), """
const int lane = SIMD_LANE;
const int g = lane >> 2;
const int t = lane & 3;
const GLOBAL_MEM float* wa = a + SIMD_INDEX * 128;
const GLOBAL_MEM float* wb = b + SIMD_INDEX * 64;
const GLOBAL_MEM float* wc = c + SIMD_INDEX * 128;
GLOBAL_MEM float* wd = d + SIMD_INDEX * 128;
unsigned int fa[4] = {ds4_bits(wa[g * 8 + t]), ds4_bits(wa[(g + 8) * 8 + t]), ds4_bits(wa[g * 8 + t + 4]),
                      ds4_bits(wa[(g + 8) * 8 + t + 4])};
unsigned int fb[2] = {ds4_bits(wb[t * 8 + g]), ds4_bits(wb[(t + 4) * 8 + g])};
float fc[4] = {wc[g * 8 + 2 * t], wc[g * 8 + 2 * t + 1], wc[(g + 8) * 8 + 2 * t], wc[(g + 8) * 8 + 2 * t + 1]};
ds4_mma_tf32_16x8x8(fc, fa, fb);
wd[g * 8 + 2 * t] = fc[0];
wd[g * 8 + 2 * t + 1] = fc[1];
wd[(g + 8) * 8 + 2 * t] = fc[2];
wd[(g + 8) * 8 + 2 * t + 1] = fc[3];
""")
"""One mma per warp: warp w multiplies A_w (16 x 8, row-major), B_w (8 x 8, [k][n]) and adds C_w (16 x 8), each lane
loading a0 A[g][t], a1 A[g+8][t], a2 A[g][t+4], a3 A[g+8][t+4], b0 B[t][g], b1 B[t+4][g] and c0..c3 C[g][2t],
C[g][2t+1], C[g+8][2t], C[g+8][2t+1] (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32 and .f32)."""

SPLIT_PROBE = Kernel("ds4_tf32_split_probe", ("v",), ("hi", "lo"), """
const int i = GROUP_X * 32 + THREAD_IN_GROUP;
unsigned int h;
unsigned int l;
ds4_tf32_split(v[i], h, l);
hi[i] = h;
lo[i] = l;
""")
"""Each thread splits one value; launched with 32 threads per group."""


def mma_operands(warps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (warps, 16, 8), B (warps, 8, 8), C (warps, 16, 8): distinct small integers per element and per warp (exact
    in TF32, products and sums exact in float32), so that any misplaced element changes the result."""
    a = np.arange(warps * 128, dtype=np.float32).reshape(warps, 16, 8) + 1
    b = np.arange(warps * 64, dtype=np.float32).reshape(warps, 8, 8) * 3 - 100
    c = np.arange(warps * 128, dtype=np.float32).reshape(warps, 16, 8) * -7
    return a, b, c


def mma_want(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    want = np.einsum("wmk,wkn->wmn", a.astype(np.int64), b.astype(np.int64)) + c.astype(np.int64)
    assert np.abs(want).max() < 1 << 24
    return want.astype(np.float32)


def tf32_rna(v: np.ndarray) -> np.ndarray:
    """v rounded to 11 significant bits, to nearest with ties away from zero (cvt.rna.tf32.f32), in float64
    arithmetic: a separate formulation from the emulation's bit trick."""
    v = v.astype(np.float64)
    _, exponent = np.frexp(v)  # |v| = m 2^exponent, 0.5 <= m < 1: the TF32 unit is 2^(exponent - 11)
    unit = np.ldexp(1.0, exponent - 11)
    return (np.sign(v) * np.floor(np.abs(v) / unit + 0.5) * unit).astype(np.float32)


def split_inputs() -> np.ndarray:
    """Random values of many scales, exact ties (low 13 bits 0x1000) of both signs, and values one ulp either side."""
    rng = np.random.default_rng(5)
    random = (rng.standard_normal(156) * np.exp2(rng.integers(-30, 30, 156))).astype(np.float32)
    ties = (rng.integers(0x3F000000, 0x40000000, 32).astype(np.uint32) & ~np.uint32(0x1FFF)) | np.uint32(0x1000)
    near = np.concatenate([ties - np.uint32(1), ties + np.uint32(1)])
    bits = np.concatenate([ties, ties | np.uint32(1 << 31), near]).view(np.float32)
    return np.concatenate([random, bits, np.float32([0.0, 1.0, -1.0, 3.0])]).astype(np.float32)


def check_split(v: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> None:
    """hi is a float (the helper clears its low bits); lo only feeds the mma, which reads its top 19 bits (PTX leaves
    the rest of a .tf32 register to the implementation)."""
    assert not (hi & 0x1FFF).any()
    hi_f, lo_f = hi.view(np.float32), (lo & np.uint32(0xFFFFE000)).view(np.float32)
    np.testing.assert_array_equal(hi_f, tf32_rna(v))
    np.testing.assert_array_equal(lo_f, tf32_rna(v - hi_f))
    rest = np.abs(v.astype(np.float64) - hi_f - lo_f)
    assert (rest <= np.abs(v.astype(np.float64)) * 2.0**-21).all()


def plain_tf32(x: np.ndarray, scratch: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What one TF32 mma per product would give (exact products of the rounded operands, float64 sums)."""
    return products(tf32_rna(x), tf32_rna(scratch), ids)


# ---------------------------------------------------------------------------------------------------------------
# On the CPU

def test_kernel_renders_for_cuda_only():
    out = rendered(KERNEL, CUDA)
    assert out["input_names"] == ["x", "scratch", "counts", "dims"] and out["output_names"] == ["y"]
    assert_renders_cleanly(out)
    for helper in HELPERS:  # tensor-core helpers: CUDA's prelude only, Metal keeps the SIMT kernel
        assert re.search(rf"\b{helper}\(", CUDA.prelude) and not re.search(rf"\b{helper}\(", METAL.prelude)
    assert GROUPED_GEMM_TF32.backends == ("cuda",)
    # threadgroup memory: x and W slices, padded rows, under the 48 KB static limit
    assert (64 + 128) * LD * 4 + 12 <= 48 * 1024 and LD % 32 == 4 and TK % 8 == 0


def test_only_cuda_plans_the_tensor_core_kernel():
    with registry.planning("cuda"):
        assert GROUPED_GEMM_TF32.enabled((2048, 4096))
    with registry.planning("metal"):
        assert not GROUPED_GEMM_TF32.enabled((2048, 4096))


def test_the_cpu_takes_the_fallback(on_cpu):
    """On the CPU the kernel is not used; tensor_core_matmul (CUDA's route) gives the fallback's products."""
    counts, n_out, n_in = [0, 3, 9], 24, 40
    x, scratch, ids = pairs(counts, n_out, n_in, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not GROUPED_GEMM_TF32.enabled((n_out, n_in))
        got = tensor_core_matmul(mx.array(x), mx.array(scratch), mx.array(ids))
    assert within(np.array(got), products(x, scratch, ids), TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------
# Emulated (pytest -m slow)

@pytest.mark.slow
def test_emulated_mma_helper_follows_the_ptx_fragment_layout(tmp_path):
    a, b, c = mma_operands(2)
    (d,) = emulated(MMA_PROBE, {}, tmp_path)([a, b, c], [c.shape], (1, 1), 64)
    np.testing.assert_array_equal(d, mma_want(a, b, c))
    # the same product with B transposed or A's rows reversed differs everywhere it is checked
    assert (d != mma_want(a, np.swapaxes(b, 1, 2), c)).mean() > 0.9
    assert (d != mma_want(a[:, ::-1], b, c)).mean() > 0.9


@pytest.mark.slow
def test_emulated_split_rounds_to_nearest_ties_away(tmp_path):
    v = split_inputs()
    hi, lo = emulated(SPLIT_PROBE, {}, tmp_path)([v], [v.shape, v.shape], (v.size // 32, 1), 32,
                                                  [np.uint32, np.uint32])
    check_split(v, hi, lo)


CASES = {
    "skewed": ([0, 1, 30, 0, 6], 96, 64),  # N = 37: empty experts, a single pair, OUT below one column tile
    "beyond_a_tile": ([130, 0, 20], 200, 40),  # 3 row tiles for expert 0; 2 column tiles; IN % TK != 0
    "one_expert": ([5], 8, 16),  # E = 1, IN below one K slice
    "all_on_one": ([0, 0, 150, 0], 136, 72),  # one expert holds every pair, the others none
    "many_experts": ([0, 3, 0, 0, 1, 7, 0, 2] * 5 + [70], 24, 32),  # 41 experts: two per lane in the scan
}
"""counts per expert, OUT, IN."""


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_emulated_kernel_equals_one_product_per_pair(on_cpu, case, monkeypatch, tmp_path):
    monkeypatch.setattr(grouped_tf32, "build", emulated_build(tmp_path))
    counts, n_out, n_in = CASES[case]
    x, scratch, ids = pairs(counts, n_out, n_in, seed=6)
    got = np.array(tf32_grouped_gemm(mx.array(x), mx.array(scratch), mx.array(np.array(counts, np.uint32))))
    assert np.isfinite(got).all()  # every output was written
    assert within(got, products(x, scratch, ids), TOLERANCE)


@pytest.mark.slow
def test_emulated_kernel_at_flash_k_is_float32_class_and_plain_tf32_is_not(on_cpu, monkeypatch, tmp_path):
    """K = 4096 (Flash's gate / up IN): 3xTF32 is within TOLERANCE of the float64 products with room to spare
    (5e-7 of the largest output here; float32 summed in order: 1.9e-6); one TF32 product per term is not (3e-4),
    nor are 3xTF32 sums left to the tensor cores' truncation over the whole K (4e-5). Two experts, 70 pairs, 24
    outputs: two row tiles at work (~25 s on 2 cores)."""
    monkeypatch.setattr(grouped_tf32, "build", emulated_build(tmp_path))
    counts, n_out, n_in = [40, 30], 24, 4096
    x, scratch, ids = pairs(counts, n_out, n_in, seed=7)
    want = products(x, scratch, ids)
    got = np.array(tf32_grouped_gemm(mx.array(x), mx.array(scratch), mx.array(np.array(counts, np.uint32))))
    assert np.isfinite(got).all()
    assert within(got, want, TOLERANCE / 10)
    assert not within(plain_tf32(x, scratch, ids), want, TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.cuda
def test_mma_helper_follows_the_ptx_fragment_layout_on_the_gpu(on_cuda):
    a, b, c = mma_operands(2)
    (d,) = build(MMA_PROBE, "cuda")(inputs=[mx.array(a), mx.array(b), mx.array(c)], template=[], grid=(64, 1, 1),
                                    threadgroup=(64, 1, 1), output_shapes=[c.shape], output_dtypes=[mx.float32])
    np.testing.assert_array_equal(np.array(d), mma_want(a, b, c))


@pytest.mark.gpu
@pytest.mark.cuda
def test_split_rounds_to_nearest_ties_away_on_the_gpu(on_cuda):
    v = split_inputs()
    hi, lo = build(SPLIT_PROBE, "cuda")(inputs=[mx.array(v)], template=[], grid=(v.size, 1, 1),
                                        threadgroup=(32, 1, 1), output_shapes=[v.shape, v.shape],
                                        output_dtypes=[mx.uint32, mx.uint32])
    check_split(v, np.array(hi), np.array(lo))


@pytest.mark.gpu
@pytest.mark.cuda
def test_tf32_kernel_passes_its_checks_on_the_gpu(on_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for widths in FLASH_WIDTHS:
            assert GROUPED_GEMM_TF32.enabled(widths)


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("widths", FLASH_WIDTHS, ids=str)
@pytest.mark.parametrize("case", ["random", "skewed"])
def test_tf32_kernel_equals_per_expert_products_at_flash_size(on_cuda, widths, case):
    """12,288 pairs of 256 Flash experts: each expert's rows equal x_e @ W_e.T within TOLERANCE, and
    scratch_matmul on CUDA takes this kernel for a float32 scratch."""
    ids, counts, x, scratch = flash_pairs(case, widths)
    sorted_ids, counts_mx = mx.array(ids), mx.array(counts.astype(np.uint32))
    got = tf32_grouped_gemm(x, scratch, counts_mx)
    assert_per_expert(got, x, scratch, counts)
    assert (scratch_matmul(x, scratch, sorted_ids, counts_mx) == got).all().item()
