"""The grouped GEMMs that read raw IQ2_XXS / Q2_K banks directly (kernels/tensor_cores/grouped_raw.py: float16 tensor
cores, x split into two halves; kernels/tensor_cores/grouped_wgmma.py: the same by Hopper's warpgroup products).

Each kernel must equal one float64 product per pair over the reference dequantizer's weights (quants.py) within
float32 reassociation (TOLERANCE) for odd shapes and routings: unused experts, a single pair, E = 1, several row and
column tiles. Its decoding must be the reference's values exactly: with one-hot activations each output is one
weight, which the split carries exactly (a one-hot row scales to 2^14, a half with no residue), so every decoded value is checked to 2^-20 of itself (a wrong
grid entry, sign, scale or nibble is off by far more). Without a GPU the CUDA text runs in emulation
(emulated_cuda.py); gpu-marked tests check it on the device at Flash size.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.tensor_cores import grouped_raw, grouped_wgmma, halfsplit
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.prefill.batch import TOLERANCE
from ds4_mlx.kernels.machinery.dialect import CUDA
from ds4_mlx.kernels.prefill.grouped import RAW_GROUPED, sliced_reference
from ds4_mlx.kernels.tensor_cores.grouped_raw import (STAGES, grid_words, kernel, raw_grouped_gemm, shared_bytes,
    template)
from ds4_mlx.kernels.tensor_cores.halfsplit import reference_row_scales
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import _iq2_xxs_tables, dequantize
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_grouped_gemm import FLASH_WIDTHS, flash_routing, products, within

pytestmark = pytest.mark.usefixtures("kernels_unforced")

RAW_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K)
FLASH_SHAPES = {GGMLType.IQ2_XXS: FLASH_WIDTHS[0], GGMLType.Q2_K: FLASH_WIDTHS[1]}
"""(OUT, IN) of Flash's IQ2_XXS gate / up and Q2_K down banks."""


def bank(ggml_type: GGMLType, counts: list[int], n_out: int, n_in: int, seed: int
         ) -> tuple[mx.array, np.ndarray, np.ndarray]:
    """(raw blocks (E, OUT * row bytes), the reference's float32 weights (E, OUT, IN), sorted ids) for these
    counts."""
    n_expert = len(counts)
    blocks = random_blocks(ggml_type, n_expert * n_out, n_in, seed=seed).reshape(n_expert, -1)
    weights = np.array(dequantize(blocks, ggml_type, (n_expert, n_out, n_in)))
    return blocks, weights, np.repeat(np.arange(n_expert), counts).astype(np.uint32)


KERNELS = {"mma": raw_grouped_gemm, "wgmma": grouped_wgmma.wgmma_grouped_gemm}
"""Both raw-bank kernels, by their tensor-core instruction; the emulated tests run each."""


@pytest.fixture(params=KERNELS)
def run(request, monkeypatch, tmp_path):
    """One kernel in emulation (with the split it reads x from): run(ggml_type, x, blocks, counts, OUT, IN, rows=None,
    **plan) -> its products as numpy."""
    for module in (grouped_raw, grouped_wgmma, halfsplit):
        monkeypatch.setattr(module, "build", emulated_build(tmp_path))
    product = KERNELS[request.param]

    def call(ggml_type: GGMLType, x: np.ndarray, blocks: mx.array, counts: list[int], n_out: int, n_in: int,
             rows: np.ndarray | None = None, **plan: int) -> np.ndarray:
        return np.array(product(mx.array(x), blocks, mx.array(np.array(counts, np.uint32)), ggml_type,
                                (len(counts), n_out, n_in), None if rows is None else mx.array(rows), **plan))
    return call


# ---------------------------------------------------------------------------------------------------------------
# On the CPU

