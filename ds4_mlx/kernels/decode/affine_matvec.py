"""A few rows times an affine 8-bit (Q8_0) or 4-bit (Q4_K) matrix in one launch, for decode.

y = x @ W.T for x (T, IN) float32 with T <= MAX_TOKENS and W an `AffineWeight` (OUT, IN), or y[i] = x[i] @
W[ids[i]].T over a bank (E, OUT, IN). Decode reads each weight once, so this is written for memory bandwidth: on
the H200 MLX's built-in one-token kernel (`qmv`) moved 0.6-0.8 TB/s at Flash's attention and shared-expert sizes
and ~1.15 TB/s on the LM head, and costs ~10 us of host time per launch against ~3.3 us for a custom kernel.

- A threadgroup owns ROWS consecutive rows of one matrix (grid y: the slot, which picks the matrix through ids);
  its SIMDS x 32 threads split the rows into 16-byte loads of wq (16 values at 8 bits, 32 at 4 bits: always
  inside one group of 32), consecutive threads on consecutive loads, about two loads each (`launch_plan`).
- Per load a thread reads the group's scale and bias once per row, then the activations of every token with
  16-byte loads (x is at most 8 x 32 KB, so they come from L1/L2); each activation feeds all ROWS rows.
- A quant q becomes a float with one byte permute and one subtraction: the bits 0x4B000000 | q are the float
  2^23 + q (ds4_byte_float), and minus 2^23 + C it is q - C exactly, C = 2^(BITS-1) the middle of the range.
  Per 4 values w . x = s * sum (q - C) x + (b + C s) * sum x; for Q8_0 (b = -128 s exactly) the second term is
  exactly zero. The scale is applied per 4 values rather than once per load so that its use comes first: with
  the scale and bias loads written before the quant loads, the CUDA compiler then issues all of a step's loads
  together (checked in the SASS); used only at the end, they were sunk below the arithmetic, costing a second
  memory round trip per step.
- One SIMD reduction per (row, token), then the SIMDS partial sums in threadgroup memory, added in a fixed order.

- With `norm` the input RMSNorm is folded in (kernels/decode/fused_norm.py): each thread also sums the squares of the
  activations it reads (the threadgroup reads every value of its row(s) of x exactly once), multiplies them by
  the norm weight before use, and the final sum is scaled by the row's 1 / rms. Over a bank each slot's row is
  normed by its own sum. Without a norm the kernel's text is exactly the plain one.
- `SwigluMatvec` (the shared expert's down projection) takes rows of 2 IN, [gate | up], and multiplies W by
  swiglu(gate, up): each thread computes the activations of its loads from their gate and up values as it reads
  them (`%` lines; X_ROW, the row stride of x, is 2 IN there and IN in the other variants), so the SwiGLU is no
  op of its own. A threadgroup reads each activation once, for all its rows: an exp per value and threadgroup.

Its reference is the path it replaces: `mx.quantized_matmul` (or `mx.gather_qmm` for a bank), after
`rms_norm` when normed or the model's SwiGLU, itself checked against the reference dequantizer
(kernels/formats/affine.py). They differ in float32 rounding and summation order only (TOLERANCE).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from functools import cache

import mlx.core as mx

from ...model.gguf import GGMLType
from ..formats.affine import AffineWeight, to_affine
from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from .fused_norm import PROBE_SCALE, Norm, apply, fits, normed_kernel, probe_norm, variant
from ..machinery.probe import random_activations, random_blocks
from ..machinery.registry import FastPath, current_backend

MAX_TOKENS = 8
"""Most activation rows per launch (decode, speculative drafts); more take the built-in matmuls."""
TOLERANCE = 1e-5
"""Float32 rounding and summation order only (4-value sums scaled one by one, then per thread, SIMD group and
threadgroup): ~1e-7 per add over IN <= 8192 terms, with margin; the bound the built-in quantized matmuls are held
to (affine.py). Measured on the CPU emulation (tests/test_kernels_emulated.py): ~1e-7 of the largest output.
With the norm folded in, up to ~3e-6 against MLX's CPU rms_norm, whose own 1 / rms is off by up to ~1e-6
(the kernel is within ~1e-7 of a float64 evaluation); the same bound holds."""
MIN_THREADGROUPS = 128
"""Rows per threadgroup shrink until a matrix spreads over at least this many (about one per SM of an H200).
Measured on the H200 (bench/matvec_plans.py, 2026-12-02): every Flash shape is fastest at 4 or 8 rows; one row a
threadgroup (which a floor of 1024 gave the joined q_a / kv and the output projection's groups) took 1.6-2x as
long, each threadgroup reading all of x (and the norm weight) for its one row."""

_SOURCE = """
const int WORD_VALUES = 32 / BITS;
const int UNIT_VALUES = 4 * WORD_VALUES;
const int UNITS = IN / UNIT_VALUES;
const int GROUPS = IN / 32;
const int THREADS = SIMDS * 32;
const int STEPS = (UNITS + THREADS - 1) / THREADS;
const float CENTRE = (float)(1 << (BITS - 1));
const float MAGIC = 8388608.0f + CENTRE;

SHARED float part[SIMDS * ROWS * TOKENS];
@SHARED float squares_part[SIMDS * TOKENS];

const int slot = GROUP_Y;
const int first_row = GROUP_X * ROWS;
const size_t first_bank_row = (size_t)ids[slot] * OUT;
size_t row[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  row[r] = first_bank_row + (size_t)(first_row + r < OUT ? first_row + r : OUT - 1);
}
const GLOBAL_MEM uint4* wv = reinterpret_cast<const GLOBAL_MEM uint4*>(wq);
const GLOBAL_MEM float4* xv = reinterpret_cast<const GLOBAL_MEM float4*>(x + (size_t)slot * TOKENS * X_ROW);

float acc[ROWS][TOKENS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    acc[r][t] = 0.0f;
  }
}
@const GLOBAL_MEM float4* nv = reinterpret_cast<const GLOBAL_MEM float4*>(norm_w);
@float squares[TOKENS];
@#pragma unroll
@for (int t = 0; t < TOKENS; ++t) {
@  squares[t] = 0.0f;
@}

