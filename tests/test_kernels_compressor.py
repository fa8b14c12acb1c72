"""The compressor's decode-step kernel (kernels/compressor.py) against `pool_step`, at Flash shapes (GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels import registry
from ds4_mlx.kernels.compressor import TOLERANCE
from ds4_mlx.kernels.probe import random_activations
from ds4_mlx.model.compressor import POOL_STEP, Frontier, pool_step


@pytest.mark.gpu
@pytest.mark.parametrize("position", [0, 5, 7, 127, 1000])
@pytest.mark.parametrize(("ratio", "width"), [(4, 512), (4, 128), (128, 512)])
def test_step_kernel_is_used_and_equals_reference(kernels_unforced, ratio, width, position):
    coff = 2 if ratio == 4 else 1
    empty = Frontier.empty(ratio, width)
    filled = (mx.arange(coff * ratio) < (coff - 1) * ratio + position % ratio)[:, None]  # rows holding a token
    args = (random_activations((1, coff * width), seed=1), random_activations((1, coff * width), seed=2),
            random_activations((ratio, coff * width), seed=3),
            mx.where(filled, random_activations(empty.kv.shape, seed=4), empty.kv),
            mx.where(filled, random_activations(empty.kv.shape, seed=5), empty.score),
            mx.array(position, dtype=mx.int32), ratio, width)
    got = POOL_STEP(*args)
    assert POOL_STEP.fast_path.decisions()[registry.current_backend(), (ratio, width)].fast
    for g, w in zip(got, pool_step(*args)):
        assert mx.array_equal(mx.isinf(g), mx.isinf(w))
        finite = mx.isfinite(w)
        error = mx.max(mx.where(finite, mx.abs(g - w), 0)).item()
        assert error <= TOLERANCE * mx.max(mx.where(finite, mx.abs(w), 0)).item()