@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_kernels_render_for_cuda(ggml_type):
    out = rendered(kernel(ggml_type, 1), CUDA)
    assert out["input_names"] == ["xhi", "xlo", "w", "counts", "dims", "xscale", "xrow"]
    assert out["output_names"] == ["y"]
    assert_renders_cleanly(out)
    assert RAW_GROUPED[ggml_type].direct.backends == ("cuda",)
    # threadgroup memory at each stage width: STAGES x tiles and two W tiles dynamic; row scales and indices, the
    # scan, IQ2_XXS's byte grid and two stages' W row scales (Q2_K: a scale and a min per W row and group) static:
    # two threadgroups within an H200 SM's 228 KB
    for tk in (32, 64):
        ldh = dict(template(tk))["LDH"]
        assert ldh % 32 in (4, 20) and ldh % 4 == 0
        static = 2 * 64 * 4 + 12 + 4 * 512 + 2 * 2 * 4 * 128 * tk // 16
        assert kernel(ggml_type, 2, tk).shared_memory == shared_bytes(tk) == 4 * (STAGES * 2 * 64 + 2 * 128) * ldh
        assert 2 * (shared_bytes(tk) + static) <= 228 * 1024


def test_the_byte_grid_is_ggmls_grid():
    grid, _ = _iq2_xxs_tables()
    words = np.array(grid_words(), np.uint32)
    assert words.size == 512
    np.testing.assert_array_equal(words.view(np.uint8).reshape(256, 8), np.array(grid).astype(np.uint8))


