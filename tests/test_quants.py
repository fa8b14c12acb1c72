"""The MLX reference dequantizers against gguf-py's numpy ones (bit-exact), and gguf-py against ggml's formulas
by hand."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ2_XXS
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ds4_mlx.errors import LayoutError
from ds4_mlx.kernels.formats.quants import dequantize, reference_matmul
from ds4_mlx.model.gguf import BLOCK_SIZES

# Byte offsets of the f16 scale fields inside one block (ggml's block layouts); F16 tensors are all f16 values.
F16_FIELDS = {
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q4_K: (0, 2),
    T.IQ2_XXS: (0,),
    T.F16: (0,),
}
FLOAT_TYPES = (T.F32, T.F16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS, T.MXFP4)
E8M0_FIELDS = {T.MXFP4: 0}
"""Byte offsets of the E8M0 scale inside one block: 255 is an infinite scale (NaN times a zero code), kept out."""

# Raw f16 bit patterns except NaN and Inf (exponent all ones): every sign, zero, subnormal and normal value.
finite_f16_bits = st.integers(0, 0xFFFF).filter(lambda h: (h >> 10) & 0x1F != 0x1F)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@st.composite
def raw_tensors(draw: st.DrawFn, ggml_type: T) -> np.ndarray:
    """Random uint8 tensor bytes [rows, row_bytes] with finite f16 fields at their offsets in every block."""
    block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
    rows = draw(st.integers(1, 3))
    blocks_per_row = draw(st.integers(1, 3))
    n_blocks = rows * blocks_per_row
    raw = np.frombuffer(draw(st.binary(min_size=n_blocks * block_bytes, max_size=n_blocks * block_bytes)), np.uint8)
    blocks = raw.reshape(n_blocks, block_bytes).copy()
    for offset in F16_FIELDS.get(ggml_type, ()):
        scales = draw(st.lists(finite_f16_bits, min_size=n_blocks, max_size=n_blocks))
        blocks[:, offset : offset + 2] = np.array(scales, dtype="<u2").view(np.uint8).reshape(n_blocks, 2)
    if ggml_type in E8M0_FIELDS:
        blocks[:, E8M0_FIELDS[ggml_type]] = np.minimum(blocks[:, E8M0_FIELDS[ggml_type]], 254)
    return blocks.reshape(rows, blocks_per_row * block_bytes)


def _check_against_gguf(raw: np.ndarray, ggml_type: T) -> None:
    rows, row_bytes = raw.shape
    block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
    shape = (rows, row_bytes // block_bytes * block_elements)
    expected = gguf_dequantize(raw, ggml_type)
    got = dequantize(mx.array(raw), ggml_type, shape)
    assert got.dtype == mx.float32 and tuple(got.shape) == shape
    np.testing.assert_array_equal(_bits(np.array(got)), _bits(expected))


def _block_with_scales(ggml_type: T, f16_bits: int) -> np.ndarray:
    """One block of fixed pseudo-random bytes whose f16 fields all hold `f16_bits`."""
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    block = np.random.default_rng(int(ggml_type)).integers(0, 256, size=(1, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS.get(ggml_type, ()):
        block[0, offset : offset + 2] = np.array([f16_bits], dtype="<u2").view(np.uint8)
    if ggml_type in E8M0_FIELDS:
        block[0, E8M0_FIELDS[ggml_type]] = f16_bits & 0xFE  # an even scale below 255 from the f16 pattern
    return block


@pytest.mark.parametrize("ggml_type", FLOAT_TYPES, ids=lambda t: t.name)
def test_bit_exact_against_gguf_reference(ggml_type: T) -> None:
    """Random bytes everywhere, f16 scales included (negative, zero, subnormal), must decode to the same float32 bits.

    Only NaN/Inf f16 fields are excluded: NaN != NaN (and payloads are not portable across backends), and an
    infinite scale times a zero quant gives NaN. F32 is a pure reinterpretation, so its bytes are not filtered.
    """

    @settings(max_examples=100, deadline=None)
    @given(raw=raw_tensors(ggml_type))
    @example(raw=_block_with_scales(ggml_type, 0x0000))  # +0
    @example(raw=_block_with_scales(ggml_type, 0x8000))  # -0
    @example(raw=_block_with_scales(ggml_type, 0x0001))  # smallest subnormal
    @example(raw=_block_with_scales(ggml_type, 0x83FF))  # largest negative subnormal
    @example(raw=_block_with_scales(ggml_type, 0xFBFF))  # -65504
    def check(raw: np.ndarray) -> None:
        _check_against_gguf(raw, ggml_type)

    check()


def test_mxfp4_scales_and_nibble_order() -> None:
    """E8M0 scales at the edges (e = 0 is 2^-127, a subnormal built from bits 0x00400000), the E2M1 codes, and
    value j in qs[j]'s low nibble, j + 16 in its high one: qs all 0xF6 at e = 127 sums to 16·(−6 + 4) = −32 (the C
    engine's own check)."""
    codes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    for e in (0, 1, 2, 126, 127, 128, 254):
        block = np.zeros((1, 17), np.uint8)
        block[0, 0] = e
        block[0, 1:17] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
        got = np.array(dequantize(mx.array(block.reshape(-1)), T.MXFP4, (1, 32)))[0]
        scale = np.float32(2.0) ** (e - 127) if e else np.uint32(0x00400000).view(np.float32)
        with np.errstate(over="ignore"):  # at e = 254, 6 x 2^127 is past float32: infinity, as the kernel gives
            np.testing.assert_array_equal(got, np.concatenate([codes, codes[::-1]]) * scale)
    block = np.full((1, 17), 0xF6, np.uint8)
    block[0, 0] = 127
    assert np.array(dequantize(mx.array(block.reshape(-1)), T.MXFP4, (1, 32))).sum() == -32


