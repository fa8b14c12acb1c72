"""Reference dequantizers for the GGML tensor types in DeepSeek V4 Flash GGUF files.

These are written in plain MLX ops so they run on every backend. They are the source of truth that the fused
dequant-matmul kernels are checked against, so each one follows ggml's `dequantize_row_*` operation by operation:
the results are bit-exact in float32 with ggml and with `gguf.quants`.

A quantized tensor is a run of fixed-size blocks; each block holds `block_elements` values in `block_bytes` bytes,
and a row of the tensor is a whole number of blocks. Every dequantizer takes blocks as uint8 `[n_blocks,
block_bytes]` and returns float32 `[n_blocks, block_elements]`.
"""

from __future__ import annotations

from functools import cache
from math import prod

import mlx.core as mx
from gguf.quants import IQ2_XXS

from ...errors import LayoutError
from ...model.gguf import BLOCK_SIZES, GGMLType, type_name


def _f16(pair: mx.array) -> mx.array:
    """Read little-endian IEEE half scales stored as byte pairs `[n, 2]` into float32 `[n, 1]`."""
    return mx.view(pair, mx.float16).astype(mx.float32)


def dequantize_q8_0(blocks: mx.array) -> mx.array:
    """Q8_0, 32 values in 34 bytes: d (f16), then 32 int8 quants. y = d * q."""
    d = _f16(blocks[:, 0:2])
    q = mx.view(blocks[:, 2:34], mx.int8).astype(mx.float32)
    return q * d


def dequantize_q2_k(blocks: mx.array) -> mx.array:
    """Q2_K, 256 values in 84 bytes: scales[16], qs[64], d (f16), dmin (f16).

    Each half of 128 values reads 32 bytes of qs four times, two bits at a time (shift 0, 2, 4, 6); every run of 16
    values has its own 4-bit scale (low nibble) and 4-bit min (high nibble). y = (d * scale) * q - dmin * min.
    """
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    qs = blocks[:, 16:80]
    d = _f16(blocks[:, 80:82])
    dmin = _f16(blocks[:, 82:84])
    dl = (d * (scales & 15).astype(mx.float32))[..., None]
    ml = (dmin * (scales >> 4).astype(mx.float32))[..., None]
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3
    q = q.reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


