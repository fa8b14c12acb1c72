"""Activation quantisation simulation (ds4.c).

DeepSeek V4 was trained with quantisation-aware activations: the KV cache rows are stored as FP8 E4M3 and
the indexer's queries and keys as FP4 E2M1 after a Hadamard rotation. ds4 reproduces those round trips in
float32, so the values the attention sees are the ones the model was trained to see. transformers omits
them; the model switches them off with `simulate_quant=False` to compare against it.

Every rounding here is exact arithmetic on float32 bit patterns (no log2/exp2 approximations), so results
are identical on every backend. `finish_rows` is what a row goes through before it is stored or used: RMSNorm,
RoPE, one of these simulations and ds4's float16 round, one launch on GPU backends (FINISH_ROWS).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ds4_mlx.kernels.sublayers.actquant import FP8KV, IndexerFP4
from ds4_mlx.kernels.sublayers.rows import FinishIntoWindow, FinishRows, Norm, RowQuant
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.rope import RoPE

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 64
FP8_AMAX_FLOOR = 1e-4
FP4_E2M1_MAX = 6.0
FP4_BLOCK = 32
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def _exponent(x: mx.array) -> mx.array:
    """floor(log2|x|) of float32 x, read from the exponent bits (-127 for zero and subnormals)."""
    bits = mx.abs(x).astype(mx.float32).view(mx.uint32)
    return (mx.right_shift(bits, 23).astype(mx.int32)) - 127


def _ceil_log2(x: mx.array) -> mx.array:
    """ceil(log2 x) for positive normal float32 x: the exponent, plus one unless x is a power of two."""
    bits = x.astype(mx.float32).view(mx.uint32)
    exponent = mx.right_shift(bits, 23).astype(mx.int32) - 127
    return exponent + (mx.bitwise_and(bits, 0x7FFFFF) != 0).astype(mx.int32)


def _pow2(k: mx.array) -> mx.array:
    """2**k as float32 for integer k in [-126, 127], built from the exponent bits."""
    return mx.left_shift((k + 127).astype(mx.uint32), 23).view(mx.float32)


def _round_to_minifloat(x: mx.array, mantissa_bits: int, min_exponent: int, max_value: float) -> mx.array:
    """Round x to the nearest value of a small float format (ties to even), saturating at max_value.

    The format has `mantissa_bits` explicit mantissa bits and smallest normal exponent `min_exponent`;
    below it the spacing stays 2**(min_exponent - mantissa_bits) (subnormals).
    """
    x = mx.clip(x, -max_value, max_value)
    step = _pow2(mx.maximum(_exponent(x), min_exponent) - mantissa_bits)
    return mx.round(x / step) * step


def _block_roundtrip(
    x: mx.array, block: int, amax_floor: float, max_value: float, mantissa_bits: int, min_exponent: int
) -> mx.array:
    """Scale each block of the last axis by a power of two so its amax fits max_value, round, scale back."""
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), amax_floor)
    scale = _pow2(_ceil_log2(amax / max_value))
    rounded = _round_to_minifloat(blocks / scale, mantissa_bits, min_exponent, max_value)
    return (rounded * scale).reshape(shape)


def fp8_e4m3_roundtrip(x: mx.array, block: int = FP8_BLOCK) -> mx.array:
    """FP8 E4M3FN round trip in blocks along the last axis (amax floor 1e-4, scale 2^ceil(log2(amax/448)))."""
    return _block_roundtrip(x, block, FP8_AMAX_FLOOR, FP8_E4M3_MAX, mantissa_bits=3, min_exponent=-6)


def fp4_e2m1_roundtrip(x: mx.array, block: int = FP4_BLOCK) -> mx.array:
    """FP4 E2M1 round trip in blocks of `block` along the last axis (values 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    return _block_roundtrip(x, block, FP4_AMAX_FLOOR, FP4_E2M1_MAX, mantissa_bits=1, min_exponent=0)


def hadamard(x: mx.array) -> mx.array:
    """Orthonormal Walsh-Hadamard transform of the last axis (Sylvester order), as ds4's butterflies compute it."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two width, got {n}")
    lead = x.shape[:-1]
    stride = 1
    while stride < n:
        pairs = x.reshape(*lead, n // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        stride *= 2
    return x * (1.0 / math.sqrt(n))


def kv_fp8(kv: mx.array, n_rot: int) -> mx.array:
    """FP8 round trip of a KV row's non-RoPE dims (the trailing `n_rot` RoPE dims stay exact)."""
    nope = kv.shape[-1] - n_rot
    return mx.concatenate([fp8_e4m3_roundtrip(kv[..., :nope]), kv[..., nope:]], axis=-1)


def indexer_fp4(x: mx.array) -> mx.array:
    """Hadamard rotation then FP4 round trip of indexer queries and keys (rotation keeps q.k for exact values)."""
    return fp4_e2m1_roundtrip(hadamard(x))


simulate_kv_fp8 = FP8KV(kv_fp8)
"""`kv_fp8`, as one exact kernel where a GPU backend has passed the first-use check (kernels/sublayers/actquant.py)."""
simulate_indexer_fp4 = IndexerFP4(indexer_fp4)
"""`indexer_fp4`, likewise."""


def round_to_f16(x: mx.array) -> mx.array:
    """Round float32 values to half precision, as ds4 stores its raw KV ring."""
    return x.astype(mx.float16).astype(mx.float32)


def finish_rows(x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                round_half: bool) -> mx.array:
    """Rows x (T, ..., W) as they are stored or used, row t at positions[t]: RMSNorm (`norm`: weight or None, eps)
    when given, `rope`, the quantisation simulation `quant`, then the float16 round when `round_half`."""
    if norm is not None:
        x = rms_norm(x, *norm)
    x = rope(x, positions)
    if quant == RowQuant.KV_FP8:
        x = simulate_kv_fp8(x, rope.n_rot)
    elif quant == RowQuant.INDEXER_FP4:
        x = simulate_indexer_fp4(x)
    return round_to_f16(x) if round_half else x


FINISH_ROWS = FinishRows(finish_rows)
"""`finish_rows` as one kernel where a GPU backend has passed the first-use check (kernels/sublayers/rows.py)."""
FINISH_INTO_WINDOW = FinishIntoWindow(FINISH_ROWS)
"""A decode token's finished KV row appended to the raw window (its oldest row dropped), as one kernel where a GPU
backend has passed the first-use check; otherwise FINISH_ROWS and a concatenation."""
