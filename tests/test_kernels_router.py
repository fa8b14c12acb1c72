"""The router kernel (kernels/router.py) against `route`: the same experts, weights to a 6-term sum's rounding."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels import registry
from ds4_mlx.kernels.probe import random_activations
from ds4_mlx.kernels.router import TOLERANCE
from ds4_mlx.model.moe import ROUTE, route


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7])
def test_route_kernel_is_used_and_equals_reference(kernels_unforced, tokens):
    logits = random_activations((tokens, 256), seed=1) * 3.0
    logits = mx.concatenate([logits, mx.full((1, 256), 25.0), mx.zeros((1, 256))])  # linear softplus; all ties
    bias = random_activations((256,), seed=2) * 0.05
    ids, weights = ROUTE(logits, bias, 6, 1.5)
    assert ROUTE.fast_path.decisions()[registry.current_backend(), (256, 6, 1.5)].fast
    want_ids, want_weights = route(logits, bias, 6, 1.5)
    assert mx.array_equal(ids, want_ids)
    assert mx.max(mx.abs(weights - want_weights)).item() <= TOLERANCE * mx.max(want_weights).item()


def test_route_picks_lower_ids_on_ties_and_weighs_unbiased(on_cpu):
    logits = mx.zeros((1, 8))
    bias = mx.array([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    ids, weights = route(logits, bias, 3, 1.5)
    assert ids.tolist() == [[0, 2, 5]]  # the two biased experts, then the lowest id among the ties
    assert mx.allclose(weights, mx.full((1, 3), 0.5)).item()  # bias chooses, never weighs


@pytest.mark.slow
def test_emulated_route_kernel_equals_reference(on_cpu, monkeypatch, tmp_path):
    """The kernel's CUDA text run on the CPU (emulated_cuda.py) at Flash's 256 experts, ties included."""
    from emulated_cuda import emulated_build

    from ds4_mlx.kernels import router

    monkeypatch.setattr(router, "build", emulated_build(tmp_path))
    logits = random_activations((5, 256), seed=3) * 3.0
    logits = mx.concatenate([logits, mx.full((1, 256), 25.0), mx.zeros((1, 256))])
    bias = random_activations((256,), seed=4) * 0.05
    ids, weights = ROUTE._kernel(logits, bias, 6, 1.5)
    want_ids, want_weights = route(logits, bias, 6, 1.5)
    assert mx.array_equal(ids, want_ids)
    assert mx.max(mx.abs(weights - want_weights)).item() <= TOLERANCE * mx.max(want_weights).item()
