"""The decode-step attention kernels (kernels/attention.py) against the model's formulas, at Flash shapes (GPU)."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from ds4_mlx.kernels import registry
from ds4_mlx.kernels.attention import TOLERANCE
from ds4_mlx.kernels.probe import random_activations
from ds4_mlx.model.attention import DECODE_ATTENTION, attend
from ds4_mlx.model.rope import ROTATE, RoPE, rotate


def within(got: mx.array, want: mx.array) -> bool:
    return mx.max(mx.abs(got - want)).item() <= TOLERANCE * mx.max(mx.abs(want)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 512), (1, 512), (3, 128)])
def test_rope_kernel_is_used_and_equals_reference(kernels_unforced, shape, inverse):
    rope = RoPE(64, 160000.0)
    x = random_activations(shape, seed=1)
    cos, sin = rope.cos_sin(mx.array([1048575, 3, 9][: shape[0]], dtype=mx.int32))
    got = ROTATE(x, cos, sin, 64, inverse)
    assert ROTATE.fast_path.decisions()[registry.current_backend(), (shape[-1], 64, inverse)].fast
    assert within(got, rotate(x, cos, sin, 64, inverse))


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(128,), (128, 512), (128, 258)])
def test_decode_attention_kernel_is_used_and_equals_reference(kernels_unforced, sizes):
    """Window only (ratio 0), window + indexer picks (ratio 4, gathered rows per query), window + every row."""
    d, heads = 512, 64
    q = random_activations((1, heads, d), seed=2) * 0.3
    keys = tuple(random_activations((n, d), seed=3 + i) if i != 1 else random_activations((1, n, d), seed=9)
                 for i, n in enumerate(sizes))
    masks = tuple((mx.arange(n) % 5 != 2)[None] for n in sizes)
    sinks = random_activations((heads,), seed=4)
    got = DECODE_ATTENTION(q, keys, masks, sinks, 1 / math.sqrt(d))
    assert DECODE_ATTENTION.fast_path.decisions()[registry.current_backend(), (d, sum(sizes))].fast
    assert within(got, attend(q, list(keys), list(masks), sinks, 1 / math.sqrt(d)))


def test_one_query_attention_equals_the_chunk_formula(on_cpu, kernels_unforced):
    """On the CPU the decode form is the chunk formula itself (no kernel): bit for bit."""
    q = random_activations((1, 4, 64), seed=5)
    keys = (random_activations((16, 64), seed=6), random_activations((1, 8, 64), seed=7))
    masks = ((mx.arange(16) > 3)[None], (mx.arange(8) < 5)[None])
    sinks = random_activations((4,), seed=8)
    assert mx.array_equal(DECODE_ATTENTION(q, keys, masks, sinks, 0.125), attend(q, list(keys), list(masks), sinks,
                                                                                   0.125))
