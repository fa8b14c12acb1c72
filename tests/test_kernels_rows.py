"""The finish-rows kernel (kernels/sublayers/rows.py) against `finish_rows` in model/quant_sim.py: norm, RoPE, FP8 /
FP4, float16.

At Flash's shapes: the KV row (512 wide, 64 RoPE dims: kv_norm, RoPE, FP8, float16), the compressors' rows (512 wide
with FP8, 128 wide with Hadamard + FP4, each normed) and the indexer's queries (64 heads of 128: RoPE, Hadamard +
FP4), and small odd ones. `steady_rows` inputs compare to TOLERANCE alone; random inputs may round a value that
lies within a few ulps of a rounding boundary the other way (`assert_finished`). On the GPU through MLX (gpu
marker), and on the CPU through the kernel's CUDA text compiled by g++ (emulated_cuda.py, slow marker); the CPU tests
pin the reference and the probe inputs.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.sublayers import actquant, rows
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.sublayers.actquant import FP4_KERNEL, FP8_KERNEL
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.sublayers.rows import FINISH_KERNEL, TOLERANCE, WINDOW_KERNEL, RowQuant, steady_rows
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.quant_sim import FINISH_INTO_WINDOW, FINISH_ROWS, indexer_fp4, round_to_f16, simulate_indexer_fp4, simulate_kv_fp8
from ds4_mlx.model.rope import RoPE, Yarn
from emulated_cuda import emulated, emulated_build
from kernel_checks import balanced, rendered

FP8, FP4, NONE = RowQuant.KV_FP8, RowQuant.INDEXER_FP4, RowQuant.NONE
FLASH_ROPE = RoPE(64, 160000.0, Yarn(16.0, 65536, 32.0, 1.0))  # compressed layers' RoPE
CASES = {  # shape (T, ..., W), n_rot, norm ("none", "unweighted", "weighted"), quant, float16 round
    "kv_row": ((1, 512), 64, "weighted", FP8, True),
    "compressor_row": ((1, 512), 64, "weighted", FP8, False),
    "indexer_row": ((1, 128), 64, "weighted", FP4, False),
    "indexer_queries": ((1, 64, 128), 64, "none", FP4, False),
    "prefill_kv_rows": ((5, 512), 64, "weighted", FP8, True),  # several positions
    "odd_fp8": ((3, 2, 192), 64, "unweighted", FP8, False),  # 6 SIMD groups, two rows a position
    "all_rope": ((2, 64), 64, "unweighted", NONE, True),
    "plain": ((4, 320), 16, "weighted", NONE, False),
    "fp4_queries": ((3, 4, 128), 32, "none", FP4, True),
}


def case_args(name: str, steady: bool, seed: int = 0) -> tuple:
    """The FINISH_ROWS arguments of a case: inputs built by steady_rows, or random rows of an activation's spread
    (a norm's input of any scale, RoPE'd queries of unit scale); positions up to 10^6."""
    shape, n_rot, kind, quant, half = CASES[name]
    rope = FLASH_ROPE if n_rot == 64 else RoPE(n_rot, 10000.0)
    rng = np.random.default_rng(seed)
    positions = mx.array(rng.integers(0, 1_000_000, shape[0]).astype(np.int32))
    weight = mx.array(rng.uniform(0.3, 2.0, shape[-1]).astype(np.float32))
    norm = None if kind == "none" else (None if kind == "unweighted" else weight, 1e-6)
    if steady:
        x = steady_rows(shape, positions, rope, norm, quant, seed=seed)
    else:
        x = mx.array((rng.standard_normal(shape) * (30.0 if norm else 1.0)).astype(np.float32))
    return x, positions, rope, norm, quant, half


def composed(x, positions, rope, norm, quant, half) -> mx.array:
    """The model's composition before the kernel: rms_norm, RoPE, the simulation, the float16 round."""
    if norm is not None:
        x = rms_norm(x, *norm)
    x = rope(x, positions)
    x = simulate_kv_fp8(x, rope.n_rot) if quant == FP8 else simulate_indexer_fp4(x) if quant == FP4 else x
    return round_to_f16(x) if half else x


def rounded_dims(x: mx.array, rope: RoPE, quant: RowQuant, half: bool) -> np.ndarray:
    """Which dims of the output end in a rounding (FP8, FP4 or float16): on steady rows those are exact."""
    dims = np.full(x.shape[-1], half or quant == FP4)
    if quant == FP8:
        dims[: x.shape[-1] - rope.n_rot] = True
    return dims


