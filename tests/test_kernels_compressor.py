"""The compressor's decode-step kernel (kernels/sublayers/compressor.py) against `pool_step`, at Flash shapes (GPU).

Flash runs it at ratio 4 with overlap for attention rows (width 512) and indexer rows (128), and at ratio 128
(512). Positions cover the first token of a window, tokens inside it, its last token (the frontier shifts or
empties) and a frontier whose previous window is still empty (the first four tokens of a sequence). The pair
kernel (both ratio-4 compressors of a layer in one launch) against the two single references; its rendering (CUDA
and Metal) and its CPU reference are checked without a GPU.
"""

from __future__ import annotations

import re
from collections import Counter

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.sublayers.compressor import CHUNK_KERNEL, PAIR_KERNEL, STEP_KERNEL, TOLERANCE, _STEP
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.compressor import POOL_CHUNK, POOL_STEP, POOL_STEP_PAIR, Frontier, pool_chunk, pool_step
from ds4_mlx.model.graph import STAND_IN, VIEWS, graph_nodes
from kernel_checks import balanced, rendered

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


PAIR_POSITIONS = [0, 1, 2, 3, 4, 6, 7, 1000, 1002, 1003]
"""Slot 0, middle slots and the last slot (the frontier shifts) of first, second and later windows."""


def pair_args(position: int, widths: tuple[int, int] = (512, 128)) -> tuple:
    """POOL_STEP_PAIR's arguments for the attention (512) and indexer (128) compressors of a ratio-4 layer."""
    a, b = (step_args(4, width, position, seed=10 * k) for k, width in enumerate(widths))
    return a[:5], b[:5], a[5], 4, *widths


def pair_reference(a, b, position, ratio, width_a, width_b) -> tuple:
    return pool_step(*a, position, ratio, width_a), pool_step(*b, position, ratio, width_b)


