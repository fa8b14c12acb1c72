"""The half-precision matvec (kernels/decode/half.py) and the float16 form of F16 matrices (model/linear.py).

On the CPU: the kernel's two renderings, its launch plan, and the model with the float16 form forced on (the
kernel falls back to its reference there): the memory it predicts, and logits equal to the float32 form's bit for
bit (test_kernels_emulated.py runs the kernel's CUDA text on the host). On the GPU (`pytest -m gpu`): the kernel
used at the Flash shapes and equal to the reference within float32 summation order, inside mx.compile too, and the
model over it.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS, Dialect
from ds4_mlx.kernels.decode.half import (HALF_MATVEC, HALF_MATVEC_KERNEL, MAX_STEPS, MAX_TOKENS, SIMDS, TARGET_SIMDS,
                                  TOLERANCE, half_matvec, matvec_enabled, norm_kernel, reference, split_plan)
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model import linear
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

FLASH_SHAPES = [(1024, 4096), (512, 4096), (8192, 1024), (64, 4096), (256, 4096)]
"""Compressor kv/gate (ratio 4 and 128), indexer q_b, indexer proj, indexer compressor kv/gate and router."""

pytestmark = pytest.mark.usefixtures("kernels_unforced")


def random_half(shape: tuple[int, int], seed: int) -> mx.array:
    """float16 weights of trained magnitudes, down to subnormal halves."""
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * np.exp2(rng.uniform(-16, -2, shape))).astype(np.float16))


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def rendered(target: Dialect) -> dict:
    seen = {}
    Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(HALF_MATVEC_KERNEL)
    return seen


def test_one_definition_renders_for_cuda_and_metal():
    cuda, metal = rendered(CUDA), rendered(METAL)
    for out in (cuda, metal):
        assert out["input_names"] == ["x", "w"] and out["output_names"] == ["y"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
        for open_, close in ("{}", "()", "[]"):
            assert out["source"].count(open_) == out["source"].count(close)
    assert "__shared__" in cuda["source"] and "threadgroup float partial" in metal["source"]
    # MLX adds a Metal thread attribute to the signature only if its name appears in the body
    for attribute in ("threadgroup_position_in_grid", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
                      "thread_position_in_threadgroup"):
        assert attribute in metal["source"]


def test_split_plan_gives_every_lane_whole_loads():
    plans = {shape: split_plan(*shape) for shape in FLASH_SHAPES + [(2624, 4096)]}
    assert plans == {(1024, 4096): (8, 4), (512, 4096): (8, 2), (8192, 1024): (1, 4), (64, 4096): (8, 1),
                     (256, 4096): (8, 1), (2624, 4096): (4, 4)}  # the last: a ratio-4 layer's joined projections
    for (n_out, n_in), (split, rps) in plans.items():
        assert SIMDS % split == 0 and (n_in // 256) % split == 0 and (n_in // 256) // split * rps <= MAX_STEPS
        assert rps == 1 or -(-n_out // rps) * split >= TARGET_SIMDS  # several rows a SIMD group only where
        # enough SIMD groups remain
    assert split_plan(16, 256) == (1, 1) and split_plan(100, 768) == (1, 1)  # a row too short to split
    assert split_plan(64, 64) is None and split_plan(64, 1000) is None  # not whole 256-value chunks
    assert split_plan(8, 256 * 17) is None  # 17 loads a lane, and 17 does not split


def test_the_cpu_uses_the_reference_without_a_warning(on_cpu):
    w = random_half((64, 1024), seed=1)
    x = random_activations((3, 1024), seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not matvec_enabled(w.shape)
        got = half_matvec(x, w)
    assert HALF_MATVEC.decisions() == {}  # nothing to check: no kernel exists for the CPU
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(x @ w.astype(mx.float32).T))


# ---------------------------------------------------------------------------------------------------------------
# The float16 form in the model, forced on for the CPU


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    return open_weights(write_model(tmp_path_factory.mktemp("half") / "tiny-q4.gguf", preset="tiny", experts="q4"))


def force_half_form(monkeypatch) -> None:
    """The float16 form for every F16 matrix of HALF_LINEARS, as where the kernel passed its check (never in the
    reference mode); the CPU then runs the kernel's reference, x @ W.astype(float32).T."""
    monkeypatch.setattr(linear, "matvec_enabled", lambda shape: registry.mode() == "fast")