def test_the_cpu_keeps_the_reference_and_cuda_plans_the_kernel(on_cpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ggml_type in RAW_TYPES:
            assert not RAW_GROUPED[ggml_type].direct.enabled(FLASH_SHAPES[ggml_type])
    with registry.planning("cuda"):
        assert RAW_GROUPED[GGMLType.IQ2_XXS].direct.enabled(FLASH_SHAPES[GGMLType.IQ2_XXS])
    with registry.planning("metal"):
        assert not RAW_GROUPED[GGMLType.IQ2_XXS].direct.enabled(FLASH_SHAPES[GGMLType.IQ2_XXS])


def test_row_scales_are_powers_of_two_that_fit_a_half():
    """Each row's largest magnitude lands in [2^14, 2^15) whatever its size; zero rows stay zero, a row with an
    infinity stays non-finite."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 64)).astype(np.float32) * np.array([[1e-30], [1e-3], [1.0], [3e4], [1e30], [1.0]],
                                                                    dtype=np.float32)
    x[5, 7] = 2.0**14  # exactly a power of two: the top of the range is excluded
    scales = np.array(reference_row_scales(mx.array(x)))
    mantissa, _ = np.frexp(scales)
    assert (mantissa == 0.5).all()  # powers of two: the scaling and its undoing are exact
    top = np.abs(x * scales[:, None]).max(axis=1)
    assert ((top >= 2.0**14) & (top < 2.0**15)).all(), top
    zero_inf = np.array(reference_row_scales(mx.array(np.array([[0.0, 0.0], [np.inf, 1.0]], np.float32))))
    assert zero_inf[0] > 0 and np.isinf(np.array([np.inf], np.float32) * zero_inf[1]).all()


# ---------------------------------------------------------------------------------------------------------------
# In emulation (slow)

CASES = {
    "skewed": ([0, 1, 30, 0, 6], 96, 256),  # N = 37: empty experts, a single pair, OUT below one column tile
    "beyond_a_tile": ([300, 0, 20], 200, 512),  # 5 (mma) / 3 (wgmma) row tiles for expert 0; 2 partial column tiles
    "one_expert": ([5], 8, 256),  # E = 1, OUT below a warp's 32 columns
    "many_experts": ([0, 3, 0, 0, 1, 7, 0, 2] * 5 + [70], 24, 256),  # 41 experts: two per lane in the scan
}
"""counts per expert, OUT, IN (a multiple of 256: whole blocks)."""


@pytest.mark.slow
@pytest.mark.parametrize("tk", [32, 64])
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES)
def test_emulated_kernel_equals_one_product_per_pair(on_cpu, run, ggml_type, case, tk):
    counts, n_out, n_in = CASES[case]
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=8)
    x = np.random.default_rng(9).standard_normal((ids.size, n_in)).astype(np.float32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in, tk=tk)
    assert np.isfinite(got).all()  # every output was written
    assert within(got, products(x, weights, ids), TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_gathers_the_rows_its_pairs_read(on_cpu, run, ggml_type):
    """With `rows`, pair i reads token rows[i] of x (T, IN), as gate and up read a chunk: tokens read by several
    pairs of different experts, in no order, some by none, each with its own row scale; equal to the products over
    x[rows]."""
    counts, n_out, n_in = [0, 30, 1, 140, 3], 40, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=16)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((50, n_in)).astype(np.float32) * rng.uniform(0.01, 100, (50, 1)).astype(np.float32)
    rows = rng.integers(0, 45, ids.size).astype(np.uint32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in, rows)
    assert got.shape == (ids.size, n_out) and np.isfinite(got).all()
    assert within(got, products(x[rows], weights, ids), TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_keeps_float32_accuracy_at_any_row_scale(on_cpu, run, ggml_type):
    """Rows of very different sizes (1e-30 to 1e30, within float32's normal range: a half without the row scaling
    would overflow or flush them) and rows mixing magnitudes 2^20 apart: each row within TOLERANCE of its own
    largest output."""
    counts, n_out, n_in = [6, 4], 40, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=14)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((ids.size, n_in)).astype(np.float32)
    x *= np.array([1e-30, 1e-8, 1.0, 1e8, 1e30, 1.0, 1.0, 1e-3, 1e3, 1.0], np.float32)[:, None]
    x[[5, 6], ::2] *= 2.0**-20  # mixed rows: half their values 2^20 below the rest
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    want = products(x, weights, ids)
    assert np.isfinite(got).all()
    row_error = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert (row_error <= TOLERANCE).all(), row_error


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_decodes_every_value_as_the_reference(on_cpu, run, ggml_type):
    """Pair i has x = the one-hot row of column k_i, so its outputs are W_e(i)[:, k_i]: the split carries one value
    exactly (to 2^-20 of itself here), a decoding mistake moves it by far more. Each of two experts reads every
    column once, shuffled (OUT 72: a partial column tile)."""
    counts, n_out, n_in = [256, 256], 72, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=10)
    rng = np.random.default_rng(11)
    columns = np.concatenate([rng.permutation(n_in), rng.permutation(n_in)])
    x = np.eye(n_in, dtype=np.float32)[columns]
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    want = weights[ids, :, columns]  # (N, OUT): pair i's column of its expert
    assert (np.abs(got - want) <= 2.0**-20 * np.abs(want)).all()


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_at_flash_k(on_cpu, run, ggml_type):
    """At Flash's K (IQ2_XXS gate / up 4096, Q2_K down 2048): within TOLERANCE / 10 of the float64 products (the
    tensor cores' truncation drained once a stage of 64 values, the scales finer than a block in the tile).
    Two experts, 70 pairs, 24 outputs (~30 s on 2 cores for mma)."""
    counts, n_out, n_in = [40, 30], 24, FLASH_SHAPES[ggml_type][1]
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=12)
    x = np.random.default_rng(13).standard_normal((ids.size, n_in)).astype(np.float32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    assert np.isfinite(got).all()
    assert within(got, products(x, weights, ids), TOLERANCE / 10)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.cuda
def test_raw_kernels_pass_their_checks_on_the_gpu(on_cuda):
    """Both kernels pass their first-use checks on the H200 (compute capability 9.0: wgmma's too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grouped_wgmma.fits(4096)
        for ggml_type in RAW_TYPES:
            assert RAW_GROUPED[ggml_type].direct.enabled(FLASH_SHAPES[ggml_type])
            assert RAW_GROUPED[ggml_type].wgmma.enabled(FLASH_SHAPES[ggml_type])


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "skewed"])
def test_raw_kernel_equals_the_reference_at_flash_size_without_a_scratch(on_cuda, name, ggml_type, case):
    """12,288 pairs of 256 Flash experts, reading 2048 tokens' rows by index as gate and up do: within TOLERANCE of
    the scratch path's reference (`sliced_reference`), the call allocates no bank-sized scratch (the scratch path's
    float32 bank alone is 8 GiB: its peak above the inputs stays under 1 GiB), and RAW_GROUPED takes the wgmma
    kernel on the H200."""
    n_out, n_in = FLASH_SHAPES[ggml_type]
    shape = (256, n_out, n_in)
    ids = flash_routing(case)
    sorted_ids = mx.array(ids)
    counts = mx.array(np.bincount(ids, minlength=256).astype(np.uint32))
    blocks = random_blocks(ggml_type, 256 * n_out, n_in, seed=64).reshape(256, -1)
    x = random_activations((2048, n_in), seed=65)
    rows = mx.array((np.random.default_rng(66).permutation(ids.size) % 2048).astype(np.uint32))
    mx.eval(sorted_ids, counts, blocks, x, rows)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    got = KERNELS[name](x, blocks, counts, ggml_type, shape, rows)
    mx.eval(got)
    assert mx.get_peak_memory() - before <= 1 << 30
    want = sliced_reference(x[rows], blocks, sorted_ids, ggml_type, shape)
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
    if name == "wgmma":
        assert (RAW_GROUPED[ggml_type](x, blocks, sorted_ids, counts, shape, rows) == got).all().item()


