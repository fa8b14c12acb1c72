"""The affine matvec kernel (a few rows times a Q8_0 / Q4_K affine matrix, or selected experts of a bank).

On the CPU there is no kernel: the tests check the two renderings of its one definition, the launch plan, the
arithmetic it relies on (in numpy), and that the built-in quantized matmuls answer unchanged. The `gpu`-marked
tests compare the kernel with the reference dequantizer at Flash's shapes and check that the model uses it.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import dialect, registry
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.decode.affine_matvec import (AFFINE_MATVEC, KERNEL, MAX_TOKENS, MIN_THREADGROUPS, TOLERANCE,
                                           affine_matvec, launch_plan, norm_kernel)
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import dequantize, reference_matmul
from ds4_mlx.model.gguf import GGMLType
from kernel_checks import tiny_decode_fast_and_reference

pytestmark = pytest.mark.usefixtures("kernels_unforced")

CUDA_ONLY = ("__shared__", "threadIdx", "blockIdx", "__syncthreads", "__shfl_xor_sync", "__device__", "__byte_perm")
METAL_ONLY = ("threadgroup", "simdgroup", "thread_index_in_simdgroup", "device ", "metal::", "as_type")

FLASH_Q8 = {  # (OUT, IN) of Flash's Q8_0 matrices that a decode token multiplies
    "attn_q_a": (1024, 4096), "attn_q_b": (32768, 1024), "attn_kv": (512, 4096), "attn_output_b": (4096, 8192),
    "shexp_gate_up": (2048, 4096), "shexp_down": (4096, 2048), "output": (129280, 4096),
}
FLASH_Q4_EXPERTS = {"gate_up": (2048, 4096), "down": (4096, 2048)}


def rendered(target: dialect.Dialect) -> dict:
    seen = {}
    dialect.Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(KERNEL)
    return seen


def test_one_definition_renders_for_cuda_and_metal():
    cuda, metal = rendered(CUDA), rendered(METAL)
    for out in (cuda, metal):
        assert out["input_names"] == ["x", "wq", "scales", "biases", "ids"] and out["output_names"] == ["y"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"] + out["header"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
        # names that are types or functions in Metal's namespace must not be reused as variables
        assert not re.search(r"\b(half|matrix|dot|float2|uint2)\s*=", out["source"])
    assert not any(word in cuda["source"] + cuda["header"] for word in METAL_ONLY)
    assert not any(word in metal["source"] + metal["header"] for word in CUDA_ONLY)
    for attribute in ("threadgroup_position_in_grid", "thread_position_in_threadgroup", "thread_index_in_simdgroup",
                      "simdgroup_index_in_threadgroup"):
        assert attribute in metal["source"]


def byte_float(word: np.ndarray, k: int) -> np.ndarray:
    """ds4_byte_float in numpy: the float whose bits are 0x4B000000 | byte k of the word."""
    return ((word >> np.uint32(8 * k)) & np.uint32(0xFF) | np.uint32(0x4B000000)).view(np.float32)


def test_byte_float_gives_every_byte_exactly():
    words = np.arange(256, dtype=np.uint32) * np.uint32(0x01010101)
    for k in range(4):
        np.testing.assert_array_equal(byte_float(words, k) - np.float32(2**23), np.arange(256, dtype=np.float32))


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_the_kernels_arithmetic_is_within_tolerance(ggml_type):
    """The kernel's form of w . x per 4 values, s * sum (q - C) x + (b + C s) * sum x in float32 (quants decoded as
    ds4_byte_float(...) - (2^23 + C)), against the reference: within TOLERANCE at a Flash width. For Q8_0 the
    bias term is exactly zero."""
    n_out, n_in = 32, 4096
    blocks = random_blocks(ggml_type, n_out, n_in, seed=41)
    weight = to_affine(blocks, ggml_type, (n_out, n_in))
    bits = weight.bits
    centre = np.float32(1 << (bits - 1))
    words = np.array(weight.wq).reshape(n_out, -1)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    q = ((words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(n_out, n_in)
    q_float = (q | np.uint32(0x4B000000)).view(np.float32) - (np.float32(2**23) + centre)  # the kernel's decode
    np.testing.assert_array_equal(q_float, q.astype(np.float32) - centre)
    scale = np.repeat(np.array(weight.scales), 32, axis=1).reshape(n_out, -1, 4)[..., 0]
    bias_term = np.repeat(np.array(weight.biases) + centre * np.array(weight.scales), 32, axis=1)
    bias_term = bias_term.reshape(n_out, -1, 4)[..., 0]
    if ggml_type == GGMLType.Q8_0:
        assert not bias_term.any()
    x = np.array(random_activations((1, n_in), seed=42))[0]
    sums = (q_float * x).reshape(n_out, -1, 4).sum(-1, dtype=np.float32)
    xsums = x.reshape(-1, 4).sum(-1, dtype=np.float32)
    got = (scale * sums + bias_term * xsums).sum(-1, dtype=np.float32)
    want = np.array(reference_matmul(mx.array(x[None]), blocks, ggml_type, (n_out, n_in)))[0]
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


def test_launch_plan():
    assert launch_plan(129280, 4096, 8, 1) == (8, 4)  # LM head: 16160 threadgroups of 8 rows
    assert launch_plan(32768, 1024, 8, 1) == (8, 1)
    assert launch_plan(4096, 8192, 8, 1) == (8, 8)
    assert launch_plan(1536, 4096, 8, 1) == (8, 4)  # joined q_a / kv: 192 threadgroups
    assert launch_plan(512, 4096, 8, 1) == (4, 4)  # small matrices: fewer rows, at least 128 threadgroups
    assert launch_plan(64, 4096, 8, 1) == (1, 4)
    assert launch_plan(4096, 2048, 4, 1) == (8, 1)
    assert launch_plan(1536, 4096, 8, 3) == (4, 4)
    assert launch_plan(129280, 4096, 8, 5) == (2, 4)
    for n_out, n_in in FLASH_Q8.values():
        for tokens in range(1, MAX_TOKENS + 1):
            rows, simds = launch_plan(n_out, n_in, 8, tokens)
            assert rows * tokens <= 16 and 1 <= simds <= 8
            assert rows == 1 or -(-n_out // rows) >= MIN_THREADGROUPS


def test_the_cpu_uses_the_built_in_matmuls_without_a_warning(on_cpu):
    weight = to_affine(random_blocks(GGMLType.Q8_0, 40, 512, seed=43), GGMLType.Q8_0, (40, 512))
    bank = to_affine(random_blocks(GGMLType.Q4_K, 3 * 24, 512, seed=44), GGMLType.Q4_K, (3, 24, 512))
    ids = mx.array([2, 0, 2], dtype=mx.uint32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tokens in (1, 5):
            x = random_activations((tokens, 512), seed=tokens)
            np.testing.assert_array_equal(np.array(affine_matvec(x, weight)), np.array(weight.matmul(x)))
        x = random_activations((3, 512), seed=45)
        np.testing.assert_array_equal(np.array(affine_matvec(x, bank, ids)), np.array(bank.gather_matmul(x, ids)))
    assert AFFINE_MATVEC.decisions() == {}  # nothing to check: no kernel exists for the CPU


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FLASH_Q8))
@pytest.mark.parametrize("tokens", [1, 5])
def test_kernel_equals_the_reference_at_flash_shapes(on_gpu, name, tokens):
    """Every Q8_0 matrix a decode token reads, the 129280-row LM head included, for one token and five."""
    shape = FLASH_Q8[name]
    blocks = random_blocks(GGMLType.Q8_0, *shape, seed=51)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    x = random_activations((tokens, shape[1]), seed=52)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = affine_matvec(x, weight)
    key = (8, shape[1], tokens, *launch_plan(*shape, 8, tokens))
    assert AFFINE_MATVEC.decisions()[("cuda" if mx.cuda.is_available() else "metal", key)].fast
    assert relative_error(got, reference_matmul(x, blocks, GGMLType.Q8_0, shape)) <= TOLERANCE
    assert relative_error(got, weight.matmul(x)) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize(("size", "plan"), [((1, 512), (1, 1)), ((7, 256), (4, 1)), ((33, 768), (2, 3)),
                                            ((301, 2048), (4, 8))], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_kernel_at_odd_sizes(on_gpu, size, plan, tokens, ggml_type):
    """(rows, SIMD groups) plans whose last threadgroup is partly past the end, rows shorter than a SIMD group's
    loads or than a whole number of steps, up to MAX_TOKENS tokens, both quant widths."""
    n_out, n_in = size
    if ggml_type == GGMLType.Q4_K:
        n_in = 256 * -(-n_in // 256)  # Q4_K rows are whole 256-value blocks
    blocks = random_blocks(ggml_type, n_out, n_in, seed=53)
    weight = to_affine(blocks, ggml_type, (n_out, n_in))
    x = random_activations((tokens, n_in), seed=54)
    got = AFFINE_MATVEC.fast(x, weight, None, plan)
    assert relative_error(got, reference_matmul(x, blocks, ggml_type, (n_out, n_in))) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FLASH_Q4_EXPERTS))
def test_selected_q4_experts_equal_the_reference(on_gpu, name):
    """Decode's routed experts in the q4 files: six (token, expert) pairs over a bank, one expert used twice."""
    n_out, n_in = FLASH_Q4_EXPERTS[name]
    experts = 8
    blocks = random_blocks(GGMLType.Q4_K, experts * n_out, n_in, seed=55)
    bank = to_affine(blocks, GGMLType.Q4_K, (experts, n_out, n_in))
    ids = mx.array([5, 0, 7, 5, 2, 3], dtype=mx.uint32)
    x = random_activations((ids.size, n_in), seed=56)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = affine_matvec(x, bank, ids)
    w = dequantize(blocks, GGMLType.Q4_K, (experts, n_out, n_in))[ids]
    want = (x[:, None, :] @ mx.swapaxes(w, 1, 2))[:, 0, :]
    assert relative_error(got, want) <= TOLERANCE
    assert all(decision.fast for decision in AFFINE_MATVEC.decisions().values())


