"""Routed experts from raw IQ2_XXS / Q2_K banks by warpgroup products (kernels/tensor_cores/grouped_wgmma.py, Hopper's
wgmma).

test_kernels_grouped_raw.py's emulated checks (one float64 product per pair within TOLERANCE for odd routings,
gathered rows, rows of any size, Flash's K, every value decoded as the reference) run this kernel as well as
grouped_raw.py's. Here: its rendering, where it is taken, its plans agreeing (in emulation: emulated_cuda.py's
wgmma reads B as the descriptor lays it out). Its gpu tests (first-use checks, Flash-size products, RawGrouped
taking it on the H200) are test_kernels_grouped_raw.py's, beside grouped_raw.py's.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.tensor_cores import grouped_wgmma, halfsplit
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.prefill.batch import TOLERANCE
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL
from ds4_mlx.kernels.prefill.grouped import RAW_GROUPED
from ds4_mlx.kernels.tensor_cores.grouped_gemm import row_tiles
from ds4_mlx.kernels.tensor_cores.grouped_wgmma import STAGES, TM, W_SLOTS, kernel, slot_rows, wgmma_grouped_gemm
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_grouped_gemm import products, within
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
    assert out["input_names"] == ["xhi", "xlo", "w", "counts", "dims", "xscale", "xrow", "shi", "slo"]
    assert_renders_cleanly(out)
    assert not any(name in k.source for name in ("W_LOAD", "W_DECODE", "W_SETUP", "W_SHARED", "W_AFTER"))
    assert "wgmma.mma_async" not in METAL.prelude
    assert RAW_GROUPED[ggml_type].wgmma.backends == ("cuda",)
    # STAGES B tiles of two planes and W_SLOTS blocks of 192 W rows, dynamic; one threadgroup of 384 threads an SM
    w_words = grouped_wgmma.W_WORDS[ggml_type]
    assert 4 * w_words >= {GGMLType.IQ2_XXS: 66 + 2, GGMLType.Q2_K: 84}[ggml_type]
    assert k.shared_memory == 4 * (STAGES * TM * grouped_wgmma.TK + W_SLOTS * 192 * w_words) <= 227 * 1024
    assert k.launch_bounds == (384, 1)
    # MINS = 1 adds each slot's group sums: two planes of 128 x 16 halves
    assert kernel(ggml_type, mins=1).shared_memory == k.shared_memory + 4 * W_SLOTS * 2 * TM * 8 <= 227 * 1024


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
# In emulation (slow): test_kernels_grouped_raw.py runs its products, routings, row scales and decoding checks on
# this kernel too; here its plans


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", RAW_TYPES, ids=lambda t: t.name)
def test_emulated_plans_agree(on_cpu, emulated, ggml_type):
    """Two warpgroups and four stages give the default's values bit for bit; stages of 32 (drained twice as often)
    and, for Q2_K, the mins as a second product each stage (MINS = 0) the products within TOLERANCE: gathered
    pairs, an expert past one 128-pair tile, a partial warpgroup of W rows, K of more W blocks than slots."""
    counts, n_out, n_in = [0, 30, 1, 140, 3], 72, 1024
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=16)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((50, n_in)).astype(np.float32)
    rows = rng.integers(0, 45, ids.size).astype(np.uint32)
    got = run(ggml_type, x, blocks, counts, n_out, n_in, rows)
    assert within(got, products(x[rows], weights, ids), TOLERANCE)
    assert (run(ggml_type, x, blocks, counts, n_out, n_in, rows, warpgroups=2) == got).all()
    assert (run(ggml_type, x, blocks, counts, n_out, n_in, rows, stages=4) == got).all()
    if ggml_type == GGMLType.Q2_K:
        assert within(run(ggml_type, x, blocks, counts, n_out, n_in, rows, mins=0), products(x[rows], weights, ids),
                      TOLERANCE)
    assert within(run(ggml_type, x, blocks, counts, n_out, n_in, rows, tk=32), products(x[rows], weights, ids),
                  TOLERANCE)


def test_slot_rows_lay_each_experts_pairs_in_whole_tiles():
    """`slot_rows`: the experts in order, each one's pairs in tiles of TM of their own (the GEMMs' row-tile scan),
    pair p reading rows[p] (or row p); slots past an expert's last pair, and tiles past the last expert's, hold no
    row (N)."""
    counts, n_rows = [3, 0, 140, 9], 40
    rows = np.random.default_rng(5).integers(0, n_rows, sum(counts))
    n_tiles = row_tiles(sum(counts), len(counts), TM)
    want, pair = [], 0
    for c in counts:
        for start in range(0, c, TM):
            want += [rows[pair + start + n] if start + n < c else n_rows for n in range(TM)]
        pair += c
    want += [n_rows] * (n_tiles * TM - len(want))
    got = slot_rows(mx.array(np.array(counts, np.uint32)), mx.array(rows.astype(np.uint32)), n_tiles, n_rows)
    assert np.array(got).tolist() == [int(v) for v in want]
    plain = slot_rows(mx.array(np.array(counts, np.uint32)), None, n_tiles, sum(counts))
    assert np.array(plain)[:TM].tolist() == [0, 1, 2] + [sum(counts)] * (TM - 3)


@pytest.mark.slow
def test_emulated_slot_split_equals_the_reference(on_cpu, emulated):
    """The pairs' split into their tiles (`split_slots`'s kernel) is the reference's bit for bit in every tile the
    GEMMs read, gathered (rows of sizes 1e-4 to 1e4, each read by three or four pairs) or not."""
    x, counts, rows, n_tiles = grouped_wgmma._slots_probe(64)
    wide = mx.array(np.random.default_rng(9).standard_normal((30, 1056)).astype(np.float32))  # 33 groups a row
    for args in ((x, counts, rows, n_tiles), (x[:30], mx.array([0, 17, 13], dtype=mx.uint32), None, 4),
                 (wide, mx.array([17, 13], dtype=mx.uint32), None, 3)):
        got, want = grouped_wgmma._slots_checked(*args), grouped_wgmma.reference_split_slots(*args)
        for g, w in zip(got, want, strict=True):
            assert registry.disagreement(g, w, 0.0) is None


def test_emulated_group_sums_are_each_groups_sum(on_cpu, emulated):
    """`group_sums` (four lanes a group of 16, a warp 512 contiguous bytes): word p of a row holds groups 2 p (low
    halves) and 2 p + 1 (high) of the scaled row, / 16, as hi + lo halves to ~2^-22 of the sum; three rows of 256
    (24 words: a partial threadgroup), scales powers of two."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    scales = np.array([2.0**10, 1.0, 2.0**-3], np.float32)
    hi, lo = (np.array(a).view(np.float16).astype(np.float64).reshape(3, 8, 2)
              for a in grouped_wgmma.group_sums(mx.array(x), mx.array(scales)))
    want = (x.astype(np.float64) * scales[:, None]).reshape(3, 8, 2, 16).sum(axis=-1) / 16
    assert np.abs(hi + lo - want).max() <= 2.0**-20 * np.abs(want).max()


