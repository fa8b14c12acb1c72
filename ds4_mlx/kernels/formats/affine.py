"""Q8_0 and Q4_K weights in MLX's affine quantized layout, multiplied by MLX's built-in quantized matmuls.

MLX's affine layout stores, per group of 32 values along a row, w = scale * q + bias with q unsigned and packed
little-endian into uint32 words. Both GGUF types are exactly that with groups of 32 (a Q8_0 block, a Q4_K
sub-block), and the conversion loses nothing: `mx.dequantize` of the converted arrays equals the reference
dequantizers value for value: bit for bit, except that a zero may carry the other sign (the reference's q * d
is -0 for q = 0 and a negative d, the affine (q + 128) * d - 128 * d is +0), which no sum or product sees.

- Q8_0 (y = d * q, q int8): q_u = q + 128, scale = d, bias = -128 * d. (q + 128) * d is exact in float32 (8-bit
  times 11-bit significands), -128 * d is exact, and their exact sum q * d is representable, so the one rounding
  of scale * q_u + bias returns q * d.
- Q4_K (y = (d * scale_j) * q - dmin * min_j, q in 0..15): scale = d * scale_j and bias = -(dmin * min_j), the
  reference's own float32 factors. scale * q is exact (17 + 4 significant bits), so scale * q + bias rounds once,
  exactly as the reference's dl * q - ml does.

Scales and biases are float32, the activations' type: MLX casts them to the activations' type inside every
quantized matmul otherwise (two extra ops per call, which is what decode on a GPU pays for). Q4_K's d * scale_j
needs up to 17 significant bits anyway, more than float16 holds. So a Q8_0 tensor takes 40 bytes per 32 values
against the file's 34, and Q4_K 192 per 256 against 144.

Q2_K has no exact affine form in MLX 0.32.4: its scale and min change every 16 values, and while `mx.dequantize`
accepts groups of 16, `mx.quantized_matmul` and `mx.gather_qmm` only take 32, 64 or 128. IQ2_XXS values come
from a lattice codebook, not an affine grid. Both get custom kernels (`iq2_xxs.py`, `q2_k.py`).

The matmuls then differ from the reference only in float32 summation order; the first-use checks bound that at
1e-5 of the output's largest magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...model.gguf import BLOCK_SIZES, GGMLType
from ..machinery.probe import random_activations, random_blocks
from .quants import dequantize, q4_k_sub_block_terms, reference_matmul
from ..machinery.registry import FastPath

GROUP_SIZE = 32
BITS = {GGMLType.Q8_0: 8, GGMLType.Q4_K: 4}
"""The GGUF types with an exact affine form, and their quant width."""


@dataclass(frozen=True)
class AffineWeight:
    """A weight (..., OUT, IN) as MLX affine groups of 32 values: w = scales * q + biases."""

    wq: mx.array  # uint32 (..., OUT, IN * bits / 32)
    scales: mx.array  # (..., OUT, IN / 32)
    biases: mx.array
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * GROUP_SIZE)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantize(self) -> mx.array:
        """W as float32, equal to the reference dequantizer's values for the original blocks."""
        return mx.dequantize(self.wq, self.scales, self.biases, GROUP_SIZE, self.bits)

    def take(self, index: mx.array | int) -> AffineWeight:
        """The weight restricted to entries `index` of its first axis (rows of a matrix, experts of a bank)."""
        return AffineWeight(self.wq[index], self.scales[index], self.biases[index], self.bits)

    def matmul(self, x: mx.array) -> mx.array:
        """x @ W.T (W (OUT, IN), or a batch of them against a batch of x)."""
        return mx.quantized_matmul(x, self.wq, self.scales, self.biases, True, GROUP_SIZE, self.bits)

    def gather_matmul(self, x: mx.array, ids: mx.array) -> mx.array:
        """x[i] @ W[ids[i]].T for x (N, IN) and ids (N,) over a bank W (E, OUT, IN): (N, OUT)."""
        y = mx.gather_qmm(x[:, None, :], self.wq, self.scales, self.biases, rhs_indices=ids, transpose=True,
                          group_size=GROUP_SIZE, bits=self.bits)
        return y[:, 0, :]


