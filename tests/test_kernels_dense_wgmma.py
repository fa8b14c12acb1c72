"""The Q8_0 and F16 projections by warpgroup products (kernels/tensor_cores/dense_wgmma.py, Hopper's wgmma).

Without a GPU the kernel runs in emulation (emulated_cuda.py: the wgmma gathers the warpgroup's A fragments and reads
B from threadgroup memory as a K-major tile without swizzling lays it out, its sums truncated as the tensor cores
truncate them). What the emulation cannot show, that the GPU reads the descriptor as the emulation does, the gpu
tests check. The kernel must equal x @ W.T in float64 within batch.py's float32 bound (TOLERANCE): odd shapes, a
batch of matrices, Flash's K, rows of any size.
"""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.tensor_cores import dense_wgmma, halfsplit
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.prefill.batch import TOLERANCE, batch_matmul, grouped_rows_matmul
from ds4_mlx.kernels.tensor_cores.dense_f16 import HALF_BATCH
from ds4_mlx.kernels.tensor_cores.dense_wgmma import DENSE_WGMMA, HALF_WGMMA, LBO, SBO, STAGES, TM, WARPGROUPS
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL
from ds4_mlx.kernels.tensor_cores.halfsplit import (TILE_ROWS, TILE_WORDS, reference_split_rows, reference_split_tiles,
                                      to_tiles, transpose_groups)
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import reference_matmul
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_dense_f16 import FLASH_SHAPES, case, half_case, within

pytestmark = pytest.mark.usefixtures("kernels_unforced")


def test_transposed_groups_hold_each_core_matrix_row_as_one_run():
    """`transpose_groups`: 16-byte run a = 2 kk + c of a group holds words a, 4 + a, 8 + a, 12 + a, so that its
    position 2 t + e is value 8 t + 4 kk + 2 c + e of the group, the value that mma's A fragment position 2 t + e
    (c = 0) or 2 t + 8 + e (c = 1) of k-step kk carries in the W fragments' permutation of K."""
    values = np.arange(3 * 64, dtype=np.uint32).reshape(3, 64)  # value v of row r: 64 r + v, IN = 64
    words = mx.array((values[:, 0::2] | (values[:, 1::2] << 16)).astype(np.uint32))
    got = np.array(transpose_groups(words)).reshape(3, 2, 4, 4)  # (row, group, run, word of the run)
    for r in range(3):
        for s in range(2):
            for kk in range(2):
                for c in range(2):
                    for t in range(4):
                        for e in range(2):
                            value = (got[r, s, 2 * kk + c, t] >> (16 * e)) & 0xFFFF
                            assert value == 64 * r + 32 * s + 8 * t + 4 * kk + 2 * c + e


@pytest.mark.parametrize("interleaved", [False, True])
def test_tiles_hold_each_stage_plane_as_threadgroup_memory_holds_it(interleaved):
    """`to_tiles`: batch b's tile i, group s is one block of TILE_WORDS words in which row n's run kc (of the
    transposed layout) lies at ((n / 8) 4 + kc) 32 + (n % 8) 4, core matrix (n / 8, kc) of the kernel's B plane;
    rows past a batch's T are zeros; with `interleaved` batch b's row r is x's row r n_batch + b."""
    n_batch, rows, groups = 2, 150, 2  # two tiles a batch, the second partial
    words = mx.arange(n_batch * rows * 16 * groups, dtype=mx.uint32).reshape(n_batch * rows, 16 * groups) + 1
    runs = np.array(transpose_groups(words)).reshape(n_batch * rows, groups, 4, 4)
    tiles = np.array(to_tiles(words, n_batch, interleaved)).reshape(n_batch, 2, groups, 16, 4, 8, 4)
    assert tiles.shape[0] * tiles.shape[1] * TILE_WORDS * groups == tiles.size
    for b in range(n_batch):
        for r in range(2 * TILE_ROWS):
            i, n = divmod(r, TILE_ROWS)
            block = tiles[b, i, :, n // 8, :, n % 8, :]  # (group, kc, word)
            if r >= rows:
                assert (block == 0).all()
            else:
                assert (block == runs[r * n_batch + b if interleaved else b * rows + r]).all()


@pytest.mark.slow
@pytest.mark.parametrize("interleaved", [False, True])
def test_emulated_split_tiles_equals_the_reference(on_cpu, interleaved, monkeypatch, tmp_path):
    """The split kernel writing the tiles layout is the reference's bit for bit (rows from 1e-30 to 1e30, two
    batches each a partial tile, the padding zeros), the scales in x's row order."""
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))
    (x,) = halfsplit._split_probe(96)
    got = halfsplit._kernel_split_tiles(x, 2, interleaved)
    want = reference_split_tiles(x, 2, interleaved)
    assert got[0].shape == (2 * TILE_ROWS, 48)
    for g, w in zip(got, want, strict=True):
        assert registry.disagreement(g, w, 0.0) is None
    assert mx.array_equal(want[2], reference_split_rows(x)[2])
    # a whole tile and a partial one a batch; rows of 33 groups (each SIMD group splits several, one more than the
    # rest)
    for x in (random_activations((2 * 150, 64), seed=5), random_activations((20, 1056), seed=6)):
        for g, w in zip(halfsplit._kernel_split_tiles(x, 2, interleaved), reference_split_tiles(x, 2, interleaved),
                        strict=True):
            assert registry.disagreement(g, w, 0.0) is None


