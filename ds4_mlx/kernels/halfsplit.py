"""float32 accuracy from float16 tensor cores: the two-half split of x that grouped_raw.py and dense_f16.py share.

Their W values are exact halves (raw q2 magnitudes and quants, centred affine quants; the scales are applied at
each slice's drain), so only x needs more than a half's 11 significant bits. Each row of x is scaled by a power of
two that puts its largest magnitude in [2^14, 2^15) (`row_scales`, one compiled pass over x: exact, and undone
exactly when the kernel stores the row), then split as it is staged: hi = half(x), lo = half(x - hi)
(`ds4_half2_split`, CUDA prelude). hi + lo carries ~22 bits of x; lo stays a normal half down to 2^-17 of the
row's largest value, and below that its absolute error is at most 2^-39 of it. Each product then takes two
mma.m16n8k16 (lo w, then hi w into the same partial sums), whose products are exact in the float32 sums: ~2^-22
relative is dropped per product, the class of 3xTF32 (2^-21) at two thirds of its mma and twice the depth each.
"""

from __future__ import annotations

import mlx.core as mx

X_TOP = 14
"""A row's largest magnitude is scaled into [2^14, 2^15): below float16's largest value (65504) after rounding."""


@mx.compile
def row_scales(x: mx.array) -> mx.array:
    """The power of two per row of x (N, IN) that brings its largest magnitude into [2^X_TOP, 2^(X_TOP+1)), as
    float32 (N,). Zero rows get 2^127 (their values stay zero), rows holding an infinity or a NaN a small scale
    (they stay non-finite)."""
    amax = mx.max(mx.abs(x), axis=-1)
    exponent = mx.right_shift(amax.view(mx.uint32), 23).astype(mx.int32) - 127
    k = mx.clip(X_TOP - exponent, -126, 127)
    return mx.left_shift((k + 127).astype(mx.uint32), 23).view(mx.float32)