@pytest.mark.gpu
def test_kernel_runs_inside_a_compiled_function(on_gpu):
    shape = FLASH_Q8["attn_q_a"]
    blocks = random_blocks(GGMLType.Q8_0, *shape, seed=57)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    x = random_activations((1, shape[1]), seed=58)
    compiled = mx.compile(lambda a: affine_matvec(a, weight))
    assert relative_error(compiled(x), reference_matmul(x, blocks, GGMLType.Q8_0, shape)) <= TOLERANCE


@pytest.mark.gpu
def test_q4_model_decode_with_the_kernel_equals_the_reference(on_gpu, tmp_path):
    """Decode steps of the tiny q4 model (Q8_0 projections, Q4_K experts): the kernel against the forced
    reference path (no activation simulation, whose FP8/FP4 rounding could amplify a reassociation difference)."""
    fast, reference = tiny_decode_fast_and_reference(tmp_path, "q4")
    assert AFFINE_MATVEC.decisions() and all(d.fast for d in AFFINE_MATVEC.decisions().values())
    assert np.abs(fast - reference).max() <= 1e-4 * np.abs(reference).max()


# ---------------------------------------------------------------------------------------------------------------
# The input norm folded in (kernels/decode/fused_norm.py)

FLASH_NORMED = ("attn_q_a", "attn_kv", "attn_q_b", "shexp_gate_up", "output")
"""The Q8_0 matrices whose input is an rms_norm output: attn_norm, q_a_norm, ffn_norm, output_norm."""