def test_i32_passes_through() -> None:
    values = np.array([[0, 1, -1], [2**31 - 1, -(2**31), 123456]], dtype=np.int32)
    got = dequantize(mx.array(values.reshape(-1).view(np.uint8)), T.I32, (2, 3))
    assert got.dtype == mx.int32
    np.testing.assert_array_equal(np.array(got), values)


@pytest.mark.parametrize("ggml_type", FLOAT_TYPES, ids=lambda t: t.name)
def test_rows_and_expert_tensor(ggml_type: T) -> None:
    """A 3-D expert tensor [E, OUT, IN] decodes expert by expert, row by row; 1-D and 2-D byte inputs agree."""
    block_elements, block_bytes = BLOCK_SIZES[ggml_type]
    experts, out_rows, blocks_per_row = 3, 4, 2
    row_bytes = blocks_per_row * block_bytes
    raw = np.random.default_rng(7).integers(0, 256, size=(experts * out_rows, row_bytes), dtype=np.uint8)
    for offset in F16_FIELDS.get(ggml_type, ()):
        for b in range(blocks_per_row):
            raw[:, b * block_bytes + offset + 1] &= 0x3F  # clear the top exponent bits: finite scales
    shape = (experts, out_rows, blocks_per_row * block_elements)
    whole = np.array(dequantize(mx.array(raw.reshape(-1)), ggml_type, shape))
    as_rows = np.array(dequantize(mx.array(raw), ggml_type, shape))
    assert whole.shape == shape
    np.testing.assert_array_equal(_bits(whole), _bits(as_rows))
    for e in range(experts):
        for o in range(out_rows):
            row = raw[e * out_rows + o : e * out_rows + o + 1]
            single = np.array(dequantize(mx.array(row), ggml_type, (1, shape[-1])))
            np.testing.assert_array_equal(_bits(whole[e, o]), _bits(single[0]))


def test_wrong_byte_count_is_a_clear_error() -> None:
    raw = mx.zeros((2 * 34 - 1,), dtype=mx.uint8)
    with pytest.raises(LayoutError, match=r"Q8_0 tensor of shape \(2, 32\) needs 68 bytes, got 67"):
        dequantize(raw, T.Q8_0, (2, 32))