def assert_steady(got: mx.array, want: mx.array, args: tuple) -> None:
    """Steady rows: the rounded dims equal, the others within TOLERANCE."""
    x, _, rope, _, quant, half = args
    dims = rounded_dims(x, rope, quant, half)
    assert_finished(got, want)
    assert np.array_equal(np.array(got)[..., dims], np.array(want)[..., dims])


def assert_finished(got: mx.array, want: mx.array, flips: float = 0.0) -> None:
    """Within TOLERANCE of the largest value, but for at most `flips` of the values (and one): those a rounding
    boundary apart, each at most a third of its row's largest value (an FP4 step 4 -> 6)."""
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape and np.isfinite(got).all()  # every value written
    error = np.abs(got - want)
    off = error > TOLERANCE * np.abs(want).max()
    assert off.sum() <= (1 + flips * off.size if flips else 0), f"{off.sum()} of {off.size} values differ"
    row_max = np.abs(want).max(axis=-1, keepdims=True)
    assert (error <= np.maximum(TOLERANCE * np.abs(want).max(), row_max / 3 + 1e-30)).all()


def test_reference_is_the_models_former_composition(on_cpu):
    """CPU outputs stay bit-identical: FINISH_ROWS answers with exactly what the model composed before."""
    for name in CASES:
        args = case_args(name, steady=False, seed=1)
        assert mx.array_equal(FINISH_ROWS(*args), composed(*args)), name


def test_cpu_takes_the_reference(on_cpu, kernels_unforced):
    args = case_args("kv_row", steady=False)
    assert mx.array_equal(FINISH_ROWS(*args), FINISH_ROWS.fast_path.reference(*args))
    assert not FINISH_ROWS.fast_path.enabled((512, 64, "weighted", FP8, True))


@pytest.mark.parametrize("name", CASES)
def test_steady_rows_stay_on_their_grid_points(on_cpu, name):
    """A relative 3e-6 jitter of the inputs (far more than a reassociated sum or cos moves them) changes no rounded
    value: the probe's and the tests' steady inputs cannot flip a rounding."""
    args = case_args(name, steady=True, seed=2)
    x, positions, rope, norm, quant, half = args
    want = composed(*args)
    for seed in range(3):
        jitter = 1 + 3e-6 * mx.array(np.random.default_rng(seed).uniform(-1, 1, x.shape).astype(np.float32))
        got = composed(x * jitter, positions, rope, norm, quant, half)
        assert registry.disagreement(got, want, 3e-5) is None
        dims = rounded_dims(x, rope, quant, half)
        assert np.array_equal(np.array(got)[..., dims], np.array(want)[..., dims])
    if quant != NONE:  # and the values are quantised: the simulation moves them
        unquantised = composed(x, positions, rope, norm, NONE, False)
        assert registry.disagreement(want, unquantised, 1e-3) is not None


def test_probe_inputs_are_steady(on_cpu):
    """The probe of every key the model uses is built by steady_rows."""
    for key in [(512, 64, "weighted", FP8, True), (512, 64, "weighted", FP8, False), (128, 64, "weighted", FP4, False),
                (128, 64, "none", FP4, False)]:
        x, positions, rope, norm, quant, half = rows.FinishRows._probe(key)
        assert x.shape == (3, 2, key[0]) and rope.n_rot == key[1] and rows.norm_kind(norm) == key[2]
        assert (quant, half) == key[3:]
        want = composed(x, positions, rope, norm, quant, half)
        jitter = 1 + 3e-6 * mx.array(np.random.default_rng(0).uniform(-1, 1, x.shape).astype(np.float32))
        got = composed(x * jitter, positions, rope, norm, quant, half)
        dims = rounded_dims(x, rope, quant, half)
        assert np.array_equal(np.array(got)[..., dims], np.array(want)[..., dims])


def test_rows_the_kernel_does_not_take_go_to_the_reference():
    rope = RoPE(64, 10000.0)
    x, positions = mx.zeros((1, 256)), mx.array([3], dtype=mx.int32)
    assert rows.fits(x, positions, rope, None, FP8)
    assert not rows.fits(x, positions, rope, None, FP4)  # the Hadamard is 128 wide
    assert not rows.fits(mx.zeros((1, 224)), positions, rope, None, FP8)  # 224 is not whole SIMD groups
    assert not rows.fits(mx.zeros((1, 192)), positions, RoPE(32, 10000.0), None, FP8)  # 160 not whole FP8 blocks
    assert not rows.fits(x.astype(mx.float16), positions, rope, None, NONE)
    assert not rows.fits(x, positions, rope, (mx.ones((128,)), 1e-6), NONE)


