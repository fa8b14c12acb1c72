"""Custom kernels' CUDA and Metal texts run on the CPU by emulated_cuda.py and emulated_metal.py (one std::thread
per GPU thread), each test once per backend, against their references: the dequant-matvecs (IQ2_XXS, Q2_K), the
half and affine matvecs (with and without the input norm folded in), the hyper-connection pre, split, update and
post+pre, the compressor's decode step, the FP8 KV rounding and the fused expert kernels (gate + up + SwiGLU, down
summed over the slots). Each runs as its wrapper launches it where the wrapper calls `build` (emulated_build stands
in), otherwise with the wrapper's templates and grid spelled out here. The indexer's emulated tests are in
test_kernels_indexer.py.

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py,
test_kernels_half.py, test_kernels_affine_matvec.py, test_kernels_hc.py, test_kernels_compressor.py,
test_kernels_actquant.py and test_kernels_experts.py check the same kernels through MLX on the device.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels
from ds4_mlx.kernels.decode import affine_matvec, experts, half
from ds4_mlx.kernels.sublayers import compressor, hc
from ds4_mlx.kernels.sublayers.actquant import FP8_KERNEL, FP8_THREADS
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.sublayers.compressor import LAYOUTS, STEP_KERNEL
from ds4_mlx.kernels.sublayers.compressor import TOLERANCE as STEP_TOLERANCE
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.dialect import Kernel
from ds4_mlx.kernels.machinery.registry import KernelFallbackWarning
from ds4_mlx.kernels.decode.fused_norm import Norm, apply, probe_norm
from ds4_mlx.kernels.decode.half import HALF_MATVEC_KERNEL, SIMDS, reference, split_plan
from ds4_mlx.kernels.decode.half import TOLERANCE as HALF_TOLERANCE
from ds4_mlx.kernels.decode.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.decode.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.decode.q2_k import Q2_K_MATVEC
from ds4_mlx.kernels.formats.quants import dequantize
from ds4_mlx.model.compressor import POOL_CHUNK, POOL_STEP, POOL_STEP_PAIR, Frontier, pool_chunk, pool_step
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType
from ds4_mlx.model.hyper_connection import mix, post_pre, pre, split, update
from ds4_mlx.model.moe import DOWN_SUM, GATE_UP
from ds4_mlx.model.quant_sim import kv_fp8
import emulated_cuda
import emulated_metal
from emulated_cuda import emulated, emulated_build
from test_kernels_half import random_half

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings(f"error::{KernelFallbackWarning.__module__}.KernelFallbackWarning")]

BACKEND = "cuda"
"""The backend whose text the running test emulates (set by `backend`)."""


@pytest.fixture(autouse=True, params=["cuda", "metal"])
def backend(request, monkeypatch) -> str:
    """Each test once on each backend's text: `emulated`, `emulated_build` and BACKEND here are that backend's; on
    Metal the kernels modules' wrappers build for "metal" (their launches then held to Apple's limits), while the
    registry still answers "cpu", so that the references the tests compute stay references."""
    module = sys.modules[__name__]
    emulation = {"cuda": emulated_cuda, "metal": emulated_metal}[request.param]
    monkeypatch.setattr(module, "BACKEND", request.param)
    monkeypatch.setattr(module, "emulated", emulation.emulated)
    monkeypatch.setattr(module, "emulated_build", emulation.emulated_build)
    if request.param == "metal":
        for info in pkgutil.walk_packages(ds4_mlx.kernels.__path__, "ds4_mlx.kernels."):
            kernels_module = importlib.import_module(info.name)
            if hasattr(kernels_module, "current_backend") and kernels_module is not registry:
                monkeypatch.setattr(kernels_module, "current_backend", lambda: "metal")
    return request.param


@pytest.mark.parametrize("matvec", [IQ2_XXS_MATVEC, Q2_K_MATVEC], ids=lambda m: m.ggml_type.name)
@pytest.mark.parametrize("size", [(64, 256), (40, 512), (24, 2048), (20, 4096)], ids=str)
def test_emulated_quant_matvec_equals_the_reference(matvec: QuantMatvec, size, tmp_path):
    """Rows staged by 2-byte (256, 512) and 16-byte loads (2048, 4096), threadgroups left partly idle by row
    counts that do not divide, several experts and slots."""
    n_out, n_in = size
    shape = (3, n_out, n_in)
    block_values, block_bytes = BLOCK_SIZES[matvec.ggml_type]
    row_bytes = n_in // block_values * block_bytes
    simds, rows = launch_plan(row_bytes)
    blocks = random_blocks(matvec.ggml_type, 3 * n_out, n_in, seed=n_in).reshape(3, -1)
    ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    x = random_activations((4, n_in), seed=n_out)
    want = np.array(gathered_reference(x, blocks, ids, matvec.ggml_type, shape))
    template = {"OUT": n_out, "IN": n_in, "ROW_BYTES": row_bytes, "UNITS": n_in // matvec.unit_values,
                "SIMDS": simds, "ROWS": rows}
    (got,) = emulated(matvec.kernel, template, tmp_path)(
        [np.array(x), np.array(blocks), np.array(ids)], [want.shape], (-(-n_out // (simds * rows)), ids.size),
        simds * 32)
    assert np.isfinite(got).all()  # every output row was written
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


def row_scaled(x: mx.array, norm: Norm | None) -> mx.array:
    """With a norm, rows 1x to 16x away from unit rms, so that each row's own 1 / rms matters."""
    return x if norm is None else x * mx.linspace(1.0, 16.0, x.shape[0])[:, None]


