"""Dequant-matvec over raw GGUF blocks, for decode: a few activation rows times selected quantized matrices.

y[k] = x[k] @ W[ids[k]].T for k < K, with W an (E, OUT, IN) stack kept as raw blocks (E = 1 for one matrix, or
the routed experts of a layer with ids the selected ones). Decode reads every selected weight once, so the kernel
is written for memory bandwidth:

- a threadgroup is SIMDS SIMD groups of 32 threads; each SIMD group owns ROWS consecutive rows of one expert,
  which are contiguous bytes, and copies them into threadgroup memory with 16-byte loads from all 32 lanes at
  once (2-byte loads when a row is not a multiple of 16 bytes), then decodes from there;
- each lane takes whole units of a row (a run of quants that shares its scales: 32 values for IQ2_XXS, 64 for
  Q2_K), loads the matching activations into registers once with 16-byte loads and applies them to all its rows;
- one SIMD reduction per row adds the lanes' partial sums.

The per-type part is the unit (`iq2_xxs.py`, `q2_k.py`), spliced into the skeleton below; the result is one
neutral kernel definition that `dialect.py` renders for CUDA and Metal. Its reference is `gathered_reference`:
the blocks dequantized by `quants.py`, then an ordinary matmul.
"""

from __future__ import annotations

from collections.abc import Hashable

import mlx.core as mx

from ...model.gguf import BLOCK_SIZES, GGMLType
from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from ..machinery.probe import random_activations, random_blocks
from ..formats.quants import dequantize
from ..machinery.registry import FastPath, current_backend

STAGE_BYTES = 24 << 10
"""Threadgroup memory for staged rows, per threadgroup (Metal allows 32 KiB in all)."""
MAX_SIMDS = 8
MAX_ROWS = 4
TOLERANCE = 1e-5
"""Float32 summation order only (units, then lanes): ~1e-7 per add over a few thousand terms, with margin."""

_SKELETON = """
const int slot = GROUP_Y;
const int lane = SIMD_LANE;
const int first_row = (GROUP_X * SIMDS + SIMD_INDEX) * ROWS;
const int n_rows = OUT - first_row < ROWS ? OUT - first_row : ROWS;

SHARED uint4 stage[(SIMDS * ROWS * ROW_BYTES + 15) / 16];
SHARED_MEM unsigned char* rows = reinterpret_cast<SHARED_MEM unsigned char*>(stage) + SIMD_INDEX * (ROWS * ROW_BYTES);
/*SETUP*/
if (n_rows > 0) {
  const GLOBAL_MEM unsigned char* src = w + ((size_t)ids[slot] * OUT + first_row) * ROW_BYTES;
  if (ROW_BYTES % 16 == 0) {
    const GLOBAL_MEM uint4* src16 = reinterpret_cast<const GLOBAL_MEM uint4*>(src);
    SHARED_MEM uint4* dst16 = reinterpret_cast<SHARED_MEM uint4*>(rows);
    for (int i = lane; i < n_rows * (ROW_BYTES / 16); i += 32) {
      dst16[i] = src16[i];
    }
  } else {
    const GLOBAL_MEM unsigned short* src2 = reinterpret_cast<const GLOBAL_MEM unsigned short*>(src);
    SHARED_MEM unsigned short* dst2 = reinterpret_cast<SHARED_MEM unsigned short*>(rows);
    for (int i = lane; i < n_rows * (ROW_BYTES / 2); i += 32) {
      dst2[i] = src2[i];
    }
  }
}
ds4_simd_barrier();

const GLOBAL_MEM float* xs = x + (size_t)slot * IN;
float acc[ROWS];
for (int r = 0; r < ROWS; ++r) {
  acc[r] = 0.0f;
}
for (int u = lane; u < UNITS; u += 32) {
/*UNIT*/
}
for (int r = 0; r < ROWS; ++r) {
  const float total = ds4_simd_sum(acc[r]);
  if (lane == 0 && r < n_rows) {
    y[(size_t)slot * OUT + first_row + r] = total;
  }
}
"""


def matvec_kernel(name: str, unit: str, setup: str = "", header: str = "") -> Kernel:
    """The gathered dequant-matvec kernel for one quant type, from its unit decode.

    `unit` runs once per unit u of a row, with the unit's activations at xs (float32, global) and the staged rows
    at rows + r * ROW_BYTES for r < n_rows; it adds each row's partial dot product to acc[r]. `setup` runs once
    per thread before the rows are staged (for threadgroup tables; it must end in ds4_barrier() if it fills one).
    """
    source = _SKELETON.replace("/*SETUP*/", setup).replace("/*UNIT*/", unit)
    return Kernel(name=name, inputs=("x", "w", "ids"), outputs=("y",), source=source, header=header)


