"""The activation-quantisation kernels (kernels/sublayers/actquant.py) against model/quant_sim.py, bit for bit (GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.quant_sim import indexer_fp4, kv_fp8, simulate_indexer_fp4, simulate_kv_fp8


def spread(shape, seed):
    """Rows from 1e-8 to 1e4 in scale, so the floors, subnormal steps and saturation are all reached."""
    scales = mx.power(10.0, mx.linspace(-8, 4, shape[0]))
    return random_activations(shape, seed=seed) * scales.reshape(-1, *([1] * (len(shape) - 1)))


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "n_rot"), [((1, 512), 64), ((7, 512), 64), ((1, 3, 512), 64), ((64, 512), 64),
                                             ((3, 192), 64), ((5, 512), 0)])
def test_fp8_kernel_is_used_and_exact(on_gpu, kernels_unforced, shape, n_rot):
    """Flash's KV rows (512 wide, 64 RoPE dims), one or many; a threadgroup left partly idle (3 x 3 blocks)."""
    x = spread(shape, 1)
    got = simulate_kv_fp8(x, n_rot)
    assert simulate_kv_fp8.fast_path.decisions()[registry.current_backend(), (shape[-1], n_rot)].fast
    assert mx.array_equal(got, kv_fp8(x, n_rot))


def fp8_edges() -> mx.array:
    """Rows of zeros (the amax floor), one huge value among zeros, exact powers of two, ties of the E4M3 grid
    (1.0625 + k/8 at scale 1: each block's first value 300 sets it), saturation-sized values and their negatives."""
    i = mx.arange(512)
    ties = mx.where(i % 64 == 0, 300.0, (1.0625 + 0.125 * (i % 8)) * mx.where(i % 3 == 0, -1.0, 1.0))
    return mx.stack([mx.zeros(512), mx.where(i == 5, 3e5, 0.0), mx.power(2.0, (i % 40 - 20).astype(mx.float32)),
                     ties, mx.where(i % 2 == 0, 1e4, -1e-5), -spread((1, 512), 5)[0]])


@pytest.mark.gpu
def test_fp8_kernel_edges_are_exact(on_gpu, kernels_unforced):
    rows = fp8_edges()
    assert mx.array_equal(simulate_kv_fp8(rows, 64), kv_fp8(rows, 64))
    assert simulate_kv_fp8.fast_path.decisions()[registry.current_backend(), (512, 64)].fast


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128), (64, 128), (2, 64, 128)])
def test_indexer_fp4_kernel_is_used_and_exact(on_gpu, kernels_unforced, shape):
    x = spread(shape, 2)
    got = simulate_indexer_fp4(x)
    assert simulate_indexer_fp4.fast_path.decisions()[registry.current_backend(), 128].fast
    assert mx.array_equal(got, indexer_fp4(x))


def test_cpu_takes_the_reference(on_cpu, kernels_unforced):
    """No custom kernels on the CPU: the fast path quietly answers with the reference."""
    x = spread((3, 128), 3)
    assert mx.array_equal(simulate_indexer_fp4(x), indexer_fp4(x))
    assert not simulate_indexer_fp4.fast_path.enabled(128)