@pytest.mark.slow
def test_emulated_split_kernel_equals_the_reference(on_cpu, monkeypatch, tmp_path):
    """The one-pass split (the scale, then both half pairs of every pair of values) is the reference's bit for bit
    on its probe, and on the probe with an infinity as halves and scales (rows from 1e-30 to 1e30, a zero row; the
    infinity's residue a NaN either way, whatever its bits), at a width that is not a multiple of its threads too;
    hi + lo holds each scaled value to ~2^-22 where lo stays normal."""
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))
    for key in (4096, 300):
        (x,) = halfsplit._split_probe(key)
        for g, w in zip(halfsplit._kernel_split_rows(x), halfsplit.reference_split_rows(x)):
            assert registry.disagreement(g, w, 0.0) is None
        (x,) = halfsplit._probe(key)
        got, want = halfsplit._kernel_split_rows(x), halfsplit.reference_split_rows(x)
        for g, w in zip(got[:2], want[:2]):
            assert registry.disagreement(g.view(mx.float16), w.view(mx.float16), 0.0) is None
        assert registry.disagreement(got[2], want[2], 0.0) is None
        hi, lo, scale = (np.array(a) for a in got)
        scaled = np.array(x, np.float64) * scale[:, None]
        rebuilt = hi.view(np.float16).astype(np.float64) + lo.view(np.float16)
        rows = [1, 2, 3, 4]  # rows whose values stay normal halves after scaling
        assert (np.abs(rebuilt - scaled)[rows] <= 2.0**-22 * np.abs(scaled[rows]).max(axis=1, keepdims=True)).all()


def test_the_two_group_kernels_carry_launch_bounds_on_cuda_only():
    """GROUPS = 2 asks the compiler for 128 registers a thread (two threadgroups of 256 an SM) through the cached
    route's text; the one-group kernels have no bounds; Metal gets none."""
    from ds4_mlx.kernels.machinery import nvrtc
    from ds4_mlx.kernels.machinery.dialect import METAL

    for ggml_type in RAW_TYPES:
        two = rendered(kernel(ggml_type, 2), CUDA)
        assert two["launch_bounds"] == (256, 2) and "launch_bounds" not in rendered(kernel(ggml_type, 1), CUDA)
        assert "launch_bounds" not in rendered(kernel(ggml_type, 2), METAL)
        text = nvrtc.kernel_text("f", two["header"], two["source"], [("x", mx.float32)], [("y", mx.float32)], [],
                                 two["launch_bounds"])
        assert "__global__ void __launch_bounds__(256, 2) f(" in text


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_at_a_deeper_pipeline(on_cpu, ggml_type, monkeypatch, tmp_path):
    """Three stages of x in flight (STAGES is the default): the same products, K of more stages than that."""
    monkeypatch.setattr(grouped_raw, "build", emulated_build(tmp_path))
    counts, n_out, n_in = [3, 0, 70], 40, 512
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=12)
    x = np.random.default_rng(13).standard_normal((ids.size, n_in)).astype(np.float32)
    shape = (len(counts), n_out, n_in)
    got = np.array(raw_grouped_gemm(mx.array(x), blocks, mx.array(np.array(counts, np.uint32)), ggml_type, shape,
                                    stages=3))
    assert within(got, products(x, weights, ids), TOLERANCE)