def launch_plan(row_bytes: int) -> tuple[int, int]:
    """(SIMD groups per threadgroup, rows per SIMD group) whose staged rows fit STAGE_BYTES."""
    simds = min(MAX_SIMDS, STAGE_BYTES // row_bytes)
    if simds == 0:
        raise ValueError(f"a row of {row_bytes} bytes does not fit the {STAGE_BYTES}-byte staging buffer")
    return simds, max(1, min(MAX_ROWS, STAGE_BYTES // (simds * row_bytes)))


def gathered_reference(x: mx.array, blocks: mx.array, ids: mx.array, ggml_type: GGMLType,
                       shape: tuple[int, int, int]) -> mx.array:
    """x[k] @ W[ids[k]].T with W (E, OUT, IN) dequantized by the reference: what the kernels must equal.

    x (K, IN) float32, blocks uint8 holding the tensor (E rows of OUT * row_bytes), ids (K,) integers -> (K, OUT).
    """
    w = dequantize(blocks.reshape(shape[0], -1)[ids], ggml_type, (ids.size, *shape[1:]))
    return (x[:, None, :] @ mx.swapaxes(w, 1, 2))[:, 0, :]


class QuantMatvec:
    """The gathered dequant-matvec of one quant type: its kernel, its reference and their first-use check.

    The check runs per (OUT, IN), the values that select a compiled variant, on two random experts.
    """

    PROBE_EXPERTS = 2

    def __init__(self, ggml_type: GGMLType, unit_values: int, kernel: Kernel):
        self.ggml_type = ggml_type
        self.unit_values = unit_values
        self.kernel = kernel
        self.fast_path = FastPath(
            f"{ggml_type.name.lower()}_matvec", self._reference, self._kernel, self._probe,
            tolerance=TOLERANCE, backends=("cuda", "metal"),
        )

    def enabled(self, out_features: int, in_features: int) -> bool:
        """Whether __call__ takes the kernel for this shape: rows the skeleton stages (an even number of bytes, so
        at least in 2-byte words: MXFP4's 17-byte blocks make odd rows of an odd number of blocks) and a passed
        check."""
        return self._row_bytes(in_features) % 2 == 0 and self.fast_path.enabled((out_features, in_features))

    def __call__(self, x: mx.array, blocks: mx.array, ids: mx.array, shape: tuple[int, int, int]) -> mx.array:
        """x[k] @ W[ids[k]].T (see gathered_reference), by the kernel where it passed its check."""
        if self._row_bytes(shape[2]) % 2:
            return self._reference(x, blocks, ids, shape)
        return self.fast_path(x, blocks, ids, shape, key=tuple(shape[1:]))

    def _row_bytes(self, n_in: int) -> int:
        block_values, block_bytes = BLOCK_SIZES[self.ggml_type]
        return n_in // block_values * block_bytes

    def _reference(self, x, blocks, ids, shape) -> mx.array:
        return gathered_reference(x, blocks, ids, self.ggml_type, shape)

    def _kernel(self, x: mx.array, blocks: mx.array, ids: mx.array, shape: tuple[int, int, int]) -> mx.array:
        _, n_out, n_in = shape
        row_bytes = self._row_bytes(n_in)
        simds, rows = launch_plan(row_bytes)
        groups = -(-n_out // (simds * rows))
        kernel = build(self.kernel, current_backend())
        (y,) = kernel(
            inputs=[x.astype(mx.float32), blocks, ids.astype(mx.uint32)],
            template=[("OUT", n_out), ("IN", n_in), ("ROW_BYTES", row_bytes), ("UNITS", n_in // self.unit_values),
                      ("SIMDS", simds), ("ROWS", rows)],
            grid=(groups * simds * SIMD_WIDTH, ids.size, 1),
            threadgroup=(simds * SIMD_WIDTH, 1, 1),
            output_shapes=[(ids.size, n_out)],
            output_dtypes=[mx.float32],
        )
        return y

    def _probe(self, key: Hashable) -> tuple:
        n_out, n_in = key
        shape = (self.PROBE_EXPERTS, n_out, n_in)
        blocks = random_blocks(self.ggml_type, self.PROBE_EXPERTS * n_out, n_in, seed=11).reshape(
            self.PROBE_EXPERTS, -1)
        ids = mx.array([1, 0, 1], dtype=mx.int32)
        return random_activations((ids.size, n_in), seed=12), blocks, ids, shape