for (int step = 0; step < STEPS; ++step) {
  const int u = step * THREADS + (int)THREAD_IN_GROUP;
  if (UNITS % THREADS == 0 || u < UNITS) {
    const int group = u * UNIT_VALUES / 32;
    unsigned int q[ROWS][4];
    float scale[ROWS];
    float centre[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      scale[r] = scales[row[r] * GROUPS + group];
      centre[r] = biases[row[r] * GROUPS + group];
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint4 v = wv[row[r] * UNITS + u];
      q[r][0] = v.x;
      q[r][1] = v.y;
      q[r][2] = v.z;
      q[r][3] = v.w;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      centre[r] += CENTRE * scale[r];
    }
#pragma unroll
    for (int j = 0; j < UNIT_VALUES / 4; ++j) {
      float4 xj[TOKENS];
      float xsum[TOKENS];
@      const float4 nj = nv[u * UNIT_VALUES / 4 + j];
#pragma unroll
      for (int t = 0; t < TOKENS; ++t) {
        xj[t] = xv[(t * X_ROW + u * UNIT_VALUES) / 4 + j];
%        xj[t] = ds4_swiglu4(xj[t], xv[(t * X_ROW + IN + u * UNIT_VALUES) / 4 + j]);
@        squares[t] += (xj[t].x * xj[t].x + xj[t].y * xj[t].y) + (xj[t].z * xj[t].z + xj[t].w * xj[t].w);
@        xj[t].x *= nj.x;
@        xj[t].y *= nj.y;
@        xj[t].z *= nj.z;
@        xj[t].w *= nj.w;
        xsum[t] = (xj[t].x + xj[t].y) + (xj[t].z + xj[t].w);
      }
      const int word = j * 4 / WORD_VALUES;
      const int quad = j * 4 % WORD_VALUES / 4;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const unsigned int lo = BITS == 8 ? q[r][word] : q[r][word] & 0x0F0F0F0Fu;
        const unsigned int hi = BITS == 8 ? q[r][word] : (q[r][word] >> 4) & 0x0F0F0F0Fu;
        const float q0 = ds4_byte_float(lo, BITS == 8 ? 0 : 2 * quad) - MAGIC;
        const float q1 = ds4_byte_float(hi, BITS == 8 ? 1 : 2 * quad) - MAGIC;
        const float q2 = ds4_byte_float(lo, BITS == 8 ? 2 : 2 * quad + 1) - MAGIC;
        const float q3 = ds4_byte_float(hi, BITS == 8 ? 3 : 2 * quad + 1) - MAGIC;
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
          const float sum4 = q3 * xj[t].w + (q2 * xj[t].z + (q1 * xj[t].y + q0 * xj[t].x));
          acc[r][t] = scale[r] * sum4 + (centre[r] * xsum[t] + acc[r][t]);
        }
      }
    }
  }
}