def test_partial_block_row_is_a_clear_error() -> None:
    with pytest.raises(LayoutError, match="multiple of 256 elements"):
        dequantize(mx.zeros((84,), dtype=mx.uint8), T.Q2_K, (1, 128))


def test_unsupported_type_is_a_clear_error() -> None:
    with pytest.raises(LayoutError, match=r"unsupported ggml type BF16 \(30\); expected one of F32=0"):
        dequantize(mx.zeros((4,), dtype=mx.uint8), 30, (2,))


def test_reference_matmul_is_x_times_w_transposed() -> None:
    """Float32 matmul sums in a backend-chosen order, so this compares with allclose (rtol 1e-5) not bits."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(2 * 5, 34 * 2), dtype=np.uint8)
    raw[:, [1, 35]] &= 0x3F
    w = gguf_dequantize(raw, T.Q8_0).reshape(2, 5, 64)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = np.array(reference_matmul(mx.array(x), mx.array(raw), T.Q8_0, (2, 5, 64)))
    np.testing.assert_allclose(got, x @ w.transpose(0, 2, 1), rtol=1e-5, atol=1e-5 * np.abs(w).max())
    got_2d = np.array(reference_matmul(mx.array(x[0]), mx.array(raw[:5]), T.Q8_0, (5, 64)))
    np.testing.assert_allclose(got_2d, x[0] @ w[0].T, rtol=1e-5, atol=1e-5 * np.abs(w).max())


# Hand-computed blocks: the numbers below come from ggml's formulas worked by hand, so a misreading of them
# by gguf-py (the bit-exact reference above) or by ds4_mlx would show. d = 0.5 (f16 0x3800), dmin = 0.25 (0x3400).


def test_q2_k_hand_computed_block() -> None:
    block = np.zeros(84, dtype=np.uint8)
    # scale byte: low nibble = scale, high nibble = min; index 8*half + 2*j + (l >= 16)
    block[[0, 1, 2, 4, 6, 9]] = [0x21, 0x13, 0x07, 0x32, 0x0F, 0x05]
    block[16 + 0] = 0b11_10_01_00  # element 0 / 32 / 64 / 96 get q = 0 / 1 / 2 / 3 (shift 2j)
    block[16 + 16] = 0x03  # element 16 (half 0, j 0, l 16): q = 3
    block[16 + 32 + 17] = 0x02  # element 145 (half 1, j 0, l 17): q = 2
    block[80:82] = [0x00, 0x38]
    block[82:84] = [0x00, 0x34]
    expected = np.zeros(256, dtype=np.float32)
    expected[0:16] = -0.5  # scale 1, min 2: 0.5*1*0 - 0.25*2
    expected[16:32] = -0.25  # scale 3, min 1, q = 0
    expected[16] = 4.25  # 0.5*3*3 - 0.25*1
    expected[32] = 3.5  # scale 7, min 0: 0.5*7*1
    expected[64:80] = -0.75  # scale 2, min 3, q = 0
    expected[64] = 1.25  # 0.5*2*2 - 0.25*3
    expected[96] = 22.5  # scale 15: 0.5*15*3
    expected[145] = 5.0  # scale 5: 0.5*5*2
    np.testing.assert_array_equal(gguf_dequantize(block[None], T.Q2_K)[0], expected)
    np.testing.assert_array_equal(np.array(dequantize(mx.array(block), T.Q2_K, (256,))), expected)


def test_q4_k_hand_computed_block() -> None:
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = [0x00, 0x38]
    block[2:4] = [0x00, 0x34]
    scales = np.zeros(12, dtype=np.uint8)
    scales[0], scales[4] = 3, 2  # sub-block 0: scale 3, min 2
    scales[1], scales[5] = 0x45, 0x81  # sub-block 1: scale 5, min 1; top bits 1 and 2 feed sub-block 5
    scales[9] = 0x72  # sub-block 5: scale 2 | 1<<4 = 18, min 7 | 2<<4 = 39
    block[4:16] = scales
    qs = block[16:]
    qs[0] = 0x9A  # element 0 (sub-block 0, low nibble): q = 10; element 32 (sub-block 1, high nibble): q = 9
    qs[64 + 3] = 0xC0  # element 131 (sub-block 4): q = 0; element 163 (sub-block 5): q = 12
    expected = np.zeros(256, dtype=np.float32)
    expected[0:32] = -0.5  # 0.5*3*0 - 0.25*2
    expected[0] = 14.5  # 0.5*3*10 - 0.5
    expected[32:64] = -0.25  # 0.5*5*0 - 0.25*1
    expected[32] = 22.25  # 0.5*5*9 - 0.25
    expected[160:192] = -9.75  # 0.5*18*0 - 0.25*39
    expected[163] = 98.25  # 0.5*18*12 - 9.75
    np.testing.assert_array_equal(gguf_dequantize(block[None], T.Q4_K)[0], expected)
    np.testing.assert_array_equal(np.array(dequantize(mx.array(block), T.Q4_K, (256,))), expected)


def test_iq2_xxs_hand_computed_block_and_tables() -> None:
    """ggml's IQ2_XXS: ksigns[i] = i | parity(i) << 7, grid bytes in {8, 25, 43}; one sub-block worked by hand."""
    ksigns = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)
    parity = np.array([bin(i).count("1") & 1 for i in range(128)], dtype=np.uint8)
    np.testing.assert_array_equal(ksigns, np.arange(128, dtype=np.uint8) | (parity << 7))
    IQ2_XXS.init_grid()
    assert set(np.unique(IQ2_XXS.grid)) == {8.0, 25.0, 43.0}

    block = np.zeros(66, dtype=np.uint8)
    block[0:2] = [0x00, 0x3C]  # d = 1.0
    aux = (2 << 28) | (1 << 0) | (3 << 7)  # scale nibble 2; group 0 sign index 1, group 1 sign index 3
    block[2 + 4 : 2 + 8] = np.array([aux], dtype="<u4").view(np.uint8)  # grid indices all 0: grid[0] is eight 8s
    db = 1.0 * (0.5 + 2) * 0.25  # 0.625, so |y| = 5 in sub-block 0
    expected = np.zeros(256, dtype=np.float32)
    expected[0:32] = db * 8
    expected[[0, 7]] = -5.0  # ksigns[1] = 0x81: bits 0 and 7
    expected[[8, 9]] = -5.0  # ksigns[3] = 0x03: bits 0 and 1
    expected[32:] = 0.5 * 0.25 * 8  # other sub-blocks: aux = 0, so db = d*0.5*0.25, all signs +
    np.testing.assert_array_equal(gguf_dequantize(block[None], T.IQ2_XXS)[0], expected)
    np.testing.assert_array_equal(np.array(dequantize(mx.array(block), T.IQ2_XXS, (256,))), expected)


