"""The decode step's two ends in one launch each (kernels/decode/ends.py): the token's embedding row as the streams, and
HyperHead's collapse. The CUDA text runs on the CPU (emulated_cuda, slow) and through MLX on the device (gpu)."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.decode import ends
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL
from ds4_mlx.kernels.decode.ends import EMBED_KERNEL, EMBED_STREAMS, HEAD_KERNEL, HEAD_TOLERANCE, embed_reference
from ds4_mlx.model.hyper_connection import HEAD_COLLAPSE, head_collapse
from emulated_cuda import emulated_build
from test_kernels_hc import NEUTRAL_WORDS

N_HC, WIDTH = 4, 512


def head_args(seed: int, tokens: int = 1) -> tuple:
    k = mx.random.split(mx.random.key(seed), 4)
    streams = mx.random.normal((tokens, N_HC, WIDTH), key=k[0]) * 2
    fn = mx.random.normal((N_HC, N_HC * WIDTH), key=k[1]) * 0.03
    return streams, fn, mx.array([0.8]), mx.random.normal((N_HC,), key=k[2]), 1e-6, 1e-6


def largest_error(got: mx.array, want: mx.array) -> float:
    return mx.max(mx.abs(got - want)).item() / mx.max(mx.abs(want)).item()


@pytest.mark.parametrize("kernel", [EMBED_KERNEL, HEAD_KERNEL], ids=lambda k: k.name)
def test_kernels_render_for_cuda_and_metal(kernel):
    for target in (CUDA, METAL):
        source, header = target.render(kernel.source), target.header(kernel)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", source + header)
        for helper in set(re.findall(r"\bds4_\w+(?=\()", source)):
            assert re.search(rf"\b{helper}\(", header), f"{helper} is called but not defined"


def test_shapes_the_kernels_do_not_take_go_to_the_references():
    table = mx.random.normal((6, 8)).astype(mx.bfloat16)
    assert mx.array_equal(EMBED_STREAMS(table, mx.array([2]), 3), embed_reference(table, mx.array([2]), 3))
    streams, fn, scale, base, hc_eps, eps = head_args(1)
    many = mx.concatenate([streams] * (ends.HEAD_ROWS + 1))  # a prefill chunk's tokens: the formula
    got = HEAD_COLLAPSE(many, fn, scale, base, hc_eps, eps)
    assert mx.allclose(got, head_collapse(many, fn, scale, base, hc_eps, eps))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.uint8], ids=str)
def test_emulated_embed_equals_the_reference_exactly(monkeypatch, tmp_path, dtype):
    """float16 and float32 tables, and an F16 tensor's file rows (uint8, two bytes a value)."""
    monkeypatch.setattr(ends, "build", emulated_build(tmp_path))
    table = (mx.random.normal((7, 96), key=mx.random.key(2)) * 4).astype(mx.float32 if dtype == mx.float32
                                                                          else mx.float16)
    table = mx.view(table, mx.uint8) if dtype == mx.uint8 else table
    for tokens in ([5], [5, 0, 6, 5]):  # a decode step's token, and a step's rows
        ids = mx.array(tokens, dtype=mx.int32)
        got = EMBED_STREAMS._kernel(table, ids, 3)
        assert got.shape == (len(tokens), 3, 96) and mx.array_equal(got, embed_reference(table, ids, 3))


@pytest.mark.slow
def test_emulated_head_equals_the_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(ends, "build", emulated_build(tmp_path))
    for tokens in (1, 3):  # a decode step's token, and a step's rows
        args = head_args(3, tokens)
        got = HEAD_COLLAPSE._kernel(*args)
        want = head_collapse(*args)
        assert got.shape == (tokens, WIDTH)
        assert all(largest_error(got[i], want[i]) <= HEAD_TOLERANCE for i in range(tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("words", [False, True], ids=["float16", "file-rows"])
def test_embed_kernel_is_used_and_exact(kernels_unforced, words):
    table = (mx.random.normal((50, 4096), key=mx.random.key(4)) * 3).astype(mx.float16)
    table = mx.view(table, mx.uint8) if words else table
    for tokens in ([17], [17, 3, 49, 17]):
        ids = mx.array(tokens, dtype=mx.int32)
        got = EMBED_STREAMS(table, ids, N_HC)
        key = (4096, N_HC, table.dtype, len(tokens))
        assert EMBED_STREAMS.fast_path.decisions()[registry.current_backend(), key].fast
        assert mx.array_equal(got, embed_reference(table, ids, N_HC))


@pytest.mark.gpu
def test_head_kernel_is_used_and_equals_the_reference(kernels_unforced):
    for tokens in (1, 4):
        args = head_args(6, tokens)
        got = HEAD_COLLAPSE(*args)
        want = head_collapse(*args)
        assert HEAD_COLLAPSE.fast_path.decisions()[registry.current_backend(), (N_HC, WIDTH, tokens)].fast
        assert all(largest_error(got[i], want[i]) <= HEAD_TOLERANCE for i in range(tokens))
        assert not np.isnan(np.array(got)).any()