@pytest.mark.parametrize("kernel", [FINISH_KERNEL, WINDOW_KERNEL, FP8_KERNEL, FP4_KERNEL, rows.join_kernel(3)],
                         ids=lambda k: k.name)
def test_one_definition_renders_for_cuda_and_metal(kernel):
    for target in (CUDA, METAL):
        out = rendered(kernel, target)
        text = out["source"] + out["header"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", text)
        assert balanced(out["source"]) and balanced(out["header"])
        for helper in set(re.findall(r"\b(?:ds4|aq)_\w+(?=\()", text)):
            assert re.search(rf"\b{helper}\([^;{{]*\)\s*{{", out["header"]), (target.name, helper)  # defined
    assert "__float2half_rn" in rendered(FINISH_KERNEL, CUDA)["header"]
    assert "metal::precise::cos" in rendered(FINISH_KERNEL, METAL)["header"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_equals_the_reference_on_steady_rows(name, monkeypatch, tmp_path):
    """Through the wrapper's own template and grid (build returning the emulated kernel): TOLERANCE alone."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    args = case_args(name, steady=True, seed=3)
    assert_steady(FINISH_ROWS.fast_path.fast(*args), FINISH_ROWS.fast_path.reference(*args), args)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_equals_the_reference_on_random_rows(name, monkeypatch, tmp_path):
    """Random rows: a rounding flipped by a few ulps is allowed to one value in a thousand."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    args = case_args(name, steady=False, seed=4)
    assert_finished(FINISH_ROWS.fast_path.fast(*args), FINISH_ROWS.fast_path.reference(*args), flips=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("key", [(512, 64, "weighted", FP8, True), (512, 64, "weighted", FP8, False),
                                 (128, 64, "weighted", FP4, False), (128, 64, "none", FP4, False),
                                 (192, 64, "unweighted", NONE, True)], ids=str)
def test_emulated_kernel_passes_its_probe(key, monkeypatch, tmp_path):
    """The first-use check as the registry makes it, on the keys the model uses (and one more)."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    args = rows.FinishRows._probe(key)
    got, want = FINISH_ROWS.fast_path.fast(*args), FINISH_ROWS.fast_path.reference(*args)
    assert registry.disagreement(got, want, TOLERANCE) is None
    assert_steady(got, want, args)


@pytest.mark.slow
def test_emulated_indexer_fp4_kernel_is_exact(tmp_path):
    """actquant's own Hadamard + FP4 kernel, on the helpers it now shares with the finish kernel: bit for bit, rows
    from 1e-30 to 1e4 in scale (the amax floor, subnormal steps, saturation), launched as IndexerFP4 launches it."""
    x = mx.array(np.random.default_rng(8).standard_normal((6, 128)).astype(np.float32))
    x = x * mx.array([1e-30, 1e-3, 1.0, 7.0, 300.0, 1e4])[:, None]
    (got,) = emulated(FP4_KERNEL, {}, tmp_path)([np.array(x)], [x.shape], (6, 1), actquant.HADAMARD_WIDTH)
    want = np.array(indexer_fp4(x))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_kernel_is_used_and_equals_the_reference(on_gpu, kernels_unforced, name):
    shape, n_rot, kind, quant, half = CASES[name]
    args = case_args(name, steady=True, seed=5)
    got = FINISH_ROWS(*args)
    assert FINISH_ROWS.fast_path.decisions()[registry.current_backend(), (shape[-1], n_rot, kind, quant, half)].fast
    assert_steady(got, FINISH_ROWS.fast_path.reference(*args), args)
    args = case_args(name, steady=False, seed=6)
    assert_finished(FINISH_ROWS(*args), FINISH_ROWS.fast_path.reference(*args), flips=1e-3)


WINDOW_CASES = {"flash_kv": ("kv_row", 128), "plain": ("all_rope", 5)}  # (CASES row, window rows)


def window_args(name: str, steady: bool, seed: int) -> tuple:
    """FINISH_INTO_WINDOW arguments: a one-row case of CASES and a random window of its width."""
    case, rows_ = WINDOW_CASES[name]
    x, positions, rope, norm, quant, half = case_args(case, steady, seed)
    x, positions = x[:1], positions[:1]
    window = mx.array(np.random.default_rng(seed + 100).standard_normal((rows_, x.shape[-1])).astype(np.float32))
    return x, positions, rope, norm, quant, half, window


def test_window_reference_is_the_steps_former_composition(on_cpu):
    args = window_args("flash_kv", steady=False, seed=1)
    want = mx.concatenate([args[-1][1:], composed(*args[:-1])])
    assert mx.array_equal(FINISH_INTO_WINDOW(*args), want)


@pytest.mark.slow
@pytest.mark.parametrize("name", WINDOW_CASES)
def test_emulated_window_kernel_shifts_and_finishes(name, monkeypatch, tmp_path):
    """The other rows move up exactly; the new last row is FINISH_ROWS's (steady inputs: TOLERANCE alone)."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    args = window_args(name, steady=True, seed=7)
    got, want = FINISH_INTO_WINDOW.fast_path.fast(*args), FINISH_INTO_WINDOW.fast_path.reference(*args)
    assert mx.array_equal(got[:-1], args[-1][1:])
    assert_steady(got[-1:], want[-1:], args[:-1])
    key = (args[-1].shape[0], args[0].shape[-1], args[2].n_rot, rows.norm_kind(args[3]), args[4], args[5])
    probe = rows.FinishIntoWindow._probe(key)
    assert registry.disagreement(FINISH_INTO_WINDOW.fast_path.fast(*probe),
                                 FINISH_INTO_WINDOW.fast_path.reference(*probe), TOLERANCE) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", WINDOW_CASES)
def test_window_kernel_is_used_and_shifts_and_finishes(on_gpu, kernels_unforced, name):
    args = window_args(name, steady=True, seed=8)
    got = FINISH_INTO_WINDOW(*args)
    assert all(d.fast for d in FINISH_INTO_WINDOW.fast_path.decisions().values())
    assert mx.array_equal(got[:-1], args[-1][1:])
    assert_steady(got[-1:], FINISH_INTO_WINDOW.fast_path.reference(*args)[-1:], args[:-1])


@pytest.mark.slow
def test_emulated_kernel_rotates_at_the_aligned_position(monkeypatch, tmp_path):
    """align (a compressed row at its window's first token): the launch forms position - position % align itself;
    equal to the formula at the aligned positions."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    key = (512, 64, "weighted", RowQuant.KV_FP8, False, 4)
    x, positions, rope, norm, quant, half, align = rows.FinishRows._probe(key)
    got = FINISH_ROWS.fast_path.fast(x, positions, rope, norm, quant, half, align)
    aligned = positions - positions % 4
    assert_steady(got, FINISH_ROWS.fast_path.reference(x, aligned, rope, norm, quant, half), (x, aligned, rope, norm,
                                                                                            quant, half))
    assert not mx.array_equal(aligned, positions)


def test_join_rows_takes_other_shapes_to_concatenate(on_cpu):
    a, b = mx.ones((1, 3, 4)), mx.zeros((1, 3, 4))
    assert rows.join_rows([a]) is a
    assert mx.array_equal(rows.join_rows([a, b, a]), mx.concatenate([a, b, a]))
    mixed = [a, mx.zeros((2, 3, 4))]  # not a row each: MLX's concatenate
    assert mx.array_equal(rows.join_rows(mixed), mx.concatenate(mixed))


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 5])
def test_emulated_join_kernel_equals_concatenate(count, monkeypatch, tmp_path):
    """A step's rows' attention heads (1, 64, 512) joined in one launch, exactly as MLX's concatenate."""
    monkeypatch.setattr(rows, "build", emulated_build(tmp_path))
    parts = _join_parts(count)
    assert mx.array_equal(rows._join_kernel(parts), mx.concatenate(parts))


@pytest.mark.gpu
def test_join_kernel_is_used_and_exact(on_gpu, kernels_unforced):
    parts = _join_parts(4)
    got = rows.join_rows(parts)
    assert rows.JOIN_ROWS.decisions()[registry.current_backend(), (4, (64, 512))].fast
    assert mx.array_equal(got, mx.concatenate(parts))


def _join_parts(count: int) -> tuple[mx.array, ...]:
    return tuple(mx.random.normal((1, 64, 512), key=mx.random.key(i)) for i in range(count))