@pytest.mark.parametrize(("n_out", "n_in", "tokens"), [(100, 768, 1), (60, 4096, 5), (520, 1024, 3),
                                                       (1030, 4096, 1), (8195, 1024, 2)], ids=str)
def test_emulated_half_matvec_with_the_input_norm_equals_the_reference(n_out, n_in, tokens, monkeypatch, tmp_path):
    """Splits 1, 8, 4, 8 and 1 (the sum of squares over a row's parts), the last two four rows a SIMD group, through
    half.py's wrapper."""
    monkeypatch.setattr(half, "build", emulated_build(tmp_path))
    w = random_half((n_out, n_in), seed=n_in)
    norm = probe_norm(n_in, 1e-6, seed=n_out)
    x = row_scaled(random_activations((tokens, n_in), seed=n_out), norm)
    got = np.array(half._kernel(x, w, norm))
    want = np.array(reference(x, w, norm))
    assert np.isfinite(got).all()  # every output was written
    assert np.abs(got - want).max() <= HALF_TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize(("n_out", "n_in", "tokens"), [(100, 256, 1), (100, 768, 8), (60, 4096, 5), (520, 1024, 5),
                                                       (1030, 4096, 1), (515, 4096, 2), (2050, 1024, 3),
                                                       (8195, 1024, 1)], ids=str)