def half_linears(model: Model) -> list[linear.Linear]:
    """The model's matrices held as float16, found by walking its parts."""
    found, stack, seen = [], [model.embedding, model.output, *model.blocks], set()
    while stack:
        part = stack.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        if isinstance(part, linear.Linear):
            found += [part] if part._half is not None else []
        elif type(part).__module__.startswith("ds4_mlx.model.") and hasattr(part, "__dict__"):
            stack += vars(part).values()
    return found


def decode_logits(model: Model, tokens: np.ndarray) -> np.ndarray:
    cache = model.new_cache(64)
    model.prefill(mx.array(tokens[:20]), cache)
    return np.stack([np.array(model.decode(int(t), cache)[1]) for t in tokens[20:26]])


def test_float16_form_holds_half_the_bytes_and_is_predicted(tiny_weights, monkeypatch, on_cpu):
    plain = Model(tiny_weights)
    force_half_form(monkeypatch)
    model = Model(tiny_weights)
    forms = linear.loaded_forms(tiny_weights)
    assert linear.loaded_nbytes(tiny_weights) == model.nbytes
    stored, held = forms["float16"]
    assert stored == held > 0  # the file's F16 bytes, as they are
    halves = half_linears(model)
    assert halves and all(t.ggml_type == GGMLType.F16 and t._half.dtype == mx.float16 for t in halves)
    assert all(t.nbytes == 2 * t.shape[0] * t.shape[1] for t in halves)
    assert {t.name.split(".", 2)[2] for t in halves} == {
        "attn_compressor_kv.weight", "attn_compressor_gate.weight", "indexer.attn_q_b.weight", "indexer.proj.weight",
        "indexer_compressor_kv.weight", "indexer_compressor_gate.weight", "ffn_gate_inp.weight"}
    assert model.embedding._half is None  # rows only: its form is not the half matvec's
    assert plain.nbytes - model.nbytes == stored  # float32 held twice the bytes
    with registry.forced_mode("reference"):
        assert linear.loaded_forms(tiny_weights)["float16"] == (0, 0)  # the reference path loads float32


