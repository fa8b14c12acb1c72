"""The grouped GEMM kernel (kernels/tensor_cores/grouped_gemm.py) against one product per (pair, expert).

Each pair's row must be x[i] @ W[e(i)].T within float32 reassociation (TOLERANCE) for any per-expert counts: unused
experts, single pairs, one expert with more than a tile of pairs or with all of them, N not a multiple of the tile
rows, OUT not a multiple of the tile columns, IN not a multiple of the K slice, more experts than SIMD lanes. With a
bfloat16 scratch the kernel converts each weight exactly, so it must equal the product with the bf16-rounded
weights to the same bound. On the CPU through the kernel's CUDA text compiled by g++ (emulated_cuda.py, slow
marker), on the GPU through MLX (gpu marker); the CPU tests pin the launch bound and the fallback.
"""

from __future__ import annotations

import ctypes
import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import dialect
from ds4_mlx.kernels.prefill.batch import TOLERANCE
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.prefill.grouped import scratch_matmul
from ds4_mlx.kernels.tensor_cores.grouped_gemm import (GROUPED_GEMM, KERNEL, TK, TM, TN, THREADS, expert_counts,
                                          fallback_matmul, grouped_gemm, row_tiles, untrusted_matmul)
from ds4_mlx.kernels.machinery.probe import random_activations
from emulated_cuda import kernel_library

pytestmark = pytest.mark.usefixtures("kernels_unforced")

CASES = {
    "skewed": ([0, 1, 30, 0, 6], 96, 64),  # N = 37: unused experts, a single pair, one expert with most pairs
    "beyond_a_tile": ([130, 0, 20], 200, 40),  # 3 tiles for expert 0 (the last of 2 rows); 2 column tiles; IN % TK
    "one_expert": ([5], 8, 16),
    "many_experts": ([0, 3, 0, 0, 1, 7, 0, 2] * 5 + [70], 24, 32),  # 41 experts: two per lane in the scan
}
"""counts per expert, OUT, IN."""


def pairs(counts: list[int], n_out: int, n_in: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x (N, IN), scratch (E, OUT, IN), sorted ids (N,)) for these counts, float32."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(len(counts)), counts).astype(np.uint32)
    x = rng.standard_normal((ids.size, n_in)).astype(np.float32)
    return x, rng.standard_normal((len(counts), n_out, n_in)).astype(np.float32), ids