@pytest.mark.parametrize("bits", [8, 16])
def test_kernel_renders_for_cuda_only(bits):
    kernel = dense_wgmma.kernel(bits)
    out = rendered(kernel, CUDA)
    assert out["input_names"] == ["xhi", "xlo", "wq", "scales", "dims", "xscale"]
    assert_renders_cleanly(out)
    assert not re.search(r"\bds4_wgmma_f16_64x128x16\b", METAL.prelude)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in CUDA.prelude
    assert DENSE_WGMMA.backends == HALF_WGMMA.backends == ("cuda",)
    # two warpgroups; a B plane's 16 core matrices along N of 4 along K: LBO and SBO 16-byte multiples
    assert WARPGROUPS in (2, 3) and TM == 128 and LBO % 16 == 0 and SBO == 4 * LBO
    assert kernel.shared_memory == 4 * STAGES * dense_wgmma.stage_words(bits) <= 227 * 1024
    assert dense_wgmma.kernel(bits, stages=6).shared_memory <= 227 * 1024  # the deepest plan bench/ compares


def test_hopper_only(on_cpu):
    """On the CPU neither kernel is tried (batch_matmul stays the quantized matmul); planned for CUDA, both are
    taken, for Metal neither."""
    x, blocks, _ = case(GGMLType.Q8_0, (48, 256), 20, seed=2)
    weight = to_affine(blocks, GGMLType.Q8_0, (48, 256))
    assert not dense_wgmma.fits(x, weight) and not DENSE_WGMMA.enabled(GGMLType.Q8_0)
    assert (batch_matmul(x, weight) == weight.matmul(x)).all().item()
    with registry.planning("cuda"):
        assert dense_wgmma.fits(x, weight) and DENSE_WGMMA.enabled(GGMLType.Q8_0)
        q4 = to_affine(random_blocks(GGMLType.Q4_K, 48, 256, seed=3), GGMLType.Q4_K, (48, 256))
        assert not dense_wgmma.fits(x, q4)  # Q4_K's offset needs x's row sums: dense_f16.py's kernel
    with registry.planning("metal"):
        assert not dense_wgmma.fits(x, weight)


CASES = {
    "wide": ((600, 64), 130),  # three warpgroups, a partial fourth column tile of 192
    "two_column_tiles": ((200, 96), 37),  # T below a token tile, OUT past one column tile
    "three_token_tiles": ((24, 64), 150),  # T past two token tiles, OUT below one warp's rows
    "one_group": ((8, 32), 17),  # IN of one group: a single stage
    "many_groups": ((136, 256), 21),  # more groups than stages
    "batch": ((3, 40, 64), 19),  # a batch of matrices, as the grouped output projection
}
"""W shape, rows of x (Q8_0)."""


