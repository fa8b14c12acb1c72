"""The router kernel (kernels/decode/router.py) against `route`: the same experts, weights to a 6-term sum's
rounding."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.kernels.decode.router import GATED_TOLERANCE, TOLERANCE, GatedRoute
from ds4_mlx.model.moe import GATED_ROUTE, ROUTE, route
from ds4_mlx.model.norm import rms_norm


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

    from ds4_mlx.kernels.decode import router

    monkeypatch.setattr(router, "build", emulated_build(tmp_path))
    logits = random_activations((5, 256), seed=3) * 3.0
    logits = mx.concatenate([logits, mx.full((1, 256), 25.0), mx.zeros((1, 256))])
    bias = random_activations((256,), seed=4) * 0.05
    ids, weights = ROUTE._kernel(logits, bias, 6, 1.5)
    want_ids, want_weights = route(logits, bias, 6, 1.5)
    assert mx.array_equal(ids, want_ids)
    assert mx.max(mx.abs(weights - want_weights)).item() <= TOLERANCE * mx.max(want_weights).item()


def gated_args(seed: int) -> tuple:
    """A decode token's raw input (off unit rms), Flash's float16 gate (256 x 4096), an input norm and a bias."""
    x = random_activations((1, 4096), seed=seed) * 7.0
    gate = (random_activations((256, 4096), seed=seed + 1) * (4.0 / 64)).astype(mx.float16)
    norm = (1.0 + 0.5 * random_activations((4096,), seed=seed + 2), 1e-6)
    bias = random_activations((256,), seed=seed + 3) * 0.1
    mx.eval(x, gate, norm[0], bias)
    return x, gate, norm, bias


@pytest.mark.gpu
def test_gated_route_is_one_launch_equals_reference_and_leaves_its_counter_at_zero(kernels_unforced):
    """The router's matvec and the route in one launch (CUDA; Metal takes them apart), three times on one counter:
    the same experts as the formulas, weights to a 6-term sum's rounding, the counter back to zero each time."""
    x, gate, norm, bias = gated_args(5)
    counter = GatedRoute.new_counter()
    want_ids, want_weights = route(rms_norm(x, *norm) @ gate.astype(mx.float32).T, bias, 6, 1.5)
    for _ in range(3):
        ids, weights = GATED_ROUTE(x, gate, norm, bias, counter, 6, 1.5)
        mx.eval(ids, weights)
        assert not mx.any(counter).item()
        assert mx.array_equal(ids, want_ids)
        assert mx.max(mx.abs(weights - want_weights)).item() <= GATED_TOLERANCE * mx.max(want_weights).item()
    decision = GATED_ROUTE.fast_path.decisions()[registry.current_backend(), (256, 4096, 6, 1.5, 1e-6)]
    assert decision.fast == (registry.current_backend() == "cuda")


@pytest.mark.slow
def test_emulated_gated_route_equals_reference(on_cpu, monkeypatch, tmp_path):
    """The one-launch router's CUDA text run on the CPU (emulated_cuda.py) at Flash's shape: half.py's normed
    matvec over 256 threadgroups, then the route by the last of them."""
    from emulated_cuda import emulated_build

    from ds4_mlx.kernels.decode import router

    monkeypatch.setattr(router, "build", emulated_build(tmp_path))
    x, gate, norm, bias = gated_args(9)
    assert GatedRoute.fits(x, gate, norm, bias)
    ids, weights = GATED_ROUTE._kernel(x, gate, norm, bias, GatedRoute.new_counter(), 6, 1.5)
    want_ids, want_weights = route(rms_norm(x, *norm) @ gate.astype(mx.float32).T, bias, 6, 1.5)
    assert mx.array_equal(ids, want_ids)
    assert mx.max(mx.abs(weights - want_weights)).item() <= GATED_TOLERANCE * mx.max(want_weights).item()


def test_router_plans_one_launch_on_cuda_two_on_metal(on_cpu):
    """A learned router of one decode token, planned for CUDA, is one kernel (matvec and route); for Metal two."""
    from collections import Counter

    from ds4_mlx.model.graph import STAND_IN, VIEWS, graph_nodes
    from ds4_mlx.model.moe import Router

    x, gate, norm, bias = gated_args(13)
    linear = type("Gate", (), {"half": gate, "shape": gate.shape})()
    for backend, launches in (("cuda", 1), ("metal", 2)):
        router = Router(linear, bias, None, 6, 1.5)
        with registry.planning(backend):
            nodes = graph_nodes(list(router(x, mx.zeros((1,), dtype=mx.int32), norm)))
        assert Counter(n for n in nodes.values() if n not in VIEWS) == {STAND_IN: launches}
