"""The float16 tensor-core dense projection of affine weights (kernels/tensor_cores/dense_f16.py).

Without a GPU the kernel runs in emulation (emulated_cuda.py: its f16 mma truncates its sums as the tensor cores do;
the fragment layout is what test_kernels_grouped_raw.py's one-hot decoding test pins down). The kernel must equal
x @ W.T in float64 within batch.py's float32 bound (TOLERANCE) for odd shapes, both quant widths, a batch of
matrices and rows of any size, and at Flash's K with room to spare; on CUDA batch_matmul takes it first.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.prefill import batch
from ds4_mlx.kernels.tensor_cores import dense_f16, dense_wgmma, halfsplit
from ds4_mlx.kernels.decode import half
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.prefill.batch import TOLERANCE, batch_matmul
from ds4_mlx.kernels.tensor_cores.dense_f16 import (DENSE_F16, HALF_BATCH, STAGES, THREADS, TK, TM, f16_affine_matmul,
                                       half_matmul)
from ds4_mlx.kernels.tensor_cores.dense_wgmma import DENSE_WGMMA
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL
from ds4_mlx.kernels.tensor_cores.halfsplit import BLOCK_ROWS, reference_row_scales, reference_split_blocks, to_blocks
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import dequantize, reference_matmul
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered

pytestmark = pytest.mark.usefixtures("kernels_unforced")

TYPES = (GGMLType.Q8_0, GGMLType.Q4_K)


def case(ggml_type: GGMLType, shape: tuple[int, ...], rows: int, seed: int
         ) -> tuple[mx.array, mx.array, np.ndarray]:
    """(x, raw blocks, x @ W.T in float64) for a W of `shape` (OUT, IN) or (G, OUT, IN), and x (rows, IN) or
    (G, rows, IN)."""
    lead, (n_out, n_in) = shape[:-2], shape[-2:]
    blocks = random_blocks(ggml_type, int(np.prod(lead, dtype=int)) * n_out, n_in, seed=seed)
    x = random_activations((*lead, rows, n_in), seed=seed + 1)
    w = np.array(dequantize(blocks, ggml_type, shape)).astype(np.float64)
    return x, blocks, np.array(x).astype(np.float64) @ np.swapaxes(w, -1, -2)


def within(got: np.ndarray, want: np.ndarray, bound: float) -> bool:
    return bool(np.abs(got - want).max() <= bound * np.abs(want).max())


def test_q8_0_quants_centred_need_no_offset():
    """Q8_0's affine bias is -128 * scale, so c = bias + 128 * scale is exactly 0: the kernel's row-sum term is
    left out there, and the product is scale times an exact sum of x times int8 quants."""
    blocks = random_blocks(GGMLType.Q8_0, 64, 512, seed=1)
    weight = to_affine(blocks, GGMLType.Q8_0, (64, 512))
    assert (np.array(weight.biases) + 128 * np.array(weight.scales) == 0).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_the_cpu_keeps_its_batch_products(on_cpu, ggml_type):
    """On the CPU the kernel is not used and batch_matmul is the quantized matmul it was, value for value."""
    x, blocks, _ = case(ggml_type, (48, 256), 20, seed=2)
    weight = to_affine(blocks, ggml_type, (48, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not DENSE_F16.enabled(ggml_type)
        got = batch_matmul(x, weight)
    assert (got == weight.matmul(x)).all().item()


def test_one_half_of_x_would_not_do():
    """Why x is split: x rounded to one half (after its row scaling) moves a Flash-K product by more than the
    float32 bound; hi + lo stays well inside it (computed here in float64, as the tensor cores' exact products)."""
    x, blocks, want = case(GGMLType.Q8_0, (24, 4096), 20, seed=4)
    w = np.array(dequantize(blocks, GGMLType.Q8_0, (24, 4096))).astype(np.float64)
    scale = np.array(reference_row_scales(x))[:, None].astype(np.float64)
    xs = np.array(x).astype(np.float64) * scale
    hi = xs.astype(np.float16).astype(np.float64)
    lo = (xs - hi).astype(np.float16).astype(np.float64)
    assert not within((hi / scale) @ w.T, want, TOLERANCE)
    assert within(((hi + lo) / scale) @ w.T, want, TOLERANCE / 100)


def test_blocks_hold_each_lane_s_fragment_as_one_word():
    """`to_blocks`: lane 4 g + t's 16-byte word of block B, group s, k-step kk is mma.m16n8k16's A fragment for
    rows g and g + 8 of the block (a0 a1: word 4 t + 2 kk of both rows; a2 a3: the next word), every batch's rows
    padded with zeros to whole blocks."""
    n_batch, rows, words = 3, 19, 32  # 19 rows: a block and a partial one per batch; IN = 64, two groups
    x = np.random.default_rng(7).integers(1, 2**32, (n_batch * rows, words), dtype=np.uint32)
    got = np.array(to_blocks(mx.array(x), n_batch)).reshape(n_batch, 2, words // 16, 2, 32, 4)
    src = np.zeros((n_batch, 2 * BLOCK_ROWS, words), np.uint32)
    src[:, :rows] = x.reshape(n_batch, rows, words)
    for b in range(n_batch):
        for block in range(2):
            for s in range(words // 16):
                for kk in range(2):
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        row = src[b, 16 * block + g], src[b, 16 * block + g + 8]
                        word = 16 * s + 4 * t + 2 * kk
                        want = [row[0][word], row[1][word], row[0][word + 1], row[1][word + 1]]
                        assert list(got[b, block, s, kk, lane]) == want


def test_an_input_several_projections_read_is_split_once(on_cpu):
    """Within splits_held, held_split hands back the split it made for the same array (a layer's projections of one
    input), makes a new one for another array, batching or layout, holds only the last SPLITS_HELD of a layout,
    and equals the split it stands for; outside it, nothing is held."""
    xs = [random_activations((20, 64), seed=s) for s in (3, 4, 5)]
    with halfsplit.splits_held():
        first = halfsplit.held_split(xs[0], 1)
        assert halfsplit.held_split(xs[0], 1) is first
        assert halfsplit.held_split(xs[0], 2) is not first
        rows = halfsplit.held_split(xs[0])
        assert rows is not first and halfsplit.held_split(xs[0]) is rows
        for got, want in zip(first + rows, halfsplit.split_blocks(xs[0], 1) + halfsplit.split_rows(xs[0]),
                             strict=True):
            assert mx.array_equal(got, want)
        for x in xs[1:]:
            halfsplit.held_split(x, 1)
        assert len(halfsplit._held["blocks"]) == halfsplit.SPLITS_HELD and halfsplit.held_split(xs[0], 1) is not first
    assert halfsplit._held is None and halfsplit.held_split(xs[0]) is not halfsplit.held_split(xs[0])


def test_the_pairs_split_is_held_for_the_same_rows_and_counts(on_cpu):
    """`held` (grouped_wgmma.py's split of a layer's pairs: gate and up read one, down another) hands back what it
    made only for the same objects, every one of them (x, the counts, the rows, None alike) and the same key; the
    tiles layout keys on the batching and interleaving too."""
    x, counts, rows = random_activations((20, 64), seed=6), mx.array([3, 17]), mx.arange(20)
    made = []

    def make():
        made.append(object())
        return (made[-1],)

    with halfsplit.splits_held():
        first = halfsplit.held("slots", (x, counts, rows), 4, make)
        assert halfsplit.held("slots", (x, counts, rows), 4, make) is first
        assert halfsplit.held("slots", (x, mx.array([3, 17]), rows), 4, make) is not first  # equal, not the same
        assert halfsplit.held("slots", (x, counts, None), 4, make) is not first
        assert halfsplit.held("slots", (x, counts, rows), 5, make) is not first
        assert len(made) == 4
        tiles = halfsplit.held_split(x, layout="tiles")
        assert halfsplit.held_split(x, layout="tiles") is tiles
        assert halfsplit.held_split(x, 2, layout="tiles") is not tiles
        batch = halfsplit.held_split(x, 2, layout="tiles")
        assert halfsplit.held_split(x, 2, layout="tiles", interleaved=True) is not batch


@pytest.mark.slow
def test_emulated_split_into_blocks_equals_the_reference(on_cpu, monkeypatch, tmp_path):
    """The split kernel writing the fragment layout is the reference's bit for bit: rows from 1e-30 to 1e30 and a
    zero row, one batch or several whose rows end inside a block, at a width of three groups."""
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))
    (x,) = halfsplit._split_probe(96)
    for rows, n_batch in ((8, 1), (4, 2), (21, 3)):
        xs = mx.concatenate([x] * 8)[: rows * n_batch]
        got, want = halfsplit._kernel_split_blocks(xs, n_batch), reference_split_blocks(xs, n_batch)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and registry.disagreement(g, w, 0.0) is None


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_kernel_renders_for_cuda_only(bits):
    kernel = dense_f16.kernel(bits)
    out = rendered(kernel, CUDA)
    assert out["input_names"] == ["xhi", "xlo", "wq", "scales", "biases", "dims", "xscale"]
    assert out["output_names"] == ["y"]
    assert_renders_cleanly(out)
    assert not re.search(r"\bds4_mma_f16_16x8x16\(", METAL.prelude)
    assert DENSE_F16.backends == ("cuda",)
    # the stages in dynamic threadgroup memory, within what an H200 SM gives one threadgroup (227 KB)
    assert kernel.shared_memory == 4 * STAGES * dense_f16.stage_words(bits) <= 227 * 1024 and TK == 32
    assert "extern __shared__ __align__(16) float ds4_shared[];" in CUDA.header(kernel)
    # the copies: whole 16-byte words of x rows (TK / 8 a row) and of quant rows, from every thread
    assert THREADS == 256 and (TM * TK // 8) % THREADS == 0 and TK * bits % 128 == 0
    assert dense_f16.TOLERANCE == batch.TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("stages", [3, 4])
def test_emulated_kernel_at_every_pipeline_depth(on_cpu, stages, monkeypatch, tmp_path):
    """Three and four stages in flight (STAGES is the default): the same product, K of more groups than stages."""
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    x, blocks, want = case(GGMLType.Q8_0, (136, 256), 21, seed=9)
    got = np.array(f16_affine_matmul(x, to_affine(blocks, GGMLType.Q8_0, (136, 256)), stages=stages))
    assert within(got, want, TOLERANCE)


CASES = {
    "q8_two_column_tiles": (GGMLType.Q8_0, (200, 96), 37),  # odd T below a row tile, OUT past one column tile
    "q8_two_row_tiles": (GGMLType.Q8_0, (24, 64), 150),  # T past one row tile, OUT below one mma column block
    "q8_one_group": (GGMLType.Q8_0, (8, 32), 17),  # IN of one group: a single K step
    "q4": (GGMLType.Q4_K, (136, 256), 21),  # 4-bit quants, nonzero c; OUT just past a column tile
    "q8_batch": (GGMLType.Q8_0, (3, 40, 64), 19),  # a batch of matrices, as the grouped output projection
}
"""ggml type, W shape, rows of x."""
FLASH_SHAPES = {
    "q_a": (1024, 4096),
    "q_b": (32768, 1024),
    "out_a": (8, 1024, 4096),  # the grouped output projection: 8 groups against 8 slices of the heads
    "out_b": (4096, 8192),
}


def test_cuda_plans_the_f16_kernel_first():
    with registry.planning("cuda"):
        assert DENSE_F16.enabled(GGMLType.Q8_0)
    with registry.planning("metal"):
        assert not DENSE_F16.enabled(GGMLType.Q8_0)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_equals_the_product(on_cpu, name, monkeypatch, tmp_path):
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    ggml_type, shape, rows = CASES[name]
    x, blocks, want = case(ggml_type, shape, rows, seed=3)
    got = np.array(f16_affine_matmul(x, to_affine(blocks, ggml_type, shape)))
    assert got.shape == want.shape and np.isfinite(got).all()  # every output was written
    assert within(got, want, TOLERANCE)
    reference = np.array(reference_matmul(x, blocks, ggml_type, shape))
    assert within(got, reference, TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_emulated_kernel_keeps_float32_accuracy_at_any_row_scale(on_cpu, ggml_type, monkeypatch, tmp_path):
    """Rows from 1e-30 to 1e30 (float16 alone would flush or overflow them) and rows mixing magnitudes 2^20 apart,
    in a batch of two matrices: each row within TOLERANCE of its own largest output."""
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    shape = (2, 24, 256)
    x, blocks, _ = case(ggml_type, shape, 6, seed=5)
    sizes = np.array([[1e-30, 1e-8, 1.0, 1e8, 1e30, 1.0], [1.0, 1e3, 1e-3, 1.0, 1e-20, 1e20]], np.float32)
    x = np.array(x) * sizes[..., None]
    x[:, [0, 3], ::2] *= 2.0**-20
    w = np.array(to_affine(blocks, ggml_type, shape).dequantize()).astype(np.float64)
    want = x.astype(np.float64) @ np.swapaxes(w, -1, -2)
    got = np.array(f16_affine_matmul(mx.array(x), to_affine(blocks, ggml_type, shape)))
    assert np.isfinite(got).all()
    row_error = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert (row_error <= TOLERANCE).all(), row_error


@pytest.mark.slow
def test_emulated_kernel_at_flash_k(on_cpu, monkeypatch, tmp_path):
    """IN = 4096 (Flash's q_a, kv, shared expert IN): within TOLERANCE / 10 of the float64 product. 20 rows, 24
    outputs: one threadgroup, 128 K steps."""
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    shape = (24, 4096)
    x, blocks, want = case(GGMLType.Q8_0, shape, 20, seed=4)
    got = np.array(f16_affine_matmul(x, to_affine(blocks, GGMLType.Q8_0, shape)))
    assert np.isfinite(got).all()
    assert within(got, want, TOLERANCE / 10)


@pytest.mark.slow
def test_emulated_first_use_check_passes(on_cpu, monkeypatch, tmp_path):
    """The registry's probe (two column and row tiles, partial; a batch of three) through the emulated kernel, for
    Q4_K (a nonzero c)."""
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    args = dense_f16._probe(GGMLType.Q4_K)
    for got, want in zip(dense_f16._fast(*args), dense_f16._reference(*args), strict=True):
        assert registry.disagreement(got, want, TOLERANCE) is None


@pytest.mark.gpu
@pytest.mark.cuda
def test_dense_f16_passes_its_checks_on_the_gpu(on_cuda):
    for ggml_type in TYPES:
        assert DENSE_F16.enabled(ggml_type)


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", FLASH_SHAPES)
def test_dense_f16_equals_the_reference_at_flash_size(on_cuda, name):
    """A 2048-token chunk through Flash's Q8_0 projection shapes: within TOLERANCE of the reference, and
    batch_matmul on CUDA (float32) takes the kernel."""
    shape = FLASH_SHAPES[name]
    lead, (n_out, n_in) = shape[:-2], shape[-2:]
    blocks = random_blocks(GGMLType.Q8_0, int(np.prod(lead, dtype=int)) * n_out, n_in, seed=41)
    x = random_activations((*lead, 2048, n_in), seed=42)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    got = f16_affine_matmul(x, weight)
    want = reference_matmul(x, blocks, GGMLType.Q8_0, shape)
    assert got.shape == want.shape
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
    wgmma = dense_wgmma.fits(x, weight) and DENSE_WGMMA.enabled(GGMLType.Q8_0)  # Hopper's kernel first
    assert (batch_matmul(x, weight) == (dense_wgmma.wgmma_affine_matmul(x, weight) if wgmma else got)).all().item()


@pytest.mark.gpu
@pytest.mark.cuda
def test_dense_f16_q4_equals_the_reference_on_the_gpu(on_cuda):
    shape = (2048, 4096)
    blocks = random_blocks(GGMLType.Q4_K, *shape, seed=43)
    x = random_activations((777, 4096), seed=44)
    got = f16_affine_matmul(x, to_affine(blocks, GGMLType.Q4_K, shape))
    want = reference_matmul(x, blocks, GGMLType.Q4_K, shape)
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()


# ---------------------------------------------------------------------------------------------------------------
# F16 matrices (BITS = 16): a chunk's compressor, indexer and router projections

def half_case(n_out: int, n_in: int, rows: int, seed: int) -> tuple[mx.array, mx.array, np.ndarray]:
    """(x, W float16 with magnitudes down to subnormal halves, x @ W.T in float64)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_out, n_in)) * np.exp2(rng.uniform(-16, 0, (n_out, n_in)))).astype(np.float16)
    x = random_activations((rows, n_in), seed=seed + 1)
    return x, mx.array(w), np.array(x).astype(np.float64) @ w.astype(np.float64).T


def test_cuda_plans_the_half_batch_for_chunks_only():
    """A chunk's rows of an F16 projection take the tensor-core GEMM on CUDA; a decode token keeps the matvec
    kernel, and an IN that is not a multiple of 32 the reference."""
    x, w, _ = half_case(64, 256, 20, seed=6)
    with registry.planning("cuda"):
        assert half._batch(x, w) and not half._batch(x[:2], w)
        assert not half._batch(x[:, :48], w[:, :48])
    with registry.planning("metal"):
        assert not half._batch(x, w)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(200, 64, 150), (24, 4096, 20), (8, 32, 17)], ids=str)
def test_emulated_half_matmul_equals_the_product(on_cpu, shape, monkeypatch, tmp_path):
    """Two column and row tiles (both partial), Flash's IN (within TOLERANCE / 10), a single group."""
    monkeypatch.setattr(dense_f16, "build", emulated_build(tmp_path))
    n_out, n_in, rows = shape
    x, w, want = half_case(n_out, n_in, rows, seed=7)
    got = np.array(half_matmul(x, w))
    assert got.shape == want.shape and np.isfinite(got).all()
    assert within(got, want, TOLERANCE / 10 if n_in == 4096 else TOLERANCE)


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(512, 4096), (256, 4096), (8192, 1024)], ids=str)
def test_half_batch_equals_the_reference_on_the_gpu(on_cuda, shape):
    """Flash's F16 shapes (compressor kv, router gate, indexer q_b) at a 4096-token chunk: half_matvec takes the
    tensor-core GEMM, within TOLERANCE of x @ W.astype(float32).T."""
    x, w, _ = half_case(*shape, 4096, seed=8)
    got = half.half_matvec(x, w)
    assert HALF_BATCH.enabled(shape)
    want = x @ w.astype(mx.float32).T
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
    assert (got == dense_wgmma.half_product(x, w)).all().item()
