"""Routed experts from raw IQ2_XXS / Q2_K banks by warpgroup products (kernels/grouped_wgmma.py, Hopper's wgmma).

The kernel must equal one float64 product per pair over the reference dequantizer's weights within float32
reassociation (TOLERANCE), for odd routings (unused experts, a single pair, an expert past one 128-pair tile, many
experts), with pairs reading token rows by index, rows of any size, and Flash's K; and its decoding must be the
reference's values exactly (one-hot rows: each output one weight). Without a GPU the CUDA text runs in emulation
(emulated_cuda.py, whose wgmma reads B as the descriptor lays it out); gpu-marked tests check the device at Flash
size.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels import grouped_wgmma, halfsplit, registry
from ds4_mlx.kernels.batch import TOLERANCE
from ds4_mlx.kernels.dialect import CUDA, METAL
from ds4_mlx.kernels.grouped import RAW_GROUPED, sliced_reference
from ds4_mlx.kernels.grouped_wgmma import STAGES, TM, W_SLOTS, kernel, wgmma_grouped_gemm
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_grouped_gemm import flash_routing, products, within
from test_kernels_grouped_raw import FLASH_SHAPES, RAW_TYPES, bank

pytestmark = pytest.mark.usefixtures("kernels_unforced")


def run(ggml_type: GGMLType, x: np.ndarray, blocks: mx.array, counts: list[int], n_out: int, n_in: int,
        rows: np.ndarray | None = None, **plan: int) -> np.ndarray:
    return np.array(wgmma_grouped_gemm(mx.array(x), blocks, mx.array(np.array(counts, np.uint32)), ggml_type,
                                       (len(counts), n_out, n_in), None if rows is None else mx.array(rows), **plan))


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    """The kernel and the split it reads x from, both in emulation."""
    monkeypatch.setattr(grouped_wgmma, "build", emulated_build(tmp_path))
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))


# ---------------------------------------------------------------------------------------------------------------
# On the CPU

@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_kernels_render_for_cuda_only(ggml_type):
    k = kernel(ggml_type)
    out = rendered(k, CUDA)
    assert out["input_names"] == ["xhi", "xlo", "w", "counts", "dims", "xscale", "xrow"]
    assert_renders_cleanly(out)
    assert not any(name in k.source for name in ("W_LOAD", "W_DECODE", "W_SETUP", "W_SHARED", "W_AFTER"))
    assert "wgmma.mma_async" not in METAL.prelude
    assert RAW_GROUPED[ggml_type].wgmma.backends == ("cuda",)
    # STAGES B tiles of two planes and W_SLOTS blocks of 192 W rows, dynamic; one threadgroup of 384 threads an SM
    w_words = grouped_wgmma.W_WORDS[ggml_type]
    assert 4 * w_words >= {GGMLType.IQ2_XXS: 66 + 2, GGMLType.Q2_K: 84}[ggml_type]
    assert k.shared_memory == 4 * (STAGES * TM * grouped_wgmma.TK + W_SLOTS * 192 * w_words) <= 227 * 1024
    assert k.launch_bounds == (384, 1)


def test_the_cpu_keeps_the_reference_and_cuda_plans_the_kernel(on_cpu):
    """Off Hopper the kernel is not tried (no warning); planned for CUDA, RAW_GROUPED takes it first."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not grouped_wgmma.fits(4096)
    with registry.planning("cuda"):
        assert grouped_wgmma.fits(4096) and not grouped_wgmma.fits(4096 + 32)
        for ggml_type in RAW_TYPES:
            assert RAW_GROUPED[ggml_type].wgmma.enabled(FLASH_SHAPES[ggml_type])
    with registry.planning("metal"):
        assert not grouped_wgmma.fits(4096)


# ---------------------------------------------------------------------------------------------------------------
# In emulation (slow)