def affine_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes the affine form of a tensor holds: the packed quants, and a float32 scale and bias per group."""
    values = 1
    for dim in shape:
        values *= dim
    return values * BITS[ggml_type] // 8 + values // GROUP_SIZE * 8


def to_affine(blocks: mx.array, ggml_type: GGMLType, shape: tuple[int, ...]) -> AffineWeight:
    """Convert a tensor's raw Q8_0 or Q4_K blocks (uint8, any shape holding its bytes) of row-major `shape`."""
    if ggml_type not in BITS:
        raise ValueError(f"{GGMLType(ggml_type).name} has no exact affine form; expected Q8_0 or Q4_K")
    lead, n_in = tuple(shape[:-1]), shape[-1]
    block_bytes = BLOCK_SIZES[ggml_type][1]
    blocks = blocks.reshape(-1, block_bytes)
    if ggml_type == GGMLType.Q8_0:
        packed = blocks[:, 2:34] ^ 0x80  # int8 q as uint8, plus 128 modulo 256: q + 128
        scales = mx.view(blocks[:, 0:2], mx.float16).astype(mx.float32)
        biases = scales * -128
    else:
        dl, ml = q4_k_sub_block_terms(blocks)
        q = (blocks[:, 16:144].reshape(-1, 4, 1, 32) >> mx.array([0, 4], dtype=mx.uint8).reshape(1, 1, 2, 1)) & 15
        q = q.reshape(-1, 8, 16, 2)  # eight sub-blocks of 32 quants, in pairs
        packed = q[..., 0] | (q[..., 1] << 4)  # MLX packs element 2i in the low nibble, 2i + 1 in the high one
        scales, biases = dl, -ml
    groups = n_in // GROUP_SIZE
    return AffineWeight(
        wq=mx.view(mx.contiguous(packed).reshape(-1), mx.uint32).reshape(*lead, -1),
        scales=scales.reshape(*lead, groups),
        biases=biases.reshape(*lead, groups),
        bits=BITS[ggml_type],
    )


PROBE_ROWS, PROBE_COLS, PROBE_EXPERTS, PROBE_PAIRS = 64, 512, 3, 6
PROBE_BATCHES = (1, 5, 48)
"""Token counts checked: MLX picks different quantized-matmul kernels for one token, a few, and a prefill chunk."""


def _matmul_probe(ggml_type: GGMLType) -> tuple:
    shape = (PROBE_ROWS, PROBE_COLS)
    x = random_activations((max(PROBE_BATCHES), PROBE_COLS), seed=2)
    return random_blocks(ggml_type, *shape, seed=1), ggml_type, shape, x


def _matmul_reference(blocks, ggml_type, shape, x) -> tuple[mx.array, ...]:
    return dequantize(blocks, ggml_type, shape), *(reference_matmul(x[:n], blocks, ggml_type, shape)
                                                    for n in PROBE_BATCHES)


def _matmul_fast(blocks, ggml_type, shape, x) -> tuple[mx.array, ...]:
    weight = to_affine(blocks, ggml_type, shape)
    return weight.dequantize(), *(weight.matmul(x[:n]) for n in PROBE_BATCHES)


AFFINE_MATMUL = FastPath(
    "affine_matmul", _matmul_reference, _matmul_fast, _matmul_probe,
    tolerance=(0,) + (1e-5,) * len(PROBE_BATCHES),  # dequantization exact; products within float32 reassociation
)
"""Q8_0 / Q4_K matrices as affine arrays through mx.quantized_matmul; key: the ggml type."""


def _gather_probe(ggml_type: GGMLType) -> tuple:
    shape = (PROBE_EXPERTS, PROBE_ROWS, PROBE_COLS)
    blocks = random_blocks(ggml_type, PROBE_EXPERTS * PROBE_ROWS, PROBE_COLS, seed=3)
    ids = mx.array([2, 0, 2, 1, 1, 0], dtype=mx.int32)
    return blocks, ggml_type, shape, random_activations((PROBE_PAIRS, PROBE_COLS), seed=4), ids


def _gather_reference(blocks, ggml_type, shape, x, ids) -> mx.array:
    w = dequantize(blocks, ggml_type, shape)[ids]
    return (x[:, None, :] @ mx.swapaxes(w, 1, 2))[:, 0, :]


def _gather_fast(blocks, ggml_type, shape, x, ids) -> mx.array:
    return to_affine(blocks, ggml_type, shape).gather_matmul(x, ids)


AFFINE_GATHER = FastPath(
    "affine_gather_matmul", _gather_reference, _gather_fast, _gather_probe,
    tolerance=1e-5,  # float32 reassociation
)
"""Selected experts of a Q8_0 / Q4_K bank through mx.gather_qmm; key: the ggml type."""