@pytest.mark.slow
def test_emulated_q2_k_mins_from_group_sums(on_cpu, emulated):
    """MINS = 1 (Q2_K's mins as one product a block over the tile's group sums of x): within TOLERANCE / 10 of the
    float64 products at Flash's K (2048), and each row within TOLERANCE of its own largest output for rows from
    1e-30 to 1e30 and rows mixing magnitudes 2^20 apart (the sums are of the split's scaled rows, / 16 into a
    half's range)."""
    ggml_type = GGMLType.Q2_K
    counts, n_out, n_in = [40, 30], 24, 2048
    blocks, weights, ids = bank(ggml_type, counts, n_out, n_in, seed=12)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((ids.size, n_in)).astype(np.float32)
    assert within(run(ggml_type, x, blocks, counts, n_out, n_in, mins=1), products(x, weights, ids), TOLERANCE / 10)
    x[:10] *= np.array([1e-30, 1e-8, 1.0, 1e8, 1e30, 1.0, 1.0, 1e-3, 1e3, 1.0], np.float32)[:, None]
    x[[5, 6], ::2] *= 2.0**-20
    got, want = run(ggml_type, x, blocks, counts, n_out, n_in, mins=1), products(x, weights, ids)
    assert np.isfinite(got).all()
    assert (np.abs(got - want).max(axis=1) <= TOLERANCE * np.abs(want).max(axis=1)).all()