def test_float16_form_gives_the_float32_forms_logits(tiny_weights, monkeypatch, on_cpu):
    """Chunk (reference mode) and compiled (fast mode) decode paths: F16 -> float32 is exact, and the CPU
    multiplies the same float32 values as the float32 form does."""
    tokens = np.random.default_rng(5).integers(0, tiny_weights.config.n_vocab, 26).astype(np.int32)
    dense = Model(tiny_weights, simulate_quant=False)
    force_half_form(monkeypatch)
    model = Model(tiny_weights, simulate_quant=False)
    assert half_linears(model) and not half_linears(dense)
    np.testing.assert_array_equal(decode_logits(model, tokens), decode_logits(dense, tokens))
    with registry.forced_mode("reference"):
        np.testing.assert_array_equal(decode_logits(model, tokens), decode_logits(dense, tokens))
    x = random_activations((3, 1, model.config.n_embd), seed=6)  # leading axes, as callers may pass them
    gate = model.blocks[0].moe.router.gate
    np.testing.assert_array_equal(np.array(gate(x)), np.array(x @ gate.weight.T))
    assert gate.rows(mx.array([3, 1])).dtype == mx.float32


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FLASH_SHAPES + [(100, 768), (16, 256)], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, MAX_TOKENS])
def test_kernel_is_used_and_equals_the_reference_on_the_gpu(on_gpu, shape, tokens):
    w = random_half(shape, seed=shape[0])
    x = random_activations((tokens, shape[1]), seed=tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matvec_enabled(shape)
    assert HALF_MATVEC.decisions()[registry.current_backend(), shape].fast
    assert relative_error(half_matvec(x, w), reference(x, w)) <= TOLERANCE


@pytest.mark.gpu
def test_more_rows_take_the_reference_on_the_gpu(on_gpu):
    w = random_half((256, 4096), seed=7)
    x = random_activations((MAX_TOKENS + 1, 4096), seed=8)
    np.testing.assert_array_equal(np.array(half_matvec(x, w)), np.array(reference(x, w)))


@pytest.mark.gpu
def test_kernel_runs_inside_a_compiled_function(on_gpu):
    w = random_half((1024, 4096), seed=9)
    x = random_activations((1, 4096), seed=10)
    compiled = mx.compile(lambda a: half_matvec(a, w))
    assert relative_error(compiled(x), reference(x, w)) <= TOLERANCE


@pytest.mark.gpu
def test_tiny_model_decode_with_the_kernel_equals_the_reference(on_gpu, tiny_weights):
    """Decode steps of the tiny model with its F16 matrices as float16 (the 256-wide ones through the kernel;
    q_b's rows of 64 take the reference) against the forced reference path (activation simulation off, so that no
    FP8/FP4 rounding step amplifies a reassociation difference)."""
    tokens = np.random.default_rng(11).integers(0, tiny_weights.config.n_vocab, 26).astype(np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model(tiny_weights, simulate_quant=False)
        fast = decode_logits(model, tokens)
    assert linear.loaded_nbytes(tiny_weights) == model.nbytes
    assert any(t._half is not None for t in half_linears(model))
    with registry.forced_mode("reference"):
        reference_logits = decode_logits(Model(tiny_weights, simulate_quant=False), tokens)
    assert np.abs(fast - reference_logits).max() <= 1e-4 * np.abs(reference_logits).max()


# ---------------------------------------------------------------------------------------------------------------
# The input norm folded in (kernels/decode/fused_norm.py)


def test_the_normed_kernel_renders_and_the_plain_one_is_unchanged():
    for target in (CUDA, METAL):
        seen = {}
        Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(
            norm_kernel(1e-6))
        assert seen["input_names"] == ["x", "w", "norm_w"] and "NORM_EPS = 1e-06f;" in seen["header"]
        assert "@" not in seen["source"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", seen["source"] + seen["header"])
    assert "norm" not in HALF_MATVEC_KERNEL.source and "squares" not in HALF_MATVEC_KERNEL.source


def test_the_cpu_norms_then_multiplies(on_cpu):
    w = random_half((64, 1024), seed=1)
    x = 5.0 * random_activations((3, 1024), seed=2)
    norm = (1.0 + 0.5 * random_activations((1024,), seed=3), 1e-6)
    np.testing.assert_array_equal(np.array(half_matvec(x, w, norm)),
                                  np.array(mx.fast.rms_norm(x, *norm) @ w.astype(mx.float32).T))
    assert HALF_MATVEC.decisions() == {}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FLASH_SHAPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
def test_normed_kernel_is_used_and_equals_the_reference_on_the_gpu(on_gpu, shape, tokens):
    """rms_norm folded in at the Flash F16 shapes (compressor, indexer and router inputs are norm outputs); rows
    far from unit rms."""
    w = random_half(shape, seed=shape[0])
    x = random_activations((tokens, shape[1]), seed=tokens) * mx.linspace(1.0, 20.0, tokens)[:, None]
    norm = (1.0 + 0.5 * random_activations((shape[1],), seed=4), 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = half_matvec(x, w, norm)
    assert HALF_MATVEC.decisions()[registry.current_backend(), (*shape, 1e-6)].fast
    assert relative_error(got, reference(x, w, norm)) <= TOLERANCE


@pytest.mark.gpu
def test_normed_kernel_runs_inside_a_compiled_function(on_gpu):
    w = random_half((1024, 4096), seed=9)
    x = 9.0 * random_activations((1, 4096), seed=10)
    norm = (1.0 + 0.5 * random_activations((4096,), seed=11), 1e-6)
    compiled = mx.compile(lambda a: half_matvec(a, w, norm))
    assert relative_error(compiled(x), reference(x, w, norm)) <= TOLERANCE