#pragma unroll
for (int r = 0; r < ROWS; ++r) {
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    const float total = ds4_simd_sum(acc[r][t]);
    if (SIMD_LANE == 0) {
      part[(SIMD_INDEX * ROWS + r) * TOKENS + t] = total;
    }
  }
}
@#pragma unroll
@for (int t = 0; t < TOKENS; ++t) {
@  const float total = ds4_simd_sum(squares[t]);
@  if (SIMD_LANE == 0) {
@    squares_part[SIMD_INDEX * TOKENS + t] = total;
@  }
@}
ds4_barrier();
const int i = (int)THREAD_IN_GROUP;
if (i < ROWS * TOKENS && first_row + i / TOKENS < OUT) {
  float total = 0.0f;
  for (int s = 0; s < SIMDS; ++s) {
    total += part[s * ROWS * TOKENS + i];
  }
@  float sum_squares = 0.0f;
@  for (int s = 0; s < SIMDS; ++s) {
@    sum_squares += squares_part[s * TOKENS + i % TOKENS];
@  }
@  total *= 1.0f / sqrt(sum_squares / (float)IN + NORM_EPS);
  y[((size_t)slot * TOKENS + i % TOKENS) * OUT + first_row + i / TOKENS] = total;
}
"""

_SWIGLU = """
DEVICE_FN float ds4_swiglu(float g, float u) {
  const float gc = g > CLAMP ? CLAMP : g;
  const float uc = u > CLAMP ? CLAMP : (u < -CLAMP ? -CLAMP : u);
  return gc * ds4_div(1.0f, 1.0f + ds4_exp(-gc)) * uc;
}
DEVICE_FN float4 ds4_swiglu4(float4 g, float4 u) {
  g.x = ds4_swiglu(g.x, u.x);
  g.y = ds4_swiglu(g.y, u.y);
  g.z = ds4_swiglu(g.z, u.z);
  g.w = ds4_swiglu(g.w, u.w);
  return g;
}
"""
"""The model's silu(min(gate, CLAMP)) * clip(up, -CLAMP, CLAMP), per value and per float4 (CLAMP: the header's)."""


def _input_form(swiglu: bool) -> str:
    """_SOURCE for rows of IN activations, or (swiglu) of 2 IN, [gate | up], whose SwiGLU is the input: its `%`
    lines kept, unmarked, and X_ROW, x's row stride, 2 IN."""
    lines = [line[1:] if line.startswith("%") else line for line in _SOURCE.split("\n")
             if swiglu or not line.startswith("%")]
    return "\n".join(lines).replace("X_ROW", "(2 * IN)" if swiglu else "IN")