def test_the_normed_kernel_renders_and_the_plain_one_is_unchanged():
    for target in (CUDA, METAL):
        seen = {}
        target_norm = dialect.Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw))
        target_norm.compile(norm_kernel(1e-6))
        assert seen["input_names"] == ["x", "wq", "scales", "biases", "ids", "norm_w"]
        assert "NORM_EPS = 1e-06f;" in seen["header"] and "@" not in seen["source"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", seen["source"] + seen["header"])
    assert "norm" not in KERNEL.source and "@" not in KERNEL.source and "squares" not in KERNEL.source
    assert norm_kernel(1e-6) is norm_kernel(1e-6) and norm_kernel(1e-6).name != norm_kernel(1e-5).name


def test_the_cpu_norms_then_multiplies(on_cpu):
    weight = to_affine(random_blocks(GGMLType.Q8_0, 40, 512, seed=43), GGMLType.Q8_0, (40, 512))
    bank = to_affine(random_blocks(GGMLType.Q4_K, 3 * 24, 512, seed=44), GGMLType.Q4_K, (3, 24, 512))
    norm = (1.0 + 0.5 * random_activations((512,), seed=46), 1e-6)
    x = 5.0 * random_activations((3, 512), seed=47)
    normed = mx.fast.rms_norm(x, *norm)
    np.testing.assert_array_equal(np.array(affine_matvec(x, weight, norm=norm)), np.array(weight.matmul(normed)))
    ids = mx.array([2, 0, 2], dtype=mx.uint32)
    np.testing.assert_array_equal(np.array(affine_matvec(x, bank, ids, norm)),
                                  np.array(bank.gather_matmul(normed, ids)))
    assert AFFINE_MATVEC.decisions() == {}


@pytest.mark.gpu
@pytest.mark.parametrize("name", FLASH_NORMED)
@pytest.mark.parametrize("tokens", [1, 5])
def test_normed_kernel_equals_the_reference_at_flash_shapes(on_gpu, name, tokens):
    """rms_norm folded into the matvecs whose input is a norm's output; rows far from unit rms."""
    shape = FLASH_Q8[name]
    weight = to_affine(random_blocks(GGMLType.Q8_0, *shape, seed=61), GGMLType.Q8_0, shape)
    x = random_activations((tokens, shape[1]), seed=62) * mx.linspace(1.0, 20.0, tokens)[:, None]
    norm = (1.0 + 0.5 * random_activations((shape[1],), seed=63), 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = affine_matvec(x, weight, norm=norm)
    key = (8, shape[1], tokens, *launch_plan(*shape, 8, tokens), 1e-6)
    assert AFFINE_MATVEC.decisions()[(registry.current_backend(), key)].fast
    assert relative_error(got, weight.matmul(mx.fast.rms_norm(x, *norm))) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_normed_kernel_over_a_bank_norms_each_pair_on_its_own(on_gpu, ggml_type):
    n_out, n_in, experts = 2048, 4096, 8
    bank = to_affine(random_blocks(ggml_type, experts * n_out, n_in, seed=64), ggml_type, (experts, n_out, n_in))
    ids = mx.array([5, 0, 7, 5, 2, 3], dtype=mx.uint32)
    x = random_activations((ids.size, n_in), seed=65) * mx.linspace(1.0, 20.0, ids.size)[:, None]
    norm = (1.0 + 0.5 * random_activations((n_in,), seed=66), 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = affine_matvec(x, bank, ids, norm)
    assert relative_error(got, bank.gather_matmul(mx.fast.rms_norm(x, *norm), ids)) <= TOLERANCE
    assert all(decision.fast for decision in AFFINE_MATVEC.decisions().values())


@pytest.mark.gpu
def test_normed_kernel_runs_inside_a_compiled_function(on_gpu):
    shape = FLASH_Q8["attn_q_a"]
    weight = to_affine(random_blocks(GGMLType.Q8_0, *shape, seed=67), GGMLType.Q8_0, shape)
    x = 9.0 * random_activations((1, shape[1]), seed=68)
    norm = (1.0 + 0.5 * random_activations((shape[1],), seed=69), 1e-6)
    compiled = mx.compile(lambda a: affine_matvec(a, weight, norm=norm))
    assert relative_error(compiled(x), weight.matmul(mx.fast.rms_norm(x, *norm))) <= TOLERANCE