def products(x: np.ndarray, scratch: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """One product per pair, in float64."""
    return np.einsum("ni,noi->no", x.astype(np.float64), scratch[ids].astype(np.float64))


def within(got: np.ndarray, want: np.ndarray, bound: float) -> bool:
    return bool(np.abs(got - want).max() <= bound * np.abs(want).max())


def test_row_tiles_bound_every_routing():
    """The grid's row tiles cover every expert's ceil(count / TM) tiles, whatever the counts."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n_expert = int(rng.integers(1, 300))
        counts = rng.multinomial(int(rng.integers(1, 5000)), rng.dirichlet(np.full(n_expert, rng.uniform(0.05, 5))))
        assert (-(-counts // TM)).sum() <= row_tiles(int(counts.sum()), n_expert)
    assert row_tiles(12288, 256) == 192 + 256 and row_tiles(3, 256) == 1 + 3


def test_kernel_renders_for_cuda_and_metal():
    for target in (CUDA, METAL):
        seen = {}
        dialect.Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(KERNEL)
        text = seen["source"] + seen["header"]
        assert seen["input_names"] == ["x", "scratch", "counts", "dims"] and seen["output_names"] == ["y"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", text)
        for helper in set(re.findall(r"\b(?:ds4|gg)_\w+(?=\()", seen["source"])):
            assert re.search(rf"\b{helper}\(", seen["header"]), f"{helper} is called but not defined"
        for open_, close in ("{}", "()", "[]"):
            assert text.count(open_) == text.count(close)
        for name in seen["input_names"]:  # MLX would add shape arguments for these
            assert not re.search(rf"\b{name}_(shape|strides|ndim)", seen["source"])
    assert (TM, TN, TK, THREADS) == (64, 128, 16, 256)  # the kernel's thread mappings assume these


@pytest.mark.parametrize("case", CASES)
def test_the_cpu_keeps_the_sorted_gather_mm_and_the_fallback_is_right(on_cpu, case):
    """On the CPU no kernel runs: scratch_matmul keeps the sorted gather_mm, and untrusted_matmul (CUDA's route)
    quietly takes the fallback; both give one product per pair."""
    counts, n_out, n_in = CASES[case]
    x, scratch, ids = pairs(counts, n_out, n_in, seed=2)
    want = products(x, scratch, ids)
    xm, sm, im = mx.array(x), mx.array(scratch), mx.array(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not GROUPED_GEMM[mx.float32].enabled((n_out, n_in))
        for got in (scratch_matmul(xm, sm, im), untrusted_matmul(xm, sm, im),
                    fallback_matmul(xm, sm, im, expert_counts(im, len(counts)))):
            assert got.dtype == mx.float32 and within(np.array(got), want, TOLERANCE)


BF16 = """
struct bf16 {
  unsigned short bits;
  operator float() const { unsigned int u = (unsigned int)bits << 16; float v; std::memcpy(&v, &u, 4); return v; }
};
"""


def emulated(x: np.ndarray, scratch: np.ndarray, counts: list[int], bfloat16: bool, tmp_path) -> np.ndarray:
    """The kernel's CUDA text run on the CPU; the output starts as NaN, so a row left unwritten shows."""
    types = ["float", "bf16" if bfloat16 else "float", "uint32_t", "int32_t", "float"]
    prelude = BF16 + f"using T = {'bf16' if bfloat16 else 'float'};\n"  # MLX's dtype template argument
    library = kernel_library(KERNEL, {"TM": TM, "TN": TN, "TK": TK, "THREADS": THREADS}, types, tmp_path, prelude)
    n_expert, n_out, n_in = scratch.shape
    weights = np.array(mx.array(scratch).astype(mx.bfloat16).view(mx.uint16)) if bfloat16 else scratch
    weights = np.ascontiguousarray(weights)
    counts_array = np.array(counts, np.uint32)
    dims = np.array([n_expert, n_out, n_in], np.int32)
    y = np.full((x.shape[0], n_out), np.nan, np.float32)
    arrays = (np.ascontiguousarray(x), weights, counts_array, dims, y)
    buffers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    library.launch(buffers, -(-n_out // TN), row_tiles(x.shape[0], n_expert), THREADS)
    return y


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16"])
def test_emulated_cuda_kernel_equals_one_product_per_pair(on_cpu, case, bfloat16, tmp_path):
    counts, n_out, n_in = CASES[case]
    x, scratch, ids = pairs(counts, n_out, n_in, seed=3)
    got = emulated(x, scratch, counts, bfloat16, tmp_path)
    weights = np.array(mx.array(scratch).astype(mx.bfloat16).astype(mx.float32)) if bfloat16 else scratch
    assert np.isfinite(got).all()
    assert within(got, products(x, weights, ids), TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

FLASH_WIDTHS = [(2048, 4096), (4096, 2048)]
"""(OUT, IN) of Flash's gate / up and down banks."""


def flash_routing(case: str, tokens: int = 2048, k: int = 6, n_expert: int = 256) -> np.ndarray:
    """Sorted expert ids of a 2048-token chunk: top-6 of 256 at random, or every token's first slot on expert 3."""
    rng = np.random.default_rng(61)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(tokens)])
    if case == "skewed":
        ids[:, 0] = 3
        ids[:, 1:] = np.where(ids[:, 1:] == 3, 4, ids[:, 1:])
    return np.sort(ids.reshape(-1)).astype(np.uint32)


def flash_pairs(case: str, widths: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, mx.array, mx.array]:
    """A Flash chunk's sorted ids, counts (256,), activations x (N, IN) and a random float32 bank (256, OUT, IN)."""
    n_out, n_in = widths
    ids = flash_routing(case)
    x = random_activations((ids.size, n_in), seed=62)
    return ids, np.bincount(ids, minlength=256), x, mx.random.normal((256, n_out, n_in), key=mx.random.key(63))


def assert_per_expert(got: mx.array, x: mx.array, bank: mx.array, counts: np.ndarray) -> None:
    """Each used expert's rows of `got` equal x_e @ W_e.T within TOLERANCE of their largest value."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    for e in np.flatnonzero(counts):
        rows = slice(int(starts[e]), int(starts[e + 1]))
        want = x[rows] @ bank[int(e)].astype(mx.float32).T
        assert (mx.abs(got[rows] - want).max() <= TOLERANCE * mx.abs(want).max()).item(), (bank.dtype, int(e))


@pytest.mark.gpu
def test_grouped_gemm_passes_its_checks_on_the_gpu(on_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (mx.float32, mx.bfloat16):
            for widths in FLASH_WIDTHS:
                assert GROUPED_GEMM[dtype].enabled(widths)


@pytest.mark.gpu
@pytest.mark.parametrize("widths", FLASH_WIDTHS, ids=str)
@pytest.mark.parametrize("case", ["random", "skewed"])
def test_grouped_gemm_equals_per_expert_products_at_flash_size(on_gpu, widths, case):
    """12,288 pairs of 256 Flash experts: each expert's rows equal x_e @ W_e.T (float32, and the bf16 scratch's
    exact values), and scratch_matmul on CUDA takes the kernel for a bf16 scratch."""
    ids, counts, x, scratch = flash_pairs(case, widths)
    sorted_ids, counts_mx = mx.array(ids), mx.array(counts.astype(np.uint32))
    for dtype in (mx.float32, mx.bfloat16):
        weights = scratch.astype(dtype)
        got = grouped_gemm(x, weights, counts_mx)
        assert_per_expert(got, x, weights, counts)
        if mx.cuda.is_available() and dtype == mx.bfloat16:  # float32 takes the 3xTF32 kernel (grouped_tf32.py)
            assert (scratch_matmul(x, weights, sorted_ids, counts_mx) == got).all().item()
        del weights, got
