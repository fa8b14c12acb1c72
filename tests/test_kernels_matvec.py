"""The IQ2_XXS and Q2_K dequant-matvec kernels: one definition rendered for CUDA and Metal, the reference on CPU.

The kernels themselves only run on a GPU: the `gpu`-marked tests compare them with the reference dequantizer
there (`pytest -m gpu` on a machine with a GPU). On the CPU the tests check what can be checked without one: the
two renderings of each definition, the lattice table, the launch plan, and that the registry quietly uses the
reference.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import IQ2_XXS

from ds4_mlx.kernels.machinery import dialect
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS, build
from ds4_mlx.kernels.decode.iq2_xxs import IQ2_XXS_MATVEC, grid_codes
from ds4_mlx.kernels.decode.matvec import STAGE_BYTES, TOLERANCE, gathered_reference, launch_plan
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.decode.q2_k import Q2_K_MATVEC
from kernel_checks import balanced, rendered, tiny_decode_fast_and_reference

MATVECS = [IQ2_XXS_MATVEC, Q2_K_MATVEC]
HELPERS = ("ds4_barrier", "ds4_simd_barrier", "ds4_simd_sum", "ds4_simd_xor", "ds4_popcount", "ds4_half_to_float")
CUDA_ONLY = ("__shared__", "threadIdx", "blockIdx", "__syncthreads", "__shfl_xor_sync", "__device__", "__constant__")
METAL_ONLY = ("threadgroup", "simdgroup", "thread_index_in_simdgroup", "device ", "metal::", "constant ")


def ids(matvec):
    return matvec.ggml_type.name


pytestmark = pytest.mark.usefixtures("kernels_unforced")




def without_spellings(target: dialect.Dialect, text: str) -> str:
    """The text with this dialect's spellings of the neutral words taken out, whitespace collapsed."""
    spellings = sorted((s for s in target.words.values() if s), key=len, reverse=True)
    return " ".join(re.sub("|".join(map(re.escape, spellings)), " ", text).split())