@pytest.mark.slow
def test_emulated_first_use_checks_pass(on_cpu, monkeypatch, tmp_path):
    """The registry's probes (dense_f16.py's: two partial tiles and a batch of three; F16 with subnormal halves)
    through the emulated kernels under PLAN."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    args = DENSE_WGMMA.probe(GGMLType.Q8_0)
    got, want = dense_wgmma._fast(*args), dense_wgmma._reference(*args)
    assert len(got) == len(want) == 3  # the batch's rows also interleaved
    for g, w in zip(got, want, strict=True):
        assert registry.disagreement(g, w, TOLERANCE) is None
    args = HALF_WGMMA.probe((512, 256))
    assert registry.disagreement(dense_wgmma._half_fast(*args), HALF_BATCH.reference(*args), TOLERANCE) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_equals_the_product(on_cpu, name, monkeypatch, tmp_path):
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))
    shape, rows = CASES[name]
    x, blocks, want = case(GGMLType.Q8_0, shape, rows, seed=3)
    got = np.array(dense_wgmma.wgmma_affine_matmul(x, to_affine(blocks, GGMLType.Q8_0, shape)))
    assert got.shape == want.shape and np.isfinite(got).all()  # every output was written
    assert within(got, want, TOLERANCE)
    assert within(got, np.array(reference_matmul(x, blocks, GGMLType.Q8_0, shape)), TOLERANCE)


@pytest.mark.slow
def test_emulated_kernel_reads_and_writes_interleaved_groups(on_cpu, monkeypatch, tmp_path):
    """x (T, G, IN) with `interleaved` (the grouped output projection's rows where they lie): bit for bit the
    (G, T, IN) batch's values, moved to (T, G, OUT), over a partial second row tile (T = 150)."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    monkeypatch.setattr(halfsplit, "build", emulated_build(tmp_path))
    shape = (3, 40, 64)
    x, blocks, want = case(GGMLType.Q8_0, shape, 150, seed=12)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    batch = np.array(dense_wgmma.wgmma_affine_matmul(x, weight))
    rows = mx.array(np.ascontiguousarray(np.swapaxes(np.array(x), 0, 1)))
    got = np.array(dense_wgmma.wgmma_affine_matmul(rows, weight, interleaved=True))
    assert got.shape == (150, 3, 40) and within(batch, want, TOLERANCE)
    assert (got == np.swapaxes(batch, 0, 1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2, 3, 8])
def test_emulated_kernel_without_the_pipeline(on_cpu, groups, monkeypatch, tmp_path):
    """PIPELINE = 1 (a group's wgmma issued before the previous group's are drained) gives PIPELINE 0's values (each
    group's waited for and drained at once), bit for bit, for K of one group, an even and an odd count, and more
    groups than stages; so do PLAN's overlapped halves and six stages copied five ahead."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    x, blocks, want = case(GGMLType.Q8_0, (40, 32 * groups), 9, seed=6)
    weight = to_affine(blocks, GGMLType.Q8_0, (40, 32 * groups))
    waited = np.array(dense_wgmma.wgmma_affine_matmul(x, weight, plan=(0, 3, 2, 0, 4)))
    assert within(waited, want, TOLERANCE)
    assert (waited == np.array(dense_wgmma.wgmma_affine_matmul(x, weight, plan=(1, 2, 2, 0, 4)))).all()
    assert (waited == np.array(dense_wgmma.wgmma_affine_matmul(x, weight, plan=(0, 5, 2, 0, 6)))).all()
    assert (waited == np.array(dense_wgmma.wgmma_affine_matmul(x, weight))).all()


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 16])
def test_emulated_kernel_with_three_warpgroups(on_cpu, bits, monkeypatch, tmp_path):
    """Three warpgroups over 192 W rows (the first 256 threads copying B): the two-warpgroup kernel's values, bit
    for bit, with OUT past one and a half column tiles; so are the overlapped halves' (OVERLAP)."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    if bits == 8:
        x, blocks, want = case(GGMLType.Q8_0, (300, 96), 130, seed=8)
        weight = to_affine(blocks, GGMLType.Q8_0, (300, 96))
        product = partial(dense_wgmma.wgmma_affine_matmul, x, weight)
    else:
        x, w, want = half_case(300, 96, 130, seed=8)
        product = partial(dense_wgmma.wgmma_half_matmul, x, w)
    three = np.array(product(plan=(0, 3, 3, 0, 4)))
    assert within(three, want, TOLERANCE) and (three == np.array(product(plan=(0, 3, 2, 0, 4)))).all()
    assert (three == np.array(product())).all()  # PLAN's two m64n64 halves: the same sums


@pytest.mark.slow
def test_emulated_kernel_keeps_float32_accuracy_at_flash_k_and_any_row_scale(on_cpu, monkeypatch, tmp_path):
    """IN = 4096 within TOLERANCE / 10 of the float64 product; rows from 1e-30 to 1e30 and rows mixing magnitudes
    2^20 apart each within TOLERANCE of their own largest output."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    shape = (24, 4096)
    x, blocks, want = case(GGMLType.Q8_0, shape, 6, seed=4)
    sizes = np.array([1e-30, 1e-8, 1.0, 1e8, 1e30, 1.0], np.float32)
    x = np.array(x) * sizes[:, None]
    x[[2, 5], ::2] *= 2.0**-20
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    want = x.astype(np.float64) @ np.array(weight.dequantize()).astype(np.float64).T
    got = np.array(dense_wgmma.wgmma_affine_matmul(mx.array(x), weight))
    assert np.isfinite(got).all()
    row_error = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert (row_error <= TOLERANCE / 10).all(), row_error


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(200, 64, 150), (24, 4096, 20)], ids=str)
def test_emulated_half_kernel_equals_the_product(on_cpu, shape, monkeypatch, tmp_path):
    """F16 W with magnitudes down to subnormal halves: two partial column and token tiles, Flash's IN."""
    monkeypatch.setattr(dense_wgmma, "build", emulated_build(tmp_path))
    n_out, n_in, rows = shape
    x, w, want = half_case(n_out, n_in, rows, seed=7)
    got = np.array(dense_wgmma.wgmma_half_matmul(x, w))
    assert got.shape == want.shape and np.isfinite(got).all()
    assert within(got, want, TOLERANCE / 10 if n_in == 4096 else TOLERANCE)


@pytest.mark.gpu
@pytest.mark.cuda
def test_wgmma_kernels_pass_their_checks_on_the_h200(on_cuda):
    """On the H200 (compute capability 9.0) both kernels pass their first-use checks."""
    assert dense_wgmma.hopper()
    assert DENSE_WGMMA.enabled(GGMLType.Q8_0) and HALF_WGMMA.enabled((512, 4096))


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", FLASH_SHAPES)
def test_wgmma_equals_the_reference_at_flash_size(on_cuda, name):
    """A 2048-token chunk (and a ragged 777) through Flash's Q8_0 projection shapes: within TOLERANCE of the
    reference, and batch_matmul on the H200 takes the kernel."""
    shape = FLASH_SHAPES[name]
    lead, (n_out, n_in) = shape[:-2], shape[-2:]
    blocks = random_blocks(GGMLType.Q8_0, int(np.prod(lead, dtype=int)) * n_out, n_in, seed=41)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    for rows in (2048, 777):
        x = random_activations((*lead, rows, n_in), seed=42)
        got = dense_wgmma.wgmma_affine_matmul(x, weight)
        want = reference_matmul(x, blocks, GGMLType.Q8_0, shape)
        assert got.shape == want.shape
        assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
    assert (batch_matmul(x, weight) == got).all().item()
    if lead:  # the grouped output projection as the model runs it: each token's groups where they lie
        rows = mx.contiguous(mx.swapaxes(x, 0, 1))
        assert (grouped_rows_matmul(rows, weight) == mx.swapaxes(got, 0, 1)).all().item()


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(512, 4096), (8192, 1024)], ids=str)
def test_wgmma_half_equals_the_reference_on_the_gpu(on_cuda, shape):
    x, w, _ = half_case(*shape, 4096, seed=8)
    got = dense_wgmma.wgmma_half_matmul(x, w)
    want = x @ w.astype(mx.float32).T
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