def test_an_mxfp4_file_is_written_loaded_and_named(tmp_path) -> None:
    """`make-model --experts mxfp4`: every routed bank MXFP4 (17-byte blocks of 32), the rest as in the q4 file; the
    loader takes it, and the disk cache counts it as 4-bit."""
    from ds4_mlx.cache.kvstore import routed_quant_bits
    from ds4_mlx.model.factory import write_model
    from ds4_mlx.model.synthetic import SYNTHETIC_KINDS
    from ds4_mlx.model.weights import open_weights

    path = tmp_path / "mxfp4.gguf"
    write_model(path, preset="tiny", experts="mxfp4", seed=2)
    q4 = tmp_path / "q4.gguf"
    write_model(q4, preset="tiny", experts="q4", seed=2)
    weights, reference = open_weights(path), open_weights(q4)
    assert all(types == (T.MXFP4, T.MXFP4) for types in weights.expert_types)
    for name in reference.file.tensors:
        if "_exps." not in name:
            assert weights.info(name).ggml_type == reference.info(name).ggml_type, name
    info = weights.info("blk.0.ffn_down_exps.weight")  # ne (IN, OUT, E): 17 bytes for every 32 inputs
    assert info.nbytes == info.shape[0] // 32 * 17 * info.shape[1] * info.shape[2]
    assert routed_quant_bits(weights) == 4
    assert "mxfp4" in SYNTHETIC_KINDS
