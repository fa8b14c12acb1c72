"""The activation-quantisation kernels (kernels/actquant.py) against model/quant_sim.py, bit for bit (GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels import registry
from ds4_mlx.kernels.probe import random_activations
from ds4_mlx.model.quant_sim import indexer_fp4, kv_fp8, simulate_indexer_fp4, simulate_kv_fp8


def spread(shape, seed):
    """Rows from 1e-8 to 1e4 in scale, so the floors, subnormal steps and saturation are all reached."""
    scales = mx.power(10.0, mx.linspace(-8, 4, shape[0]))
    return random_activations(shape, seed=seed) * scales.reshape(-1, *([1] * (len(shape) - 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 512), (7, 512), (1, 3, 512)])
def test_fp8_kernel_is_used_and_exact(kernels_unforced, shape):
    x = spread(shape, 1)
    got = simulate_kv_fp8(x, 64)
    assert simulate_kv_fp8.fast_path.decisions()[registry.current_backend(), (512, 64)].fast
    assert mx.array_equal(got, kv_fp8(x, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128), (64, 128), (2, 64, 128)])
def test_indexer_fp4_kernel_is_used_and_exact(kernels_unforced, shape):
    x = spread(shape, 2)
    got = simulate_indexer_fp4(x)
    assert simulate_indexer_fp4.fast_path.decisions()[registry.current_backend(), 128].fast
    assert mx.array_equal(got, indexer_fp4(x))


def test_cpu_takes_the_reference(on_cpu, kernels_unforced):
    """No custom kernels on the CPU: the fast path quietly answers with the reference."""
    x = spread((3, 128), 3)
    assert mx.array_equal(simulate_indexer_fp4(x), indexer_fp4(x))
    assert not simulate_indexer_fp4.fast_path.enabled(128)
