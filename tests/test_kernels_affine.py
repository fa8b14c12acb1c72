"""Q8_0 / Q4_K as MLX affine arrays: bit-exact dequantization, quantized matmuls within float32 reassociation, and
the model loading them (memory near the file size, reference mode reproducing the reference path bit for bit)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.formats.affine import AFFINE_GATHER, AFFINE_MATMUL, affine_nbytes, to_affine
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import dequantize, reference_matmul
from ds4_mlx.model import linear
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

AFFINE_TYPES = (GGMLType.Q8_0, GGMLType.Q4_K)
SCALE_FIELDS = {GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2)}
REASSOCIATION = 1e-5  # float32 summation order only: ~1e-7 per add over a few hundred terms, with margin
finite_f16_bits = st.integers(0, 0xFFFF).filter(lambda h: (h >> 10) & 0x1F != 0x1F)


pytestmark = pytest.mark.usefixtures("kernels_unforced")


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def assert_same_values(got: mx.array, want: mx.array) -> None:
    """Equal float32 values: the same bits, except that a zero may carry either sign (q * d = -0 for a negative d
    in the reference, (q + 128) * d - 128 * d = +0 in the affine form). No sum or product tells them apart."""
    assert got.dtype == want.dtype == mx.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.array(got), np.array(want))


@st.composite
def blocks_with_any_scales(draw: st.DrawFn, ggml_type: GGMLType) -> tuple[mx.array, tuple[int, int]]:
    """Random blocks whose f16 scale fields take any finite value: zero, subnormal, tiny and huge, both signs."""
    block_elements, block_bytes = BLOCK_SIZES[ggml_type]
    rows, per_row = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    n = rows * per_row
    raw = np.frombuffer(draw(st.binary(min_size=n * block_bytes, max_size=n * block_bytes)), np.uint8)
    raw = raw.reshape(n, block_bytes).copy()
    for offset in SCALE_FIELDS[ggml_type]:
        bits = draw(st.lists(finite_f16_bits, min_size=n, max_size=n))
        raw[:, offset : offset + 2] = np.array(bits, dtype="<u2").view(np.uint8).reshape(n, 2)
    return mx.array(raw.reshape(rows, -1)), (rows, per_row * block_elements)


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_dequantizing_the_affine_form_is_exact(ggml_type, data):
    raw, shape = data.draw(blocks_with_any_scales(ggml_type))
    assert_same_values(to_affine(raw, ggml_type, shape).dequantize(), dequantize(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
def test_quantized_matmuls_of_float32_activations_need_no_casts(ggml_type, tmp_path):
    """Float32 scales and biases: MLX would otherwise add two AsType ops to every quantized matmul (and a third to
    gather_qmm for expert ids that are not uint32, which is why the MoE hands its banks uint32 ids)."""
    raw, shape = random_blocks(ggml_type, 8, 256), (8, 256)
    weight = to_affine(raw, ggml_type, shape)
    assert weight.scales.dtype == weight.biases.dtype == mx.float32
    bank = to_affine(raw, ggml_type, (2, 4, 256))
    mx.eval(weight.wq, weight.scales, weight.biases, bank.wq, bank.scales, bank.biases)  # as loaded
    expert_ids = mx.array([1, 0], dtype=mx.uint32)
    products = {"QuantizedMatmul": weight.matmul(mx.ones((1, 256))),
                "GatherQMM": bank.gather_matmul(mx.ones((2, 256)), expert_ids)}
    for op, y in products.items():
        mx.export_to_dot(str(tmp_path / f"{op}.dot"), y)
        graph = (tmp_path / f"{op}.dot").read_text()
        assert op in graph and "AsType" not in graph


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
def test_layout_and_predicted_size(ggml_type):
    shape = (4, 3, 512)  # an expert bank
    weight = to_affine(random_blocks(ggml_type, 12, 512), ggml_type, shape)
    bits = 8 if ggml_type == GGMLType.Q8_0 else 4
    assert weight.shape == shape and weight.bits == bits
    assert weight.wq.dtype == mx.uint32 and weight.wq.shape == (4, 3, 512 * bits // 32)
    assert weight.scales.shape == weight.biases.shape == (4, 3, 16)
    assert weight.nbytes == affine_nbytes(ggml_type, shape)


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 7])
def test_quantized_matmul_equals_the_reference(ggml_type, tokens):
    raw, shape = random_blocks(ggml_type, 96, 768, seed=5), (96, 768)
    x = random_activations((tokens, 768), seed=6)
    assert relative_error(to_affine(raw, ggml_type, shape).matmul(x), reference_matmul(x, raw, ggml_type, shape)) \
        <= REASSOCIATION


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
def test_gathered_experts_equal_the_reference(ggml_type):
    shape = (5, 32, 256)
    raw = random_blocks(ggml_type, 5 * 32, 256, seed=7)
    ids = mx.array([4, 0, 4, 2, 1, 1, 3], dtype=mx.int32)
    x = random_activations((7, 256), seed=8)
    w = dequantize(raw, ggml_type, shape)
    want = mx.stack([x[i] @ w[ids[i]].T for i in range(7)])
    assert relative_error(to_affine(raw, ggml_type, shape).gather_matmul(x, ids), want) <= REASSOCIATION


def test_types_without_an_affine_form_are_refused():
    with pytest.raises(ValueError, match="Q2_K has no exact affine form"):
        to_affine(random_blocks(GGMLType.Q2_K, 1, 256), GGMLType.Q2_K, (1, 256))


@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
def test_first_use_checks_pass_on_the_cpu(ggml_type):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AFFINE_MATMUL.enabled(ggml_type) and AFFINE_GATHER.enabled(ggml_type)
    assert not linear.uses_affine(GGMLType.Q2_K) and not linear.uses_affine(GGMLType.F16)


# ---------------------------------------------------------------------------------------------------------------
# The model over affine weights


@pytest.fixture(scope="module")
def q4_weights(tmp_path_factory):
    return open_weights(write_model(tmp_path_factory.mktemp("affine") / "tiny-q4.gguf", preset="tiny", experts="q4"))


def logits(model: Model, tokens: np.ndarray) -> np.ndarray:
    return np.array(model(mx.array(tokens), model.new_cache(64), all_logits=True))


def test_model_holds_affine_weights_near_the_file_size(q4_weights):
    fast = Model(q4_weights)
    with registry.forced_mode("reference"):
        reference = Model(q4_weights)
        assert linear.loaded_nbytes(q4_weights) == reference.nbytes
    assert linear.loaded_nbytes(q4_weights) == fast.nbytes
    assert fast.output._affine is not None and fast.blocks[0].moe.experts.down._affine is not None
    assert reference.output._affine is None and reference.blocks[0].moe.experts.down._affine is None
    # float32 scale and bias: per 32 values, Q8_0's 34 file bytes become 40; per 256, Q4_K's 144 become 192
    assert fast.output.nbytes * 34 == q4_weights.info("output.weight").nbytes * 40
    down = fast.blocks[0].moe.experts.down
    assert down.nbytes * 144 == q4_weights.info("blk.0.ffn_down_exps.weight").nbytes * 192
    assert fast.nbytes < reference.nbytes  # small Q8_0 matrices are no longer float32 copies


def test_reference_mode_after_loading_reproduces_the_reference_path(q4_weights):
    tokens = np.random.default_rng(3).integers(0, q4_weights.config.n_vocab, 40).astype(np.int32)
    fast = Model(q4_weights, simulate_quant=False)
    with registry.forced_mode("reference"):
        reference = logits(Model(q4_weights, simulate_quant=False), tokens)
        # the affine arrays dequantize to the reference values, so the same products give the same bits
        np.testing.assert_array_equal(logits(fast, tokens), reference)
    assert relative_error(mx.array(logits(fast, tokens)), mx.array(reference)) <= REASSOCIATION


def test_grouped_rows_equal_the_dense_einsum(q4_weights):
    model = Model(q4_weights)
    out_a = model.blocks[0].attention.out_a
    groups = q4_weights.config.o_groups
    x = random_activations((5, groups, out_a.shape[1]), seed=9)
    want = mx.einsum("tgi,goi->tgo", x, out_a.weight.reshape(groups, -1, out_a.shape[1])).reshape(5, -1)
    assert relative_error(out_a.grouped(x, groups), want) <= REASSOCIATION
    with registry.forced_mode("reference"):
        assert_same_values(out_a.grouped(x, groups), want)


def test_mlx_has_no_quantized_matmul_for_groups_of_16():
    """Why Q2_K (a scale and min per 16 values) has no affine fast path: MLX 0.32.4 dequantizes groups of 16 but
    its quantized matmuls refuse them. If this starts passing through, Q2_K can become affine like Q4_K."""
    w = mx.zeros((8, 64), dtype=mx.uint32)
    scales = mx.ones((8, 32))
    with pytest.raises(RuntimeError, match="group size"):
        mx.eval(mx.quantized_matmul(mx.ones((1, 256)), w[:, :16], scales[:, :16], scales[:, :16], True, 16, 2))


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
def test_first_use_checks_pass_on_the_gpu(on_gpu, ggml_type):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AFFINE_MATMUL.enabled(ggml_type) and AFFINE_GATHER.enabled(ggml_type)


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", AFFINE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 64])
def test_flash_sized_quantized_matmul_on_the_gpu(on_gpu, ggml_type, tokens):
    shape = (4096, 4096)
    raw = random_blocks(ggml_type, *shape, seed=13)
    x = random_activations((tokens, shape[1]), seed=14)
    weight = to_affine(raw, ggml_type, shape)
    assert_same_values(weight.dequantize(), dequantize(raw, ggml_type, shape))
    assert relative_error(weight.matmul(x), reference_matmul(x, raw, ggml_type, shape)) <= REASSOCIATION