CASES = {
    "skewed": ([0, 1, 30, 0, 6], 96, 256),  # N = 37: empty experts, a single pair, OUT below one warpgroup's rows
    "beyond_a_tile": ([300, 0, 20], 200, 512),  # 3 row tiles for expert 0; 2 column tiles (the second partial)
    "one_expert": ([5], 8, 256),  # E = 1, OUT below a warp's 16 rows
    "many_experts": ([0, 3, 0, 0, 1, 7, 0, 2] * 5 + [70], 24, 256),  # 41 experts: two per lane in the scan
}
"""counts per expert, OUT, IN (a multiple of 256: whole blocks)."""


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES)
def test_emulated_kernel_equals_one_product_per_pair(on_cpu, emulated, ggml_type, case):
    counts, n_out, n_in = CASES[case]
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=8)
    x = np.random.default_rng(9).standard_normal((ids.size, n_in)).astype(np.float32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    assert np.isfinite(got).all()  # every output was written
    assert within(got, products(x, weights, ids), TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_gathers_the_rows_its_pairs_read(on_cpu, emulated, ggml_type):
    """With `rows`, pair i reads token rows[i] of x (T, IN), as gate and up read a chunk: tokens read by several
    pairs of different experts, in no order, some by none, each token's own row scale; two warpgroups and four
    stages give the default's values bit for bit, stages of 32 (drained twice as often) within TOLERANCE."""
    counts, n_out, n_in = [0, 30, 1, 140, 3], 72, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=16)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((50, n_in)).astype(np.float32) * rng.uniform(0.01, 100, (50, 1)).astype(np.float32)
    rows = rng.integers(0, 45, ids.size).astype(np.uint32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in, rows)
    assert got.shape == (ids.size, n_out) and np.isfinite(got).all()
    assert within(got, products(x[rows], weights, ids), TOLERANCE)
    assert (run(ggml_type, x, blocks, counts, n_out, n_in, rows, warpgroups=2) == got).all()
    assert (run(ggml_type, x, blocks, counts, n_out, n_in, rows, stages=4) == got).all()
    assert within(run(ggml_type, x, blocks, counts, n_out, n_in, rows, tk=32), products(x[rows], weights, ids),
                  TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_keeps_float32_accuracy_at_any_row_scale(on_cpu, emulated, ggml_type):
    """Rows from 1e-30 to 1e30 and rows mixing magnitudes 2^20 apart: each within TOLERANCE of its own largest
    output (Q2_K's mins, a second product drained with -dmin, cancel against the first)."""
    counts, n_out, n_in = [6, 4], 40, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=14)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((ids.size, n_in)).astype(np.float32)
    x *= np.array([1e-30, 1e-8, 1.0, 1e8, 1e30, 1.0, 1.0, 1e-3, 1e3, 1.0], np.float32)[:, None]
    x[[5, 6], ::2] *= 2.0**-20
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    want = products(x, weights, ids)
    assert np.isfinite(got).all()
    row_error = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert (row_error <= TOLERANCE).all(), row_error


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_decodes_every_value_as_the_reference(on_cpu, emulated, ggml_type):
    """Pair i has x = the one-hot row of column k_i, so its outputs are W_e(i)[:, k_i] (a wrong grid entry, sign,
    scale, min or quant moves one by far more than 2^-20 of itself): each of two experts reads every column once,
    shuffled, in tiles of 128 pairs (OUT 72: a partial warpgroup)."""
    counts, n_out, n_in = [256, 256], 72, 256
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=10)
    rng = np.random.default_rng(11)
    columns = np.concatenate([rng.permutation(n_in), rng.permutation(n_in)])
    x = np.eye(n_in, dtype=np.float32)[columns]
    got = run(ggml_type, x, blocks, counts, n_out, n_in)
    want = weights[ids, :, columns]
    assert (np.abs(got - want) <= 2.0**-20 * np.abs(want)).all()


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_at_flash_k(on_cpu, emulated, ggml_type):
    """At Flash's K (gate / up 4096, down 2048): within TOLERANCE / 10 of the float64 products (each stage's
    truncated partial sums at most four products deep)."""
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
def test_wgmma_kernels_pass_their_checks_on_the_h200(on_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grouped_wgmma.fits(4096)
        for ggml_type in RAW_TYPES:
            assert RAW_GROUPED[ggml_type].wgmma.enabled(FLASH_SHAPES[ggml_type])


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ["random", "skewed"])
def test_wgmma_kernel_equals_the_reference_at_flash_size(on_cuda, ggml_type, case):
    """12,288 pairs of 256 Flash experts (gate / up reading 2048 tokens by index): within TOLERANCE of
    `sliced_reference`, and RAW_GROUPED takes this kernel."""
    n_out, n_in = FLASH_SHAPES[ggml_type]
    shape = (256, n_out, n_in)
    ids = flash_routing(case)
    sorted_ids = mx.array(ids)
    counts = mx.array(np.bincount(ids, minlength=256).astype(np.uint32))
    blocks = random_blocks(ggml_type, 256 * n_out, n_in, seed=64).reshape(256, -1)
    x = random_activations((2048, n_in), seed=65)
    rows = mx.array((np.random.default_rng(66).permutation(ids.size) % 2048).astype(np.uint32))
    got = wgmma_grouped_gemm(x, blocks, counts, ggml_type, shape, rows)
    want = sliced_reference(x[rows], blocks, sorted_ids, ggml_type, shape)
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
    assert (RAW_GROUPED[ggml_type](x, blocks, sorted_ids, counts, shape, rows) == got).all().item()
