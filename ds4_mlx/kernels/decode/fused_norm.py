"""An RMSNorm folded into a matvec kernel: y = (x * rsqrt(mean(x^2) + eps) * w) @ W.T in the matvec's own launch.

A decode token norms its input before several matvecs; as its own op that norm is a launch and a graph node (~5 us
of host time on MLX CUDA, plus the kernel). The matvec kernels read every value of x anyway, so they can sum its
squares as they go (no extra pass over x, no extra barrier), fold the norm weight into the products, and scale
each output by the row's 1 / rms at the end: rsqrt(mean(x^2) + eps) * sum_k x_k w_k W_jk.

A kernel's text is written once with the norm-only lines marked by a leading `@`: the plain variant drops them, so
its text is exactly the un-normed kernel's, the normed one keeps them (the mark removed) and gets NORM_EPS, the
epsilon written into its header (a float cannot be a template argument).

Against the reference, `rms_norm` (MLX's fused kernel) then the plain product, the sums are reassociated: the sum
of squares is taken in the matvec's order, and the scale is applied once to each output instead of to each
activation. Float32 rounding only: a few ulps of the output's scale, inside the matvecs' own tolerances.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from ...model.norm import rms_norm
from ..machinery.dialect import Kernel
from ..machinery.probe import random_activations

Norm = tuple[mx.array, float]
"""The input norm of a matvec: its weight (IN,) float32 and epsilon."""

PROBE_SCALE = 7.0
"""Probe activations are this far from unit rms, so that a kernel that skipped the 1 / rms would fail its check."""


def variant(source: str, norm: bool) -> str:
    """The kernel text without its `@` lines (norm False: the plain kernel) or with them unmarked (norm True)."""
    lines = source.split("\n")
    if norm:
        return "\n".join(line[1:] if line.startswith("@") else line for line in lines)
    return "\n".join(line for line in lines if not line.startswith("@"))


def normed_kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, eps: float,
                  header: str = "") -> Kernel:
    """The normed variant of a text written with `@` lines, for one epsilon: the norm weight as a last input `norm_w`
    and the epsilon in its header (after the plain kernel's `header`); its name carries the epsilon's bits, since
    MLX may cache compiled kernels by name. Callers cache it per epsilon, so that dialect.build compiles it once."""
    bits = struct.unpack("<I", struct.pack("<f", eps))[0]
    return Kernel(f"{name}_norm_{bits:08x}", (*inputs, "norm_w"), outputs, variant(source, True),
                  header + f"CONSTANT float NORM_EPS = {eps!r}f;\n")


def fits(norm: Norm | None, n_in: int) -> bool:
    """Whether a norm can be folded into the kernel: a float32 weight of the row's length (or no norm)."""
    return norm is None or (norm[0].dtype == mx.float32 and norm[0].shape == (n_in,))


def apply(x: mx.array, norm: Norm | None) -> mx.array:
    """The reference's first step: x normed as the model norms it (unchanged without a norm)."""
    return x if norm is None else rms_norm(x, norm[0], norm[1])


def probe_norm(n_in: int, eps: float, seed: int) -> Norm:
    """A norm weight around 1 (trained norms are O(1), some entries near 0 or negative), with the key's epsilon."""
    return 1.0 + 0.5 * random_activations((n_in,), seed=seed), eps
