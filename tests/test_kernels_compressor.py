"""The compressor's decode-step kernel (kernels/compressor.py) against `pool_step`, at Flash shapes (GPU).

Flash runs it at ratio 4 with overlap for attention rows (width 512) and indexer rows (128), and at ratio 128
(512). Positions cover the first token of a window, tokens inside it, its last token (the frontier shifts or
empties) and a frontier whose previous window is still empty (the first four tokens of a sequence).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels import registry
from ds4_mlx.kernels.compressor import TOLERANCE
from ds4_mlx.kernels.probe import random_activations
from ds4_mlx.model.compressor import POOL_STEP, Frontier, pool_step

SHAPES = [(4, 512), (4, 128), (128, 512)]
POSITIONS = {4: [0, 1, 2, 3, 4, 6, 7, 1000, 1003], 128: [0, 5, 64, 126, 127, 128, 255, 1000]}


def step_args(ratio: int, width: int, position: int, seed: int = 0) -> tuple:
    """A token at `position` and the frontier it meets: rows of earlier tokens filled, the others empty."""
    coff = 2 if ratio == 4 else 1
    empty = Frontier.empty(ratio, width)
    rows = mx.arange(coff * ratio)
    # the previous window (ratio 4, rows 0..r-1) is filled once the sequence has one; the current one up to slot
    previous = rows < ratio if coff == 2 and position >= ratio else rows < 0
    current = (rows >= (coff - 1) * ratio) & (rows < (coff - 1) * ratio + position % ratio)
    filled = (previous | current)[:, None]
    return (random_activations((1, coff * width), seed=seed + 1), random_activations((1, coff * width), seed=seed + 2),
            random_activations((ratio, coff * width), seed=seed + 3),
            mx.where(filled, random_activations(empty.kv.shape, seed=seed + 4), empty.kv),
            mx.where(filled, 3 * random_activations(empty.kv.shape, seed=seed + 5), empty.score),
            mx.array(position, dtype=mx.int32), ratio, width)


def assert_close(got: tuple[mx.array, ...], want: tuple[mx.array, ...]) -> None:
    """The pooled row within the kernel's tolerance; the frontier (copies and one add) exactly."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(mx.isinf(g), mx.isinf(w)) and not mx.any(mx.isnan(g)).item()
        if i:
            assert mx.array_equal(g, w)
            continue
        error = mx.max(mx.abs(g - w)).item()
        assert error <= TOLERANCE * mx.max(mx.abs(w)).item()


@pytest.mark.gpu
@pytest.mark.parametrize(("ratio", "width", "position"),
                         [(r, w, p) for r, w in SHAPES for p in POSITIONS[r]])
def test_step_kernel_is_used_and_equals_reference(on_gpu, kernels_unforced, ratio, width, position):
    args = step_args(ratio, width, position)
    got = POOL_STEP(*args)
    assert POOL_STEP.fast_path.decisions()[registry.current_backend(), (ratio, width)].fast
    assert_close(got, pool_step(*args))


@pytest.mark.gpu
@pytest.mark.parametrize(("ratio", "width", "start"), [(4, 512, 0), (4, 128, 0), (128, 512, 120)])
def test_step_kernel_follows_the_reference_across_windows(on_gpu, kernels_unforced, ratio, width, start):
    """Tokens fed one by one through a window boundary, each step on the frontier the previous one left."""
    coff = 2 if ratio == 4 else 1
    args = step_args(ratio, width, start)
    frontier_kv, frontier_score = args[3], args[4]
    for position in range(start, start + 10):
        kv, score = (random_activations((1, coff * width), seed=100 + 2 * position + k) for k in range(2))
        step = (kv, score, args[2], frontier_kv, frontier_score, mx.array(position, dtype=mx.int32), ratio, width)
        got, want = POOL_STEP(*step), pool_step(*step)
        assert_close(got, want)
        frontier_kv, frontier_score = want[1], want[2]
    assert POOL_STEP.fast_path.decisions()[registry.current_backend(), (ratio, width)].fast


@pytest.mark.gpu
def test_step_kernel_under_compile(on_gpu, kernels_unforced):
    """The decode step is compiled with the position as an array: one trace serves every position."""
    assert POOL_STEP.fast_path.enabled((4, 512))  # the first-use check runs eagerly, outside the trace
    compiled = mx.compile(lambda *a: POOL_STEP(*a, 4, 512))
    for position in (2, 3, 4):
        args = step_args(4, 512, position)
        assert_close(compiled(*args[:6]), pool_step(*args))