def _q4_k_scales_mins(scales: mx.array) -> tuple[mx.array, mx.array]:
    """Unpack the eight 6-bit (scale, min) pairs of a Q4_K block from its 12 packed bytes.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from
    the nibbles of bytes 8-11 and their high 2 bits from the top bits of bytes 0-3 / 4-7.
    """
    packed = scales.reshape(-1, 3, 4)
    low, high, nibbles = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = mx.concatenate([low & 63, (nibbles & 15) | ((low >> 6) << 4)], axis=-1)
    mn = mx.concatenate([high & 63, (nibbles >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mn


def q4_k_sub_block_terms(blocks: mx.array) -> tuple[mx.array, mx.array]:
    """The float32 factors (d * scale_j, dmin * min_j), each [n_blocks, 8], of a Q4_K block's eight sub-blocks.

    A sub-block's value is y = (d * scale_j) * q - dmin * min_j for its 4-bit quants q.
    """
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _q4_k_scales_mins(blocks[:, 4:16])
    return d * sc.astype(mx.float32), dmin * mn.astype(mx.float32)


def dequantize_q4_k(blocks: mx.array) -> mx.array:
    """Q4_K, 256 values in 144 bytes: d (f16), dmin (f16), scales[12], qs[128].

    Eight sub-blocks of 32 values; sub-blocks 2k and 2k+1 share 32 bytes of qs (low, then high nibble).
    y = (d * scale_j) * q - dmin * min_j.
    """
    n = blocks.shape[0]
    dl, ml = q4_k_sub_block_terms(blocks)
    dl, ml = dl[..., None], ml[..., None]
    shifts = mx.array([0, 4], dtype=mx.uint8).reshape(1, 1, 2, 1)
    q = (blocks[:, 16:144].reshape(n, 4, 1, 32) >> shifts) & 15
    q = q.reshape(n, 8, 32).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


@cache
def _iq2_xxs_tables() -> tuple[mx.array, mx.array]:
    """ggml's iq2xxs_grid as float32 [256, 8] magnitudes (each 8, 25 or 43) and ksigns_iq2xs as uint8 [128]."""
    IQ2_XXS.init_grid()
    grid = mx.array(IQ2_XXS.grid.reshape(256, 8))
    ksigns = mx.array(list(IQ2_XXS.ksigns), dtype=mx.uint8)
    return grid, ksigns


def dequantize_iq2_xxs(blocks: mx.array) -> mx.array:
    """IQ2_XXS, 256 values in 66 bytes: d (f16), then eight 8-byte sub-blocks of 32 values.

    A sub-block is four grid indices (u8) and a u32 A: the sub-block scale is d * (0.5 + A >> 28) * 0.25, and
    7-bit fields of A (shifts 0, 7, 14, 21) pick a sign mask for each group of 8 grid values.
    """
    n = blocks.shape[0]
    grid, ksigns = _iq2_xxs_tables()
    d = _f16(blocks[:, 0:2])
    sub = blocks[:, 2:66].reshape(n, 8, 8)
    aux = mx.view(sub[:, :, 4:8], mx.uint32)
    db = d * (0.5 + (aux[..., 0] >> 28).astype(mx.float32)) * 0.25
    sign_shifts = mx.array([0, 7, 14, 21], dtype=mx.uint32)
    masks = ksigns[(aux >> sign_shifts) & 127]
    bits = (masks[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1
    signs = mx.where(bits == 1, mx.array(-1.0), mx.array(1.0))
    magnitudes = grid[sub[:, :, 0:4]]
    return (db[..., None, None] * magnitudes * signs).reshape(n, 256)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The FP4 (E2M1) code values of MXFP4, by 4-bit code. Code 8 (E2M1's −0) decodes to +0, as ggml's table of
halved integers gives it."""


def dequantize_mxfp4(blocks: mx.array) -> mx.array:
    """MXFP4, 32 values in 17 bytes: an E8M0 scale byte e, then 16 bytes of 4-bit E2M1 codes (the OCP
    microscaling format, ggml type 39). y = 2^(e - 127) · E2M1[q]: value j is the low nibble of qs[j], value j + 16
    its high nibble. The scale is built as float32 bits e << 23, so e = 0 is the subnormal 2^-127 (and 255 is
    infinity), as ggml and the C engine build it."""
    e = blocks[:, 0].astype(mx.uint32)
    d = mx.view(mx.where(e == 0, mx.array(0x00400000, mx.uint32), e << 23), mx.float32)
    qs = blocks[:, 1:17]
    codes = mx.concatenate([qs & 15, qs >> 4], axis=1)
    return d[:, None] * mx.array(E2M1)[codes]


_BLOCK_DEQUANTIZERS = {
    GGMLType.Q8_0: dequantize_q8_0,
    GGMLType.Q2_K: dequantize_q2_k,
    GGMLType.Q4_K: dequantize_q4_k,
    GGMLType.IQ2_XXS: dequantize_iq2_xxs,
    GGMLType.MXFP4: dequantize_mxfp4,
}


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and row-major shape occupies; its rows must be whole blocks."""
    ggml_type = _supported(ggml_type)
    block_elements, block_bytes = BLOCK_SIZES[ggml_type]
    if not shape or shape[-1] % block_elements:
        raise LayoutError(
            f"a {ggml_type.name} tensor needs rows that are a multiple of {block_elements} elements, got shape {shape}"
        )
    return prod(shape) // block_elements * block_bytes


def _supported(ggml_type: int) -> GGMLType:
    if ggml_type not in BLOCK_SIZES:
        names = ", ".join(f"{t.name}={int(t)}" for t in GGMLType)
        raise LayoutError(f"unsupported ggml type {type_name(ggml_type)} ({int(ggml_type)}); expected one of {names}")
    return GGMLType(ggml_type)


def dequantize(data: mx.array, ggml_type: int, shape: tuple[int, ...]) -> mx.array:
    """Decode a tensor's raw bytes into an array of `shape` (row-major, i.e. the GGUF ne reversed).

    `data` is uint8, 1-D or `[rows, row_bytes]`. Returns float32, except I32 which stays int32.
    """
    shape = tuple(shape)
    ggml_type = _supported(ggml_type)
    if data.dtype != mx.uint8:
        raise TypeError(f"dequantize expects the tensor's raw bytes as uint8, got {data.dtype}")
    expected = tensor_nbytes(ggml_type, shape)
    if data.size != expected:
        raise LayoutError(
            f"a {ggml_type.name} tensor of shape {shape} needs {expected} bytes, got {data.size}"
        )
    flat = data.reshape(-1)
    if ggml_type == GGMLType.F32:
        values = mx.view(flat, mx.float32)
    elif ggml_type == GGMLType.F16:
        values = mx.view(flat, mx.float16).astype(mx.float32)
    elif ggml_type == GGMLType.I32:
        values = mx.view(flat, mx.int32)
    else:
        block_bytes = BLOCK_SIZES[ggml_type][1]
        values = _BLOCK_DEQUANTIZERS[ggml_type](flat.reshape(-1, block_bytes))
    return values.reshape(shape)


def reference_matmul(x: mx.array, data: mx.array, ggml_type: int, shape: tuple[int, ...]) -> mx.array:
    """x @ W^T for a stored weight W of `shape` [..., OUT, IN]: the result every fused dequant-matmul must equal.

    For a 3-D expert tensor [E, OUT, IN], x broadcasts against the expert axis: x [E, T, IN] → [E, T, OUT].
    """
    w = dequantize(data, ggml_type, shape)
    return x @ mx.swapaxes(w, -1, -2)
