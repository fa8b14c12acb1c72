"""Small random inputs for the first-use checks of fast paths: valid quant blocks and activations.

Every byte of a block is random except its scales, which are drawn from the range trained weights use so that no
value is infinite or NaN: f16 scales |d| about 2^-12 to 2^-5, both signs, and MXFP4's E8M0 byte from 2^-12 to 2^-5.
Random bytes reach every quant value, every sign pattern and every sub-block scale, including the extremes (-128 in
Q8_0, 63 in Q4_K's 6-bit fields).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...model.gguf import BLOCK_SIZES, GGMLType

# byte offsets of the f16 scale fields in each block type
_SCALE_FIELDS = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q4_K: (0, 2),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.MXFP4: (),
}
_E8M0_FIELDS = {GGMLType.MXFP4: 0}
"""Byte offsets of the E8M0 (power of two) scale bytes."""


def random_blocks(ggml_type: GGMLType, rows: int, cols: int, seed: int = 0) -> mx.array:
    """Raw blocks of a random (rows, cols) tensor of `ggml_type`, as uint8 [rows, row_bytes]."""
    block_elements, block_bytes = BLOCK_SIZES[ggml_type]
    if cols % block_elements:
        raise ValueError(f"{ggml_type.name} rows hold multiples of {block_elements} values, got {cols}")
    rng = np.random.default_rng(seed)
    n_blocks = rows * cols // block_elements
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for offset in _SCALE_FIELDS[ggml_type]:
        scale = rng.choice([-1.0, 1.0], n_blocks) * np.exp2(rng.uniform(-12, -5, n_blocks))
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if ggml_type in _E8M0_FIELDS:
        blocks[:, _E8M0_FIELDS[ggml_type]] = rng.integers(127 - 12, 127 - 5 + 1, n_blocks, dtype=np.uint8)
    return mx.array(blocks.reshape(rows, -1))


def random_activations(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    """Float32 activations of unit scale."""
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