def test_emulated_half_matvec_equals_the_reference(n_out, n_in, tokens, tmp_path):
    """Every split (1, 8, 4 SIMD groups a row) at one, two and four rows a SIMD group, threadgroups and SIMD groups
    left partly idle by row counts that do not divide, one token and several."""
    w = random_half((n_out, n_in), seed=n_in)
    x = random_activations((tokens, n_in), seed=n_out)
    split, rps = split_plan(n_out, n_in)
    template = {"OUT": n_out, "IN": n_in, "TOKENS": tokens, "SPLIT": split, "RPS": rps, "SIMDS": SIMDS}
    (got,) = emulated(HALF_MATVEC_KERNEL, template, tmp_path)(
        [np.array(x), np.array(w)], [(tokens, n_out)], (-(-n_out // (SIMDS // split * rps)), 1), SIMDS * 32)
    want = np.array(reference(x, w))
    assert np.isfinite(got).all()  # every output was written
    assert np.abs(got - want).max() <= HALF_TOLERANCE * np.abs(want).max()


def through_emulation(monkeypatch, tmp_path) -> None:
    """kernels/sublayers/hc.py's `build` made to return the emulated kernel behind MLX's calling convention (float32
    buffers but an int32 token count, `grid` in threads), so the wrappers' own templates and grids are what runs."""
    emulated_kernel = emulated_build(tmp_path)

    def build(kernel: Kernel, backend: str) -> Callable:
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes) -> list[mx.array]:
            dtypes = [mx.int32 if name == "count" else mx.float32 for name in kernel.inputs]
            assert [a.dtype for a in inputs] == dtypes and set(output_dtypes) == {mx.float32}
            return emulated_kernel(kernel, backend)(inputs, template, grid, threadgroup, output_shapes, output_dtypes)

        return call

    monkeypatch.setattr(hc, "build", build)


def assert_close(got: tuple, want: tuple) -> None:
    for g, w in zip(got, want, strict=True):
        g, w = np.array(g), np.array(w)
        assert g.shape == w.shape and np.isfinite(g).all()  # every output was written
        assert np.abs(g - w).max() <= hc.TOLERANCE * np.abs(w).max()


@pytest.mark.parametrize("shape", [(1, 4, 4096), (5, 4, 512), (3, 2, 320)], ids=str)
def test_emulated_hc_pre_equals_the_reference(shape, monkeypatch, tmp_path):
    """Flash's width for one token; several tokens, and a width that leaves a collapse group partly idle (n = 2)."""
    tokens, n, d = shape
    m = (2 + n) * n
    args = (random_activations((tokens, n, d), seed=d), random_activations((m, n * d), seed=1) * (2 / (n * d) ** 0.5),
            1.0 + 0.2 * random_activations((3,), seed=2), 0.5 * random_activations((m,), seed=3), 20, 1e-6, 1e-6)
    assert hc.HCPre.fits(*args[:2])
    want = pre(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close(hc.HCPre._kernel(*args), want)


@pytest.mark.parametrize("shape", [(42, 4, 4096), (37, 2, 320)], ids=str)
def test_emulated_hc_mix_equals_the_reference(shape, monkeypatch, tmp_path):
    """A chunk's mix at Flash's width, the last threadgroup partly idle (a group of tokens with two of its eight, two
    with none); a narrower one with 8 fn rows and five slices."""
    tokens, n, d = shape
    m = (2 + n) * n
    args = (random_activations((tokens, n * d), seed=d), random_activations((m, n * d), seed=9) * (2 / (n * d) ** 0.5),
            1e-6)
    want = mix(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close((hc.HCMix._kernel(*args),), (want,))


@pytest.mark.parametrize("n", [4, 2])
def test_emulated_hc_split_equals_the_reference(n, monkeypatch, tmp_path):
    """The split kernel of prefill chunks, its Sinkhorn one lane per comb entry."""
    tokens, d, m = 3, 1000, (2 + n) * n
    args = (random_activations((tokens, m), seed=5) * 3.0, random_activations((3,), seed=6),
            random_activations((m,), seed=7), random_activations((tokens, n, d), seed=8), 20, 1e-6)
    want = split(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close(hc.HCSplit._kernel(*args), want)


def post_pre_args(tokens: int, n: int, d: int, addends: int) -> tuple:
    """An update's inputs (comb rows a softmax, as near-stochastic as the Sinkhorn's), then a pre's (as above)."""
    m = (2 + n) * n
    return (random_activations((tokens, d), seed=d + 1),
            random_activations((tokens, d), seed=d + 2) if addends == 2 else None,
            random_activations((tokens, n, d), seed=d), 2 * mx.sigmoid(random_activations((tokens, n), seed=4)),
            mx.softmax(random_activations((tokens, n, n), seed=5), axis=-1),
            random_activations((m, n * d), seed=1) * (2 / (n * d) ** 0.5), 1.0 + 0.2 * random_activations((3,), seed=2),
            0.5 * random_activations((m,), seed=3), 20, 1e-6, 1e-6)


@pytest.mark.parametrize("addends", [2, 1])
@pytest.mark.parametrize("shape", [(1, 4, 4096), (5, 4, 512), (3, 2, 320), (2, 4, 96)], ids=str)
def test_emulated_hc_post_pre_equals_the_reference(shape, addends, monkeypatch, tmp_path):
    """Flash's width for one token; several tokens; 128-value slices that straddle two streams (n = 2, D = 320) and a
    width below one collapse group (D = 96). Two addends are the MoE's routed and shared outputs."""
    args = post_pre_args(*shape, addends)
    assert hc.HCPostPre.fits(*args[:6])
    want = post_pre(*args)
    through_emulation(monkeypatch, tmp_path)
    assert_close(hc.HCPostPre._kernel(*args), want)


@pytest.mark.parametrize("addends", [2, 1])
@pytest.mark.parametrize("shape", [(1, 4, 4096), (3, 4, 1000)], ids=str)
def test_emulated_hc_update_equals_the_reference(shape, addends, monkeypatch, tmp_path):
    """The update alone (before the head; longer chunks), its output whole or as two addends."""
    out, addend, streams, post, comb = post_pre_args(*shape, addends)[:5]
    want = update(out, streams, post, comb, addend)
    through_emulation(monkeypatch, tmp_path)
    assert_close((hc.HCUpdate._kernel(out, streams, post, comb, addend),), (want,))


@pytest.mark.parametrize(("bits", "size", "tokens", "plan"), [
    (8, (9, 512), 1, (4, 1)),  # the last threadgroup one row deep
    (8, (7, 1024), 3, (2, 2)),
    (8, (5, 4096), 5, (2, 4)),
    (8, (3, 768), 8, (1, 3)),  # 48 loads a row for 96 threads: some idle in the only step
    (8, (17, 2048), 1, (4, 1)),  # two steps a thread
    (8, (19, 1024), 1, (8, 2)),  # eight rows a threadgroup (decode's plan), the last one three deep
    (4, (9, 512), 1, (4, 1)),
    (4, (5, 1024), 2, (4, 2)),
    (4, (3, 2048), 8, (2, 1)),
], ids=str)
def test_emulated_affine_matvec_equals_the_reference(bits, size, tokens, plan, monkeypatch, tmp_path):
    """One matrix for several tokens, or (one token) a bank of three matrices with four slots picking them; through
    kernels/decode/affine_matvec.py's own wrapper (templates, grid), with `build` returning the emulated kernel."""
    check_affine_matvec(bits, size, tokens, plan, None, monkeypatch, tmp_path)


@pytest.mark.parametrize(("bits", "size", "tokens", "plan"), [
    (8, (9, 512), 1, (4, 1)),  # a bank: each slot's row normed by its own sum of squares
    (8, (11, 4096), 1, (8, 4)),
    (8, (5, 4096), 5, (2, 4)),
    (8, (3, 768), 8, (1, 3)),  # threads idle in the only step add no squares
    (4, (5, 1024), 2, (4, 2)),
], ids=str)
def test_emulated_affine_matvec_with_the_input_norm_equals_the_reference(bits, size, tokens, plan, monkeypatch,
                                                                        tmp_path):
    """The normed kernel against rms_norm then the product, rows of different scales (each its own rms)."""
    norm = probe_norm(size[1], 1e-6, seed=size[1])
    check_affine_matvec(bits, size, tokens, plan, norm, monkeypatch, tmp_path)


def check_affine_matvec(bits, size, tokens, plan, norm, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(affine_matvec, "build", emulated_build(tmp_path))
    n_out, n_in = size
    ggml_type = GGMLType.Q8_0 if bits == 8 else GGMLType.Q4_K
    experts = 3 if tokens == 1 else 1
    shape = (experts, n_out, n_in)
    blocks = random_blocks(ggml_type, experts * n_out, n_in, seed=n_in + tokens)
    w = np.array(dequantize(blocks, ggml_type, shape))
    if experts > 1:
        weight, ids = to_affine(blocks, ggml_type, shape), mx.array([2, 0, 2, 1], dtype=mx.uint32)
        x = row_scaled(random_activations((ids.size, n_in), seed=n_out), norm)
        normed = np.array(apply(x, norm))
        want = np.stack([normed[i] @ w[ids[i].item()].T for i in range(ids.size)])
    else:
        weight, ids = to_affine(blocks, ggml_type, shape[1:]), None
        x = row_scaled(random_activations((tokens, n_in), seed=n_out), norm)
        want = np.array(apply(x, norm)) @ w[0].T
    got = np.array(affine_matvec.AFFINE_MATVEC.fast(x, weight, ids, plan, norm))
    assert got.shape == want.shape and np.isfinite(got).all()  # every output was written
    assert np.abs(got - want).max() <= affine_matvec.TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize(("ratio", "width", "positions"), [(4, 512, range(10)), (4, 128, (3, 4, 1001)),
                                                           (128, 512, (5, 127, 128))], ids=str)
def test_emulated_compressor_step_equals_the_reference(ratio, width, positions, tmp_path):
    """Tokens fed through window boundaries (the frontier shifting or emptying), each on the frontier the
    reference left; every pooled dim and frontier value written."""
    coff = 2 if ratio == 4 else 1
    cols, threads = LAYOUTS[ratio]
    template = {"R": ratio, "D": width, "COFF": coff, "COLS": cols, "THREADS": threads}
    frontier = Frontier.empty(ratio, width)
    frontier_kv = mx.where(mx.arange(coff * ratio)[:, None] < coff * ratio - 1,
                           random_activations(frontier.kv.shape, seed=3), 0.0)
    frontier_score = mx.where(frontier_kv != 0, 3 * random_activations(frontier.kv.shape, seed=4), -mx.inf)
    ape = random_activations((ratio, coff * width), seed=5)
    run = emulated(STEP_KERNEL, template, tmp_path)
    for position in positions:
        kv, score = (random_activations((1, coff * width), seed=10 * position + k) for k in range(2))
        args = (kv, score, ape, frontier_kv, frontier_score, mx.array(position, dtype=mx.int32))
        want = [np.array(w) for w in pool_step(*args, ratio, width)]
        inputs = [np.array(a) for a in args[:5]] + [np.array([position], np.int32)]
        pooled, new_kv, new_score = run(inputs, [w.shape for w in want], (width // cols, 1), threads)
        assert np.isfinite(pooled).all() and not np.isnan(new_kv).any() and not np.isnan(new_score).any()
        assert np.abs(pooled - want[0]).max() <= STEP_TOLERANCE * np.abs(want[0]).max()
        assert np.array_equal(new_kv, want[1]) and np.array_equal(new_score, want[2])
        frontier_kv, frontier_score = mx.array(want[1]), mx.array(want[2])


def random_frontier(ratio: int, width: int, seed: int) -> tuple[mx.array, mx.array]:
    """A frontier with every row but the last holding a token (kv, score), the last one empty (0, -inf)."""
    coff = 2 if ratio == 4 else 1
    shape = Frontier.empty(ratio, width).kv.shape
    kv = mx.where(mx.arange(coff * ratio)[:, None] < coff * ratio - 1, random_activations(shape, seed=seed), 0.0)
    return kv, mx.where(kv != 0, 3 * random_activations(shape, seed=seed + 1), -mx.inf)


@pytest.mark.parametrize(("ratio", "widths", "positions"), [
    (4, (512, 128), range(10)),  # Flash: attention and indexer rows, slots 0..3 of three windows
    (4, (512, 128), (1001, 1002, 1003, 1004)),
    (4, (36, 4), (0, 2, 3)),  # one threadgroup for the second compressor
    (4, (4, 44), (1, 3)),
    (128, (64, 24), (5, 127, 128)),  # the layout with several SIMD groups per dim (two barriers)
], ids=str)
def test_emulated_compressor_step_pair_equals_the_two_steps(ratio, widths, positions, monkeypatch, tmp_path):
    """The pair kernel as POOL_STEP_PAIR launches it, tokens fed through window boundaries on the frontiers the
    references leave: equal to the two references (pooled rows within the tolerance, frontiers exactly) and, bit
    for bit, to the one-compressor kernel run on each compressor (the same text, the same arithmetic)."""
    monkeypatch.setattr(compressor, "build", emulated_build(tmp_path))
    monkeypatch.setattr(compressor, "current_backend", lambda: BACKEND)
    coff = 2 if ratio == 4 else 1
    steps = [[None, None, random_activations((ratio, coff * w), seed=5 + w), *random_frontier(ratio, w, w)]
             for w in widths]  # kv, score (each token's own), ape, frontier kv and score
    for position in positions:
        for k, (step, width) in enumerate(zip(steps, widths)):
            step[:2] = [random_activations((1, coff * width), seed=10 * position + 2 * k + i) for i in range(2)]
        p = mx.array(position, dtype=mx.int32)
        got = POOL_STEP_PAIR.fast_path.fast(*steps[0], *steps[1], p, ratio, *widths)
        for k, (step, width) in enumerate(zip(steps, widths)):
            want = pool_step(*step, p, ratio, width)
            single = POOL_STEP.fast_path.fast(*step, p, ratio, width)
            pooled, new_kv, new_score = (np.array(y) for y in got[3 * k : 3 * k + 3])
            assert np.isfinite(pooled).all() and not np.isnan(new_kv).any() and not np.isnan(new_score).any()
            assert np.abs(pooled - np.array(want[0])).max() <= STEP_TOLERANCE * np.abs(np.array(want[0])).max()
            assert np.array_equal(new_kv, np.array(want[1])) and np.array_equal(new_score, np.array(want[2]))
            assert all(np.array_equal(np.array(g), np.array(s)) for g, s in zip(got[3 * k : 3 * k + 3], single))
            step[3:] = want[1:]


@pytest.mark.parametrize(("ratio", "width", "lengths"), [
    (4, 512, (13, 6, 9, 4)),  # Flash's attention rows: chunks meeting 0, 1, 3 and 0 waiting tokens
    (4, 128, (5, 3, 8)),  # the indexer's
    (128, 64, (130, 300, 126)),  # 2 and 46 waiting; one chunk finishing two windows
], ids=str)
def test_emulated_compressor_chunk_equals_the_reference(ratio, width, lengths, monkeypatch, tmp_path):
    """Chunks fed one after another as POOL_CHUNK launches them, each on the frontier the reference left: pooled rows
    within the step's tolerance, the new frontier exactly (its empty rows 0 and -inf)."""
    monkeypatch.setattr(compressor, "build", emulated_build(tmp_path))
    monkeypatch.setattr(compressor, "current_backend", lambda: BACKEND)
    coff = 2 if ratio == 4 else 1
    ape = random_activations((ratio, coff * width), seed=7)
    frontier = Frontier.empty(ratio, width)
    frontier_kv, frontier_score = frontier.kv, frontier.score
    n_past = 0
    for t in lengths:
        kv, score = (random_activations((t, coff * width), seed=n_past + k) for k in range(2))
        args = (kv, score, ape, frontier_kv, frontier_score, n_past, ratio, width)
        want = [np.array(w) for w in pool_chunk(*args)]
        pooled, new_kv, new_score = (np.array(g) for g in POOL_CHUNK.fast_path.fast(*args))
        assert pooled.shape == want[0].shape and want[0].shape[0] >= 1 and np.isfinite(pooled).all()
        assert np.abs(pooled - want[0]).max() <= STEP_TOLERANCE * np.abs(want[0]).max()
        assert np.array_equal(new_kv, want[1]) and np.array_equal(new_score, want[2])
        frontier_kv, frontier_score, n_past = mx.array(want[1]), mx.array(want[2]), n_past + t


@pytest.mark.parametrize(("rows", "width", "n_rot"), [(1, 512, 64), (7, 512, 64), (3, 192, 64), (2, 512, 0)])
def test_emulated_fp8_kv_is_exact(rows, width, n_rot, tmp_path):
    """Rows from 1e-8 to 1e4 in scale (floors, subnormal steps, saturation); a threadgroup partly idle (3 x 3)."""
    x = random_activations((rows, width), seed=rows) * mx.power(10.0, mx.linspace(-8, 4, rows))[:, None]
    want = np.array(kv_fp8(x, n_rot))
    threads = rows * (width // 64) * 32
    template = {"R": rows, "W": width, "NROT": n_rot, "THREADS": FP8_THREADS}
    (got,) = emulated(FP8_KERNEL, template, tmp_path)(
        [np.array(x)], [want.shape], (-(-threads // FP8_THREADS), 1), FP8_THREADS)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


FUSED_CASES = {  # (OUT, IN) and the (T, k) routing
    "tiny": ((256, 256), [[1, 3]]),
    "two_tokens": ((64, 512), [[0, 2, 2, 1], [3, 3, 0, 1]]),
    "three_tokens": ((96, 1024), [[1, 2], [0, 0], [3, 1]]),
    "eight_simds": ((1024, 2048), [[3, 0, 1, 2, 2, 1]]),
}


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_emulated_fused_expert_kernels_equal_their_references(ggml_type, case, tmp_path, monkeypatch):
    """Rows staged in 2-, 4- and 16-byte words, several tokens, repeated experts, 1 to 8 SIMD groups per
    threadgroup; each kernel as its FastPath launches it (templates, grid), against the FastPath's reference."""
    monkeypatch.setattr(experts, "build", emulated_build(tmp_path))
    monkeypatch.setattr(experts, "current_backend", lambda: BACKEND)
    (n_out, n_in), routing = FUSED_CASES[case]
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (4, n_out, n_in)
    gate, up, down = (random_blocks(ggml_type, 4 * n_out, n_in, seed=s).reshape(4, -1) for s in (1, 2, 3))
    x = random_activations((ids.shape[0], n_in), seed=4)
    w = mx.array(np.random.default_rng(5).uniform(0.1, 1.5, ids.shape).astype(np.float32))
    args = (x, ids, w, gate, up, ggml_type, shape, 10.0)
    got, want = GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)
    assert np.isfinite(np.array(got)).all()
    assert mx.abs(got - want).max().item() <= experts.GATE_UP_TOLERANCE * mx.abs(want).max().item()
    h = random_activations((ids.size, n_in), seed=6)
    got, want = DOWN_SUM.fast_path.fast(h, ids, down, ggml_type, shape), DOWN_SUM.fast_path.reference(
        h, ids, down, ggml_type, shape)
    assert np.isfinite(np.array(got)).all()
    assert mx.abs(got - want).max().item() <= experts.TOLERANCE * mx.abs(want).max().item()


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_emulated_fused_expert_gate_up_with_the_input_norm_equals_the_reference(ggml_type, case, tmp_path, monkeypatch):
    """The normed gate/up kernel (x normed while staged) against rms_norm then the reference, tokens 1x to 16x away
    from unit rms (each normed by its own sum of squares), 1 to 8 SIMD groups adding their partial sums."""
    monkeypatch.setattr(experts, "build", emulated_build(tmp_path))
    monkeypatch.setattr(experts, "current_backend", lambda: BACKEND)
    (n_out, n_in), routing = FUSED_CASES[case]
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (4, n_out, n_in)
    gate, up = (random_blocks(ggml_type, 4 * n_out, n_in, seed=s).reshape(4, -1) for s in (1, 2))
    norm = probe_norm(n_in, 1e-6, seed=n_in)
    x = row_scaled(random_activations((ids.shape[0], n_in), seed=4), norm)
    w = mx.array(np.random.default_rng(5).uniform(0.1, 1.5, ids.shape).astype(np.float32))
    args = (x, ids, w, gate, up, ggml_type, shape, 10.0, norm)
    got, want = GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)
    assert np.isfinite(np.array(got)).all()
    assert mx.abs(got - want).max().item() <= experts.GATE_UP_TOLERANCE * mx.abs(want).max().item()
    plain = GATE_UP.fast_path.reference(apply(x, norm), ids, w, gate, up, ggml_type, shape, 10.0)
    assert mx.array_equal(want, plain)  # the reference: rms_norm, then today's