_NAMES = ("ds4_affine_matvec", ("x", "wq", "scales", "biases", "ids"), ("y",))
KERNEL = Kernel(*_NAMES, variant(_input_form(False), False))
"""The plain kernel: the text without its `@` lines (the input norm, fused_norm.py) and `%` lines (the SwiGLU)."""


@cache
def norm_kernel(eps: float) -> Kernel:
    """The kernel with the input norm folded in: x * rsqrt(mean(x^2) + eps) * norm_w in place of x."""
    return normed_kernel(*_NAMES, _input_form(False), eps)


@cache
def swiglu_kernel(clamp: float) -> Kernel:
    """The kernel whose input is the SwiGLU of [gate | up] rows, for one clamp (written into its header; its name
    carries the clamp's bits, since MLX may cache compiled kernels by name)."""
    bits = struct.unpack("<I", struct.pack("<f", clamp))[0]
    return Kernel(f"ds4_affine_matvec_swiglu_{bits:08x}", *_NAMES[1:], variant(_input_form(True), False),
                  f"CONSTANT float CLAMP = {clamp!r}f;\n" + _SWIGLU)


def launch_plan(out_features: int, in_features: int, bits: int, tokens: int) -> tuple[int, int]:
    """(rows per threadgroup, SIMD groups per threadgroup).

    Eight rows share each activation load for one token (four up to four tokens, two from five on, to bound the
    ROWS x TOKENS accumulators and keep occupancy), fewer when the matrix would span under MIN_THREADGROUPS
    threadgroups; enough SIMD groups that each thread takes about two 16-byte loads of a row (one to eight SIMD
    groups). At one token this plan is the fastest measured, or within ~15%, at each Flash shape.
    """
    rows = 8 if tokens == 1 else 4 if tokens <= 4 else 2
    while rows > 1 and out_features < rows * MIN_THREADGROUPS:
        rows //= 2
    units = in_features * bits // 128
    return rows, max(1, min(8, units // (2 * SIMD_WIDTH)))


@cache
def _single_matrix() -> mx.array:
    """ids of a lone matrix: slot 0 reads matrix 0 (evaluated once, a constant inside mx.compile)."""
    ids = mx.zeros((1,), dtype=mx.uint32)
    mx.eval(ids)
    return ids


def _shape(x: mx.array, weight: AffineWeight, shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """The product's shape: `shape` where the caller gave one, else x's with OUT for IN."""
    return (*x.shape[:-1], weight.shape[-2]) if shape is None else shape


def _reference(x: mx.array, weight: AffineWeight, ids: mx.array | None, plan: tuple[int, int],
               norm: Norm | None = None, shape: tuple[int, ...] | None = None) -> mx.array:
    out = _shape(x, weight, shape)
    x = apply(x.reshape(-1, weight.shape[-1]) if shape is not None else x, norm)
    return (weight.matmul(x) if ids is None else weight.gather_matmul(x, ids)).reshape(out)


def _kernel(x: mx.array, weight: AffineWeight, ids: mx.array | None, plan: tuple[int, int],
            norm: Norm | None = None, shape: tuple[int, ...] | None = None) -> mx.array:
    if ids is None:
        tokens, slots, ids = x.size // weight.shape[-1], 1, _single_matrix()
    else:
        tokens, slots = 1, ids.size
    kernel, extra = (KERNEL, []) if norm is None else (norm_kernel(float(norm[1])), [norm[0]])
    return _launch_kernel(kernel, [x, *extra], weight, ids, tokens, slots, plan, _shape(x, weight, shape))


def _launch_kernel(kernel: Kernel, x: list[mx.array], weight: AffineWeight, ids: mx.array, tokens: int, slots: int,
                   plan: tuple[int, int], shape: tuple[int, ...]) -> mx.array:
    """One launch of a variant of the kernel: x then its extra inputs -> y of `shape` (slots * tokens * OUT values,
    row by row: the kernel reads and writes rows as stored, so shapes are metadata only)."""
    rows, simds = plan
    n_out, n_in = weight.shape[-2:]
    (y,) = build(kernel, current_backend())(
        inputs=[x[0], weight.wq, weight.scales, weight.biases, ids.astype(mx.uint32), *x[1:]],
        template=[("BITS", weight.bits), ("IN", n_in), ("OUT", n_out), ("TOKENS", tokens), ("ROWS", rows),
                  ("SIMDS", simds)],
        grid=(-(-n_out // rows) * simds * SIMD_WIDTH, slots, 1),
        threadgroup=(simds * SIMD_WIDTH, 1, 1),
        output_shapes=[shape],
        output_dtypes=[mx.float32],
    )
    return y


PROBE_EXPERTS = 3


def _probe(key: Hashable) -> tuple:
    """Random weights of the key's type and row length, 2 * ROWS + 1 rows (the last threadgroup mostly past the
    end). One token: a bank of three matrices and four slots (a lone matrix is the same kernel with one slot).
    A key ending in an epsilon is the normed kernel's: activations off unit rms, a norm weight around 1."""
    bits, n_in, tokens, rows, simds, *eps = key
    norm = probe_norm(n_in, eps[0], seed=33) if eps else None
    scale = PROBE_SCALE if eps else 1.0
    ggml_type = GGMLType.Q8_0 if bits == 8 else GGMLType.Q4_K
    n_out = 2 * rows + 1
    if tokens == 1:
        blocks = random_blocks(ggml_type, PROBE_EXPERTS * n_out, n_in, seed=31)
        bank = to_affine(blocks, ggml_type, (PROBE_EXPERTS, n_out, n_in))
        ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
        return scale * random_activations((ids.size, n_in), seed=32), bank, ids, (rows, simds), norm
    weight = to_affine(random_blocks(ggml_type, n_out, n_in, seed=31), ggml_type, (n_out, n_in))
    return scale * random_activations((tokens, n_in), seed=32), weight, None, (rows, simds), norm


AFFINE_MATVEC = FastPath("affine_matvec", _reference, _kernel, _probe, tolerance=TOLERANCE,
                         backends=("cuda", "metal"))
"""A few rows times an affine matrix or bank by the kernel; key (bits, IN, tokens, rows, SIMD groups), and the
norm's epsilon after them for the kernel with the input norm folded in."""


def affine_matvec(x: mx.array, weight: AffineWeight, ids: mx.array | None = None,
                  norm: Norm | None = None, shape: tuple[int, ...] | None = None) -> mx.array:
    """x @ W.T for x (..., IN) of at most MAX_TOKENS rows and W (OUT, IN), or with ids (N,) x[i] @ W[ids[i]].T
    for x (N, IN) over a bank W (E, OUT, IN): by the kernel where it passed its check, else (and for more rows,
    or activations other than float32) by the built-in quantized matmul (mx.gather_qmm for a bank). With a norm
    (weight (IN,), eps), x is first rms_norm(x, weight, eps), row by row: folded into the same launch.

    With `shape`, x is any array whose values are its rows of IN one after another, and the products come back
    in `shape` (their values row by row): the kernel takes both as they are, so that a caller's reshapes around
    the product are no graph nodes of a compiled decode step (each costs host time on GPU backends)."""
    launch = _launch(x, weight, ids is not None, norm)
    if launch is None:
        return _reference(x, weight, ids, (1, 1), norm, shape)
    plan, key = launch
    return AFFINE_MATVEC(x, weight, ids, plan, norm, shape, key=key)


def folds(x: mx.array, weight: AffineWeight, bank: bool, norm: Norm | None) -> bool:
    """Whether affine_matvec(x, weight, ids (over a bank) or None, norm) takes the normed kernel, so that no
    rms_norm op runs (checking the kernel first if this is its first use)."""
    launch = _launch(x, weight, bank, norm)
    return norm is not None and launch is not None and AFFINE_MATVEC.enabled(launch[1])


def _launch(x: mx.array, weight: AffineWeight, bank: bool, norm: Norm | None) -> tuple[tuple[int, int], tuple] | None:
    """The kernel's plan and key for this call; None where the call takes the reference whatever the checks say."""
    n_out, n_in = weight.shape[-2:]
    n_rows = x.size // n_in
    if x.dtype != mx.float32 or n_rows == 0 or (not bank and n_rows > MAX_TOKENS) or not fits(norm, n_in):
        return None
    tokens = 1 if bank else n_rows
    rows, simds = launch_plan(n_out, n_in, weight.bits, tokens)
    return (rows, simds), (weight.bits, n_in, tokens, rows, simds) + (() if norm is None else (float(norm[1]),))


class SwigluMatvec:
    """activation(gate, up, clamp) @ W.T for rows gate_up (..., 2 IN) = [gate | up] and an affine W (OUT, IN): the
    shared expert's down projection of its fused gate and up products. At most MAX_TOKENS float32 rows take one
    launch of the kernel's SwiGLU variant where it passed its check; otherwise the activation is an op of its own,
    then affine_matvec. `activation` is the model's SwiGLU (model/moe.py), the reference's first step."""

    def __init__(self, activation: Callable[[mx.array, mx.array, float], mx.array]):
        self.activation = activation
        self.fast_path = FastPath("swiglu_affine_matvec", self._reference, self._kernel, self._probe,
                                  tolerance=TOLERANCE, backends=("cuda", "metal"))

    def __call__(self, gate_up: mx.array, weight: AffineWeight, clamp: float) -> mx.array:
        key = self._key(gate_up, weight, clamp)
        if key is not None and self.fast_path.enabled(key):
            return self.fast_path(gate_up, weight, clamp, key[3:5], key=key)
        return affine_matvec(self._activation(gate_up, clamp), weight)

    @staticmethod
    def _key(gate_up: mx.array, weight: AffineWeight, clamp: float) -> tuple | None:
        """(bits, IN, tokens, rows, SIMD groups, clamp) of the launch; None where the call takes the other path."""
        n_out, n_in = weight.shape
        tokens = gate_up.size // gate_up.shape[-1]
        if gate_up.dtype != mx.float32 or gate_up.shape[-1] != 2 * n_in or not 0 < tokens <= MAX_TOKENS:
            return None
        return (weight.bits, n_in, tokens, *launch_plan(n_out, n_in, weight.bits, tokens), float(clamp))

    def _activation(self, gate_up: mx.array, clamp: float) -> mx.array:
        gate, up = mx.split(gate_up, 2, axis=-1)
        return self.activation(gate, up, clamp)

    def _reference(self, gate_up: mx.array, weight: AffineWeight, clamp: float, plan: tuple[int, int]) -> mx.array:
        return weight.matmul(self._activation(gate_up, clamp))

    def _kernel(self, gate_up: mx.array, weight: AffineWeight, clamp: float, plan: tuple[int, int]) -> mx.array:
        tokens = gate_up.size // gate_up.shape[-1]
        return _launch_kernel(swiglu_kernel(float(clamp)), [gate_up], weight, _single_matrix(), tokens, 1, plan,
                              (*gate_up.shape[:-1], weight.shape[0]))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Random weights of 2 * ROWS + 1 rows (the last threadgroup mostly past the end); gate and up values
        spread over about 1.6 clamps, so that about a fifth of each are clamped."""
        bits, n_in, tokens, rows, simds, clamp = key
        ggml_type = GGMLType.Q8_0 if bits == 8 else GGMLType.Q4_K
        n_out = 2 * rows + 1
        weight = to_affine(random_blocks(ggml_type, n_out, n_in, seed=34), ggml_type, (n_out, n_in))
        return 0.8 * clamp * random_activations((tokens, 2 * n_in), seed=35), weight, clamp, (rows, simds)
