"""The tensor-core dense projection of affine weights (kernels/dense_tf32.py).

Without a GPU the kernel runs in emulation (emulated_cuda.py: the mma helper there truncates its sums as the tensor
cores do, its fragment layout is tested by test_kernels_grouped_tf32.py). The kernel must equal x @ W.T in float64
within batch.py's float32 bound (TOLERANCE) for odd shapes, both quant widths and a batch of matrices, and at
Flash's K with room to spare, where one TF32 mma of unsplit x per product would not. On the CPU the kernel is not
used: batch_matmul's products stay what they were, value for value.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels import batch, dense_tf32, registry
from ds4_mlx.kernels.affine import to_affine
from ds4_mlx.kernels.batch import TOLERANCE, batch_matmul
from ds4_mlx.kernels.dense_tf32 import DENSE_TF32, KERNEL, LD, THREADS, TK, TM, TN, tf32_affine_matmul
from ds4_mlx.kernels.dialect import CUDA, METAL
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.quants import dequantize, reference_matmul
from ds4_mlx.model.gguf import GGMLType
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered
from test_kernels_grouped_tf32 import tf32_rna

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


# ---------------------------------------------------------------------------------------------------------------
# On the CPU

def test_kernel_renders_for_cuda_only():
    out = rendered(KERNEL, CUDA)
    assert out["input_names"] == ["x", "wq", "scales", "biases", "dims"] and out["output_names"] == ["y"]
    assert_renders_cleanly(out)
    assert not re.search(r"\bds4_mma_tf32_16x8x8\(", METAL.prelude)
    assert DENSE_TF32.backends == ("cuda",)
    # threadgroup memory: x and quant slices (padded rows), scales and c, under the 48 KB static limit
    assert (TM + TN) * LD * 4 + 2 * TN * 4 <= 48 * 1024 and LD % 32 == 4 and LD % 4 == 0 and TK == 32
    # the staging maps: 8 warps, x rows by whole warps, quant words by whole rows
    assert THREADS == 256 and (TM * TK) % THREADS == 0 and all(TN * bits % THREADS == 0 for bits in (4, 8))
    assert dense_tf32.TOLERANCE == batch.TOLERANCE


def test_only_cuda_plans_the_tensor_core_kernel():
    with registry.planning("cuda"):
        assert DENSE_TF32.enabled(GGMLType.Q8_0)
    with registry.planning("metal"):
        assert not DENSE_TF32.enabled(GGMLType.Q8_0)


def test_q8_0_quants_centred_need_no_offset():
    """Q8_0's affine bias is -128 * scale, so c = bias + 128 * scale is exactly 0: the kernel's row-sum term adds
    nothing there, and the product is scale times an exact sum of x times int8 quants."""
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
        assert not DENSE_TF32.enabled(ggml_type)
        got = batch_matmul(x, weight)
    assert (got == weight.matmul(x)).all().item()


# ---------------------------------------------------------------------------------------------------------------
# Emulated (pytest -m slow)

CASES = {
    "q8_two_column_tiles": (GGMLType.Q8_0, (200, 96), 37),  # odd T below a row tile, OUT past one column tile
    "q8_two_row_tiles": (GGMLType.Q8_0, (24, 64), 150),  # T past one row tile, OUT below one mma column block
    "q8_one_group": (GGMLType.Q8_0, (8, 32), 17),  # IN of one group: a single K step
    "q4": (GGMLType.Q4_K, (136, 256), 21),  # 4-bit quants, nonzero c; OUT just past a column tile
    "q8_batch": (GGMLType.Q8_0, (3, 40, 64), 19),  # a batch of matrices, as the grouped output projection
}
"""ggml type, W shape, rows of x."""


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_equals_the_product(on_cpu, name, monkeypatch, tmp_path):
    monkeypatch.setattr(dense_tf32, "build", emulated_build(tmp_path))
    ggml_type, shape, rows = CASES[name]
    x, blocks, want = case(ggml_type, shape, rows, seed=3)
    got = np.array(tf32_affine_matmul(x, to_affine(blocks, ggml_type, shape)))
    assert got.shape == want.shape and np.isfinite(got).all()  # every output was written
    assert within(got, want, TOLERANCE)
    reference = np.array(reference_matmul(x, blocks, ggml_type, shape))
    assert within(got, reference, TOLERANCE)


@pytest.mark.slow
def test_emulated_kernel_at_flash_k_is_float32_class_and_plain_tf32_is_not(on_cpu, monkeypatch, tmp_path):
    """IN = 4096 (Flash's q_a, kv, shared expert IN): within TOLERANCE / 10 of the float64 product; x rounded to
    TF32 once (one mma per product) is not within TOLERANCE. 20 rows, 24 outputs: one threadgroup, 128 K steps."""
    monkeypatch.setattr(dense_tf32, "build", emulated_build(tmp_path))
    shape = (24, 4096)
    x, blocks, want = case(GGMLType.Q8_0, shape, 20, seed=4)
    got = np.array(tf32_affine_matmul(x, to_affine(blocks, GGMLType.Q8_0, shape)))
    assert np.isfinite(got).all()
    assert within(got, want, TOLERANCE / 10)
    w = np.array(dequantize(blocks, GGMLType.Q8_0, shape)).astype(np.float64)
    assert not within(tf32_rna(np.array(x)).astype(np.float64) @ w.T, want, TOLERANCE)


@pytest.mark.slow
def test_emulated_first_use_check_passes(on_cpu, monkeypatch, tmp_path):
    """The registry's probe (two column and row tiles, partial; a batch of three) through the emulated kernel, for
    Q4_K (a nonzero c; Q8_0's shapes are covered above)."""
    monkeypatch.setattr(dense_tf32, "build", emulated_build(tmp_path))
    args = dense_tf32._probe(GGMLType.Q4_K)
    for got, want in zip(dense_tf32._fast(*args), dense_tf32._reference(*args), strict=True):
        assert registry.disagreement(got, want, TOLERANCE) is None


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

FLASH_SHAPES = {
    "q_a": (1024, 4096),
    "q_b": (32768, 1024),
    "out_a": (8, 1024, 4096),  # the grouped output projection: 8 groups against 8 slices of the heads
    "out_b": (4096, 8192),
}


@pytest.mark.gpu
@pytest.mark.cuda
def test_dense_tf32_passes_its_checks_on_the_gpu(on_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ggml_type in TYPES:
            assert DENSE_TF32.enabled(ggml_type)


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name", FLASH_SHAPES)
def test_dense_tf32_equals_the_reference_at_flash_size(on_cuda, name):
    """A 2048-token chunk through Flash's Q8_0 projection shapes: within TOLERANCE of the reference (batch_matmul
    takes dense_f16.py's kernel first on CUDA, this one where that one's check fails)."""
    shape = FLASH_SHAPES[name]
    lead, (n_out, n_in) = shape[:-2], shape[-2:]
    blocks = random_blocks(GGMLType.Q8_0, int(np.prod(lead, dtype=int)) * n_out, n_in, seed=41)
    x = random_activations((*lead, 2048, n_in), seed=42)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    got = tf32_affine_matmul(x, weight)
    want = reference_matmul(x, blocks, GGMLType.Q8_0, shape)
    assert got.shape == want.shape
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()


@pytest.mark.gpu
@pytest.mark.cuda
def test_dense_tf32_q4_equals_the_reference_on_the_gpu(on_cuda):
    shape = (2048, 4096)
    blocks = random_blocks(GGMLType.Q4_K, *shape, seed=43)
    x = random_activations((777, 4096), seed=44)
    got = tf32_affine_matmul(x, to_affine(blocks, GGMLType.Q4_K, shape))
    want = reference_matmul(x, blocks, GGMLType.Q4_K, shape)
    assert (mx.abs(got - want).max() <= TOLERANCE * mx.abs(want).max()).item()
