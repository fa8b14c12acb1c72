"""Partial, adjacent-pair RoPE (ds4.c).

Only the last `n_rot` dims of a head rotate, as pairs (v[2k], v[2k+1]) (GPT-J style), with no permutation of the
file's rows. Layers without compression use plain RoPE (base 10000); compressed layers, their compressor rows and
their indexer use YaRN-interpolated frequencies (base 160000, factor 16) with no magnitude (mscale) factor. The
attention output is de-rotated with the negated angle because values are the (rotated) keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.decode.attention import Rope


@dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation parameters (DeepSeek's variant: no attention scaling)."""

    factor: float
    original_context: int
    beta_fast: float
    beta_slow: float


def inverse_frequencies(n_rot: int, base: float, yarn: Yarn | None = None) -> np.ndarray:
    """theta_k for k = 0..n_rot/2-1 in float32, with the same float32 operations as transformers (bit-exact).

    With YaRN, pairs below `lo` keep the extrapolated frequency, pairs above `hi` are divided by the factor, and
    pairs in between blend linearly (for Flash: lo = 15, hi = 25).
    """
    exponents = np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)
    wavelength = (float(base) ** exponents.astype(np.float64)).astype(np.float32)  # a correctly rounded pow
    freqs = np.float32(1) / wavelength
    if yarn is None:
        return freqs

    def correction_dim(beta: float) -> float:
        return n_rot * math.log(yarn.original_context / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    hi = min(math.ceil(correction_dim(yarn.beta_slow)), n_rot - 1)
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float32) - lo) / np.float32(max(hi - lo, 0.001)), 0, 1)
    keep = np.float32(1) - ramp
    interpolated = np.float32(1) / (np.float32(yarn.factor) * wavelength)
    return (interpolated * (np.float32(1) - keep) + freqs * keep).astype(np.float32)


class RoPE:
    """Rotates the trailing `n_rot` dims of vectors at given absolute positions."""

    def __init__(self, n_rot: int, base: float, yarn: Yarn | None = None):
        self.n_rot = n_rot
        self.inv_freq = mx.array(inverse_frequencies(n_rot, base, yarn))

    def cos_sin(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """cos and sin of the angles, each (len(positions), n_rot/2), float32."""
        return cos_sin(positions, self.inv_freq)

    def __call__(self, x: mx.array, positions: mx.array, inverse: bool = False) -> mx.array:
        """Rotate x (T, ..., D) where row t sits at positions[t]; `inverse` rotates by the negated angle."""
        cos, sin = self.cos_sin(positions)
        return ROTATE(x, cos, sin, self.n_rot, inverse)


def cos_sin(positions: mx.array, inv_freq: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin of the angles positions x inv_freq (float32 products), each (len(positions), len(inv_freq))."""
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    return mx.cos(angles), mx.sin(angles)


def rotate(x: mx.array, cos: mx.array, sin: mx.array, n_rot: int, inverse: bool) -> mx.array:
    """x (T, ..., D) with its trailing n_rot dims rotated in adjacent pairs by angles with these cos and sin
    (T, n_rot / 2), or by the negated angles."""
    if inverse:
        sin = -sin
    extra = x.ndim - 2  # broadcast over the head axes between T and D
    cos = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[1])
    sin = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[1])
    nope, tail = x[..., :-n_rot], x[..., -n_rot:]
    pairs = tail.reshape(*tail.shape[:-1], n_rot // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(tail.shape)
    return mx.concatenate([nope, rotated], axis=-1)


ROTATE = Rope(rotate)
"""`rotate` as one kernel where a GPU backend has passed the first-use check (kernels/decode/attention.py)."""