@pytest.mark.parametrize("kernel", [STEP_KERNEL, PAIR_KERNEL], ids=lambda k: k.name)
def test_step_kernels_render_for_cuda_and_metal(kernel):
    """Every neutral word spelled, every helper defined; threadgroup memory declared at the kernel's own scope (Metal
    allows it nowhere else); the pair runs the single kernel's text, its arrays picked per threadgroup."""
    for target in (CUDA, METAL):
        out = rendered(kernel, target)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"])
        assert balanced(out["source"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
        for line in out["source"].splitlines():
            if re.match(r"\s*(__shared__|threadgroup)\b", line):
                assert not line.startswith(" "), line
        assert target.render(_STEP) in out["source"]
    metal = rendered(PAIR_KERNEL, METAL)["source"]
    assert "const device float* frontier_kv = second ? frontier_kv_b : frontier_kv_a;" in metal
    assert "device float* pooled = second ? pooled_b : pooled_a;" in metal
    assert re.search(r"const\s+float\* kv = second \? kv_b : kv_a;", rendered(PAIR_KERNEL, CUDA)["source"])


def test_chunk_kernel_renders_for_cuda_and_metal():
    for target in (CUDA, METAL):
        out = rendered(CHUNK_KERNEL, target)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"] + out["header"])
        assert balanced(out["source"]) and balanced(out["header"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"


def chunk_sequence(ratio: int, width: int, lengths: tuple[int, ...]):
    """Chunks of `lengths` tokens fed from position 0: each one's arguments on the frontier the reference left."""
    coff = 2 if ratio == 4 else 1
    ape = random_activations((ratio, coff * width), seed=9)
    frontier, n_past = Frontier.empty(ratio, width), 0
    fkv, fscore = frontier.kv, frontier.score
    for t in lengths:
        args = (*(random_activations((t, coff * width), seed=n_past + k) for k in range(2)), ape, fkv, fscore, n_past,
                ratio, width)
        yield args
        _, fkv, fscore = pool_chunk(*args)
        n_past += t


@pytest.mark.gpu
@pytest.mark.parametrize(("ratio", "width", "lengths"), [(4, 512, (4096, 4093, 10)), (4, 128, (8192, 7)),
                                                         (128, 512, (4096, 4000, 300))], ids=str)
def test_chunk_kernel_is_used_and_equals_reference(on_gpu, kernels_unforced, ratio, width, lengths):
    """Flash's compressors over prefill chunks meeting 0 and several waiting tokens: the pooled rows within the
    tolerance, the frontier exactly."""
    for args in chunk_sequence(ratio, width, lengths):
        got = POOL_CHUNK(*args)
        assert POOL_CHUNK.fast_path.decisions()[registry.current_backend(), (ratio, width)].fast
        want = pool_chunk(*args)
        assert mx.max(mx.abs(got[0] - want[0])).item() <= TOLERANCE * mx.max(mx.abs(want[0])).item()
        assert mx.array_equal(got[1], want[1]).item() and mx.array_equal(got[2], want[2]).item()


def test_a_chunks_pooling_is_one_launch_on_gpu_backends(on_cpu):
    """Planned for CUDA: a ratio-4 chunk that finishes rows pools them in one kernel (no join, softmax or gather of
    ops); one that finishes none, or a float16 one, takes the reference's ops."""
    args = next(chunk_sequence(4, 512, (64,)))
    mx.eval(*args[:5])
    with registry.planning("cuda"):
        nodes = graph_nodes(list(POOL_CHUNK(*args)))
    assert Counter(n for n in nodes.values() if n not in VIEWS) == {STAND_IN: 1}
    short = (*(a[:2] for a in args[:2]), *args[2:])  # two tokens: no window finished
    half = (args[0].astype(mx.float16), *args[1:])  # the kernel reads float32 alone
    mx.eval(half[0])
    with registry.planning("cuda"):
        assert POOL_CHUNK(*short)[0].shape == (0, 512)
        assert STAND_IN not in graph_nodes(list(POOL_CHUNK(*half))).values()


def test_pair_on_the_cpu_is_the_two_steps(on_cpu, kernels_unforced):
    for position in (0, 2, 3):
        args = pair_args(position)
        for got, want in zip(POOL_STEP_PAIR(*args), pair_reference(*args)):
            assert all(mx.array_equal(g, w) for g, w in zip(got, want))
    assert all(backend != "cpu" for backend, _ in POOL_STEP_PAIR.fast_path.decisions())


@pytest.mark.gpu
@pytest.mark.parametrize("position", PAIR_POSITIONS)
def test_pair_kernel_is_used_and_equals_the_two_steps(on_gpu, kernels_unforced, position):
    args = pair_args(position)
    got = POOL_STEP_PAIR(*args)
    assert POOL_STEP_PAIR.fast_path.decisions()[registry.current_backend(), (4, 512, 128)].fast
    for g, w in zip(got, pair_reference(*args)):
        assert_close(g, w)


@pytest.mark.gpu
def test_pair_kernel_under_compile_across_windows(on_gpu, kernels_unforced):
    """Compiled with the position as an array, tokens fed through window boundaries on the frontiers it leaves."""
    assert POOL_STEP_PAIR.fast_path.enabled((4, 512, 128))
    compiled = mx.compile(lambda a, b, position: POOL_STEP_PAIR(a, b, position, 4, 512, 128))
    a, b = pair_args(0)[:2]
    for position in range(10):
        a = (*(random_activations((1, 1024), seed=200 + 2 * position + k) for k in range(2)), *a[2:])
        b = (*(random_activations((1, 256), seed=300 + 2 * position + k) for k in range(2)), *b[2:])
        p = mx.array(position, dtype=mx.int32)
        got, want = compiled(a, b, p), pair_reference(a, b, p, 4, 512, 128)
        for g, w in zip(got, want):
            assert_close(g, w)
        a, b = (*a[:3], *want[0][1:]), (*b[:3], *want[1][1:])