@pytest.mark.parametrize("matvec", MATVECS, ids=ids)
def test_one_definition_renders_for_cuda_and_metal(matvec):
    cuda, metal = rendered(matvec.kernel, CUDA), rendered(matvec.kernel, METAL)
    for out in (cuda, metal):
        assert out["name"] == matvec.kernel.name
        assert out["input_names"] == ["x", "w", "ids"] and out["output_names"] == ["y"]
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"] + out["header"])
        assert balanced(out["source"]) and balanced(out["header"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
    assert not any(word in cuda["source"] + cuda["header"] for word in METAL_ONLY)
    assert not any(word in metal["source"] + metal["header"] for word in CUDA_ONLY)
    # MLX adds a Metal thread attribute to the signature only if its name appears in the body
    for attribute in ("threadgroup_position_in_grid", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup"):
        assert attribute in metal["source"]
    # the bodies differ only in how the neutral words are spelled
    assert without_spellings(CUDA, cuda["source"]) == without_spellings(METAL, metal["source"])
    assert without_spellings(CUDA, cuda["source"]) != without_spellings(CUDA, matvec.kernel.source)


def test_every_helper_is_defined_by_both_preludes():
    for target in (CUDA, METAL):
        for helper in HELPERS:
            assert re.search(rf"\b{helper}\(", target.prelude), (target.name, helper)


def test_grid_codes_hold_ggml_lattice():
    IQ2_XXS.init_grid()
    want = np.asarray(IQ2_XXS.grid).reshape(256, 8)
    codes = np.array(grid_codes(), dtype=np.uint32)
    c = (codes[:, None] >> (2 * np.arange(8))) & 3
    np.testing.assert_array_equal(8 + 17 * c + (c >> 1), want)
    assert codes.max() < 1 << 16  # fits the kernel's unsigned short table


def test_launch_plan_fits_the_staging_buffer():
    assert launch_plan(1056) == (8, 2)  # IQ2_XXS row of 4096 values: 16.9 KB staged per threadgroup
    assert launch_plan(672) == (8, 4)  # Q2_K row of 2048 values
    assert launch_plan(66) == (8, 4)
    simds, rows = launch_plan(5000)
    assert simds * rows * 5000 <= STAGE_BYTES
    with pytest.raises(ValueError, match="does not fit"):
        launch_plan(STAGE_BYTES + 2)


@pytest.mark.parametrize("matvec", MATVECS, ids=ids)
def test_the_cpu_uses_the_reference_without_a_warning(matvec, on_cpu):
    shape = (3, 32, 512)
    blocks = random_blocks(matvec.ggml_type, 3 * 32, 512).reshape(3, -1)
    expert_ids = mx.array([2, 0, 2, 1], dtype=mx.int32)
    x = random_activations((4, 512))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not matvec.enabled(32, 512)
        got = matvec(x, blocks, expert_ids, shape)
    assert matvec.fast_path.decisions() == {}  # nothing to check: no kernel exists for the CPU
    np.testing.assert_array_equal(np.array(got), np.array(gathered_reference(x, blocks, expert_ids,
                                                                             matvec.ggml_type, shape)))


def test_gathered_reference_is_one_product_per_pair():
    shape = (3, 16, 256)
    blocks = random_blocks(Q2_K_MATVEC.ggml_type, 48, 256).reshape(3, -1)
    from ds4_mlx.kernels.formats.quants import dequantize

    w = np.array(dequantize(blocks, Q2_K_MATVEC.ggml_type, shape))
    x = np.array(random_activations((2, 256)))
    got = np.array(gathered_reference(mx.array(x), blocks, mx.array([2, 0], dtype=mx.int32), Q2_K_MATVEC.ggml_type,
                                      shape))
    np.testing.assert_allclose(got, np.stack([x[0] @ w[2].T, x[1] @ w[0].T]), rtol=1e-5, atol=1e-6)


def test_no_kernels_for_the_cpu_backend():
    with pytest.raises(ValueError, match="no custom kernels for the cpu backend"):
        build(IQ2_XXS_MATVEC.kernel, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

FLASH_SHAPES = {IQ2_XXS_MATVEC.ggml_type: (2048, 4096), Q2_K_MATVEC.ggml_type: (4096, 2048)}


def kernel_error(matvec, n_out, n_in, pairs, experts=4, seed=0) -> float:
    shape = (experts, n_out, n_in)
    blocks = random_blocks(matvec.ggml_type, experts * n_out, n_in, seed=seed).reshape(experts, -1)
    expert_ids = mx.array(np.random.default_rng(seed).integers(0, experts, pairs).astype(np.int32))
    x = random_activations((pairs, n_in), seed=seed + 1)
    got = matvec.fast_path.fast(x, blocks, expert_ids, shape)
    want = gathered_reference(x, blocks, expert_ids, matvec.ggml_type, shape)
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("matvec", MATVECS, ids=ids)
@pytest.mark.parametrize("size", [(64, 256), (40, 512), (24, 2048), (20, 4096), "flash"], ids=str)
@pytest.mark.parametrize("pairs", [1, 6])
def test_kernel_equals_the_reference_on_the_gpu(on_gpu, matvec, size, pairs):
    """Row counts that leave a threadgroup partly idle, rows staged in 2-byte and 16-byte loads, one token and a
    top-6 of experts, and the Flash shapes."""
    n_out, n_in = FLASH_SHAPES[matvec.ggml_type] if size == "flash" else size
    assert kernel_error(matvec, n_out, n_in, pairs) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("matvec", MATVECS, ids=ids)
def test_first_use_check_passes_on_the_gpu(on_gpu, matvec):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matvec.enabled(*FLASH_SHAPES[matvec.ggml_type])


@pytest.mark.gpu
@pytest.mark.parametrize("matvec", MATVECS, ids=ids)
def test_kernel_runs_inside_a_compiled_function(on_gpu, matvec):
    n_out, n_in = FLASH_SHAPES[matvec.ggml_type]
    shape = (4, n_out, n_in)
    blocks = random_blocks(matvec.ggml_type, 4 * n_out, n_in, seed=3).reshape(4, -1)
    expert_ids = mx.array([3, 1, 0, 2, 2, 1], dtype=mx.int32)
    x = random_activations((6, n_in), seed=4)
    compiled = mx.compile(lambda a, i: matvec.fast_path.fast(a, blocks, i, shape))
    want = gathered_reference(x, blocks, expert_ids, matvec.ggml_type, shape)
    assert (mx.abs(compiled(x, expert_ids) - want).max() / mx.abs(want).max()).item() <= TOLERANCE


@pytest.mark.gpu
def test_q2_model_decode_with_kernels_equals_the_reference(on_gpu, tmp_path):
    """Decode steps of the tiny q2 model: routed experts through the kernels (the fused ones of
    kernels/decode/experts.py, which the decode path now prefers to these matvecs) against the forced reference path
    (activation simulation off, so that no FP8/FP4 rounding step can amplify a reassociation difference)."""
    from ds4_mlx.model.moe import DOWN_SUM, GATE_UP

    fast, reference = tiny_decode_fast_and_reference(tmp_path, "q2")
    fused = (GATE_UP.fast_path, DOWN_SUM.fast_path)
    assert all(path.decisions() for path in fused)  # the kernels were checked and used
    assert all(decision.fast for path in fused for decision in path.decisions().values())
    assert np.abs(fast - reference).max() <= 1e-4 * np.abs(reference).max()
