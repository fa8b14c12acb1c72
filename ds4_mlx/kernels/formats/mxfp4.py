"""MXFP4 expert banks in MLX's own "mxfp4" quantized layout, multiplied by MLX's quantized matmuls.

GGUF's MXFP4 (ggml type 39) and MLX's `mode="mxfp4"` are one format, the OCP microscaling FP4: groups of 32 values
along a row share one E8M0 scale byte e (2^(e - 127)), and each value is a 4-bit E2M1 code (0, 0.5, 1, 1.5, 2, 3,
4, 6 and their negatives; E2M1 is not a uniform grid, so MLX's affine form could not hold it exactly). Only the
order of the codes differs: a GGUF block holds value j in the low nibble of its byte j and value j + 16 in the
high nibble, MLX packs value 2i in the low nibble of byte i and value 2i + 1 in the high one (read as little-endian
uint32 words). `to_mx` moves the nibbles and keeps the scale byte as it is: nothing is rounded, and the form holds
17 bytes per 32 values, the file's size exactly.

`mx.dequantize` of the repacked arrays gives the reference dequantizer's values (quants.dequantize_mxfp4) for every
scale byte and code on MLX's CPU backend (tests/test_kernels_mxfp4.py): e = 0 is 2^-127, e = 255 is infinity, as in
ggml. The one difference is E2M1's code 8, -0 in MLX and +0 in ggml's table, which no sum or product tells apart.
MLX 0.32.4's Metal kernels decode E8M0 the same way (0 -> 2^-127, other bytes e << 23: its fp8.h); its CUDA
kernels read scales as cutlass's float_ue8m0_t. Trained weights use neither extreme byte, and on every backend the
first-use checks compare the repacked form's dequantized values exactly and its products within float32
reassociation before any bank is repacked (model/linear.py's `uses_mx`).

The activations stay float32: MLX's quantized matmuls compute in the activations' type.

Where the form is used (model/linear.py's `uses_mx`): the CPU, and a GPU backend whose MXFP4 kernels over raw blocks
(kernels/decode/mxfp4_matvec.py, the fused expert kernels) failed their checks. Elsewhere GPU backends keep the
blocks as stored for those kernels and repack a bank here only for a prefill chunk's grouped GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...model.gguf import BLOCK_SIZES, GGMLType
from ..machinery.probe import random_activations, random_blocks
from ..machinery.registry import FastPath
from .quants import dequantize

GROUP_SIZE = 32
MODE = "mxfp4"
_BLOCK_BYTES = BLOCK_SIZES[GGMLType.MXFP4][1]


@dataclass(frozen=True)
class MxWeight:
    """A weight (..., OUT, IN) in MLX's mxfp4 layout: w = 2^(scales - 127) * E2M1[q], 32 values a scale."""

    wq: mx.array  # uint32 (..., OUT, IN / 8): eight 4-bit codes a word, the first in the low bits
    scales: mx.array  # uint8 (..., OUT, IN / 32): the E8M0 bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * GROUP_SIZE)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scales.nbytes

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """W as `dtype`. In float32 (and bfloat16, whose exponent range is float32's and whose 8 significant bits
        hold E2M1's 2) these are the reference dequantizer's values exactly."""
        return mx.dequantize(self.wq, self.scales, None, GROUP_SIZE, 4, MODE, dtype=dtype)

    def take(self, index: mx.array | int) -> MxWeight:
        """The weight restricted to entries `index` of its first axis (the experts of a bank)."""
        return MxWeight(self.wq[index], self.scales[index])

    def gather_matmul(self, x: mx.array, ids: mx.array, sorted_indices: bool = False) -> mx.array:
        """x[i] @ W[ids[i]].T for x (N, IN) and ids (N,) over a bank W (E, OUT, IN): (N, OUT). With
        `sorted_indices`, ids must be ascending (MLX then reads each expert once for its run of pairs)."""
        y = mx.gather_qmm(x[:, None, :], self.wq, self.scales, None, rhs_indices=ids, transpose=True,
                          group_size=GROUP_SIZE, bits=4, mode=MODE, sorted_indices=sorted_indices)
        return y[:, 0, :]


def mx_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes the mxfp4 form of a tensor of row-major `shape` holds: half a byte a value and a byte per 32, the same
    as its MXFP4 blocks in the file."""
    values = 1
    for dim in shape:
        values *= dim
    return values // 2 + values // GROUP_SIZE


def to_mx(blocks: mx.array, shape: tuple[int, ...]) -> MxWeight:
    """Repack a tensor's raw MXFP4 blocks (uint8, any shape holding its bytes) of row-major `shape`."""
    lead, n_in = tuple(shape[:-1]), shape[-1]
    blocks = blocks.reshape(-1, _BLOCK_BYTES)
    qs = blocks[:, 1:]
    codes = mx.concatenate([qs & 15, qs >> 4], axis=1).reshape(-1, 16, 2)  # values 0..31 of each block, in pairs
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return MxWeight(wq=mx.view(mx.contiguous(packed).reshape(-1), mx.uint32).reshape(*lead, n_in // 8),
                    scales=blocks[:, 0].reshape(*lead, n_in // GROUP_SIZE))


PROBE_EXPERTS, PROBE_ROWS, PROBE_COLS = 3, 64, 512
PROBE_PAIRS = (1, 6, 32)
"""Pair counts checked: one decode token's slot, a few, and the most a decode step gathers (moe.GATHER_LIMIT)."""


def _gather_probe(ggml_type: GGMLType) -> tuple:
    shape = (PROBE_EXPERTS, PROBE_ROWS, PROBE_COLS)
    blocks = random_blocks(ggml_type, PROBE_EXPERTS * PROBE_ROWS, PROBE_COLS, seed=31)
    ids = mx.array([(7 * i + 2) % PROBE_EXPERTS for i in range(max(PROBE_PAIRS))], dtype=mx.uint32)
    return blocks, shape, random_activations((max(PROBE_PAIRS), PROBE_COLS), seed=32), ids


def _gather_reference(blocks, shape, x, ids) -> tuple[mx.array, ...]:
    w = dequantize(blocks, GGMLType.MXFP4, shape)
    return w, *((x[:n, None, :] @ mx.swapaxes(w[ids[:n]], 1, 2))[:, 0, :] for n in PROBE_PAIRS)


def _gather_fast(blocks, shape, x, ids) -> tuple[mx.array, ...]:
    weight = to_mx(blocks, shape)
    return weight.dequantize(), *(weight.gather_matmul(x[:n], ids[:n]) for n in PROBE_PAIRS)


MXFP4_GATHER = FastPath(
    "mxfp4_gather_matmul", _gather_reference, _gather_fast, _gather_probe,
    tolerance=(0,) + (1e-5,) * len(PROBE_PAIRS),  # dequantization exact; products within float32 reassociation
)
"""Selected experts of an MXFP4 bank repacked to MLX's mxfp4 form, through mx.gather_qmm; key: the ggml type."""
