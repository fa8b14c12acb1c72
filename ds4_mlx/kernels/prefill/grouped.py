"""Routed experts of a whole prefill chunk on the device: (token, slot) pairs sorted by expert, then grouped GEMMs.

A chunk of T tokens with top-k routing gives N = T * k pairs. Sorting their expert ids on the device
(`sort_by_expert`) puts each expert's pairs next to each other, and `mx.gather_mm(..., sorted_indices=True)` then
runs one grouped GEMM per projection, with no host round-trip and no per-expert Python loop. On CUDA, whose sorted
gather_mm is wrong in MLX 0.32.4 (`trusts_sorted_indices`), the grouped GEMM is one custom kernel over the sorted
pairs and their per-expert counts instead: for a float32 scratch the 3xTF32 tensor-core kernel (grouped_tf32.py),
else or where its check fails the SIMT kernel (grouped_gemm.py). Its right-hand side is the bank as floats, a *scratch*:

- raw IQ2_XXS / Q2_K banks (q2 files): on CUDA no scratch at all, one kernel decoding the raw blocks in its tile
  loads on float16 tensor cores at float32 accuracy (one launch per projection; gate and up read each pair's token
  row through the pair's row index, so the chunk is not copied per pair): on Hopper by warpgroup products
  (grouped_wgmma.py), else or where its check fails by mma (grouped_raw.py); on Metal, or where both checks fail,
  the pairs' rows are copied (`pair_inputs`) and the used experts decoded by `dequant.dequantize_used`, one kernel
  per projection, then the grouped GEMM;
- affine Q4_K banks (q4 files): on a GPU the bank's `dequantize()` (cast once if the scratch is bfloat16); on the
  CPU no scratch at all, `mx.gather_qmm(..., sorted_indices=True)` directly (as fast there, and no extra memory);
- MXFP4 banks (0731's MXFP4 file): the same two ways over MLX's mxfp4 form (formats/mxfp4.py), the scratch
  dequantized straight into its type (`mx_grouped`). GPUs hold these banks raw for the decode kernels and repack
  them to the mxfp4 form for each chunk (`ExpertBank.grouped`): a few MLX ops over the bank's bytes;
- the reference (the CPU, DS4_KERNELS=reference, or a kernel that failed its check): the reference dequantizer
  over slices of experts whose float32 form is at most SLICE_BYTES, each slice a gather_mm over all pairs with the
  rows of other slices masked out. Bounded by SLICE_BYTES plus the dequantizer's temporaries; a bank that fits
  one slice (every test preset) costs nothing extra, a Flash bank costs 8 GEMMs over the chunk instead of one.

Scratch bound on a GPU: one bank a layer, E * OUT * IN values: 8 GiB in float32, 4 GiB in bfloat16 at Flash size
(256 x 2048 x 4096; an affine bank in bfloat16 also holds its float32 form while it is cast); none for raw banks on
CUDA. `ExpertBank.grouped` reads each bank only after the previous projection's GEMM (`mx.depends`), and a layer's
first bank after its routing, so one scratch of a layer is alive at a time and MLX's stream-ordered allocator
reuses it; a chunk runs one layer ahead (`Model.hidden`), so two layers' are: 16 GiB in float32. At 2048 tokens
the other transients are a few (12288, 4096) float32 arrays (~200 MB each). The q2 Flash model as loaded (84 GiB)
+ 16 GiB scratch (none on CUDA) + a 32k session (0.44 GiB, `session_bytes`) + chunk activations stay far below the
H200's 139 GiB.

Arithmetic: float32 by default, the reference's type; `DS4_PREFILL_DTYPE=bfloat16` keeps the scratch and the GEMM
inputs in bfloat16 on GPU backends (batch.py says what that costs in accuracy; CUDA's kernel keeps x in float32;
CUDA's raw-bank kernel has no scratch and stays float32).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx
import numpy as np

from ...model.gguf import GGMLType
from ..formats.affine import GROUP_SIZE, AffineWeight, to_affine
from ..formats.mxfp4 import MxWeight, to_mx
from .batch import BF16_TOLERANCE, DTYPES, TOLERANCE, prefill_dtype
from .dequant import dequantize_used
from ..tensor_cores.grouped_gemm import expert_counts, grid_fits
from ..tensor_cores.grouped_raw import raw_grouped_gemm
from ..tensor_cores.grouped_wgmma import TM as WGMMA_TM
from ..tensor_cores.grouped_wgmma import fits as wgmma_fits
from ..tensor_cores.grouped_wgmma import wgmma_grouped_gemm
from ..tensor_cores.grouped_tf32 import tensor_core_matmul
from ..decode.matvec import gathered_reference
from ..machinery.probe import random_activations, random_blocks
from ..formats.quants import dequantize
from ..machinery import registry
from ..machinery.dialect import Kernel, build
from ..machinery.registry import FastPath, current_backend

SLICE_BYTES = 1 << 30
"""The reference path dequantizes at most this many bytes of float32 experts at a time."""


def sort_by_expert(ids: mx.array) -> tuple[mx.array, mx.array]:
    """(order, sorted ids) of the flattened (T, k) expert ids: pair order[i] = (token order // k, slot order % k)."""
    flat = ids.reshape(-1)
    order = mx.argsort(flat)
    return order, flat[order].astype(mx.uint32)


Projection = Callable[[mx.array, mx.array | None, mx.array, mx.array, mx.array], mx.array]
"""(x, rows, sorted ids (N,), counts (E,), after) -> x_i @ W[ids[i]].T (N, OUT), x_i = x[rows[i]] (x a chunk's
tokens) or, with rows None, x[i] (x (N, IN)); reading W only once `after` is computed (`ExpertBank.grouped`)."""


def pair_inputs(x: mx.array, rows: mx.array | None) -> mx.array:
    """Each pair's input row, (N, IN): x[rows], or x itself where rows is None (the paths that need the copy)."""
    return x if rows is None else x[rows]


def grouped_swiglu(x: mx.array, ids: mx.array, weights: mx.array, gate: Projection, up: Projection,
                   down: Projection, activation: Callable[[mx.array, mx.array, mx.array], mx.array],
                   n_expert: int) -> mx.array:
    """sum_i down(activation(gate(x), up(x), weights[:, i])) over each token's experts ids (T, k), for x (T, D):
    `activation` weighs each pair's hidden row (N, F) by its routing weight (N,), in the same launch.

    The pairs are sorted by expert on the device; each projection is one grouped GEMM over all of them, chained so
    that a bank is read only after the previous projection's GEMM (gate after the routing). The outputs go back to
    (token, slot) order and are summed over the slots, as the decode path sums them (`gather_slot_sums`).
    """
    t, k = ids.shape
    order, sorted_ids = sort_by_expert(ids)
    counts = expert_counts(sorted_ids, n_expert)
    rows = (order // k).astype(mx.uint32)  # pair i's token
    g = gate(x, rows, sorted_ids, counts, counts)
    u = up(x, rows, sorted_ids, counts, g)
    y = down(activation(g, u, weights.reshape(-1)[order]), None, sorted_ids, counts, u)
    return gather_slot_sums(y, invert_permutation(order), k)


_INVERT = """
const unsigned int i = GROUP_X * 256 + THREAD_IN_GROUP;
if (i < (unsigned int)dims[0]) {
  inverse[perm[i]] = i;
}
"""
INVERT_KERNEL = Kernel("ds4_invert_permutation", ("perm", "dims"), ("inverse",), _INVERT)
"""inverse[perm[i]] = i: every entry written once, perm being a permutation."""


def _invert_fast(perm: mx.array) -> mx.array:
    (inverse,) = build(INVERT_KERNEL, current_backend())(
        inputs=[perm, mx.array([perm.size], dtype=mx.int32)], template=[],
        grid=(256 * -(-perm.size // 256), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[perm.shape], output_dtypes=[mx.uint32])
    return inverse


def _invert_reference(perm: mx.array) -> mx.array:
    return mx.argsort(perm).astype(mx.uint32)


INVERT = FastPath("invert_permutation", _invert_reference, _invert_fast,
                  lambda key: (mx.array(np.random.default_rng(30).permutation(1000).astype(np.uint32)),),
                  tolerance=0.0, backends=("cuda", "metal"))
"""A permutation's inverse in one launch: where the reference's sort takes several on a GPU, with temporaries of
its own; key None. Equal to it exactly (tolerance 0). Checked on the H200 (2026-12-04, 7f589d4:
bench/RESULTS.md)."""


def invert_permutation(perm: mx.array) -> mx.array:
    """inverse (N,) uint32 of a permutation perm (N,) uint32 of 0..N-1: inverse[perm[i]] = i."""
    return INVERT(perm, key=None)


_SLOT_SUM = """
const unsigned int at = GROUP_X * 256 + THREAD_IN_GROUP;
if (at >= (unsigned int)dims[0] * D) {
  return;
}
const unsigned int t = at / D, c = at % D;
float sum = 0.0f;
for (int j = 0; j < K; ++j) {
  sum += y[(size_t)pair[t * K + j] * D + c];
}
out[at] = sum;
"""
SLOT_SUM_KERNEL = Kernel("ds4_slot_sum", ("y", "pair", "dims"), ("out",), _SLOT_SUM)
"""out[t, c] = sum_j y[pair[t K + j], c]: each token's K slot rows gathered and summed, one output value a thread
(neighbouring threads read neighbouring values of a row)."""


def _slot_sum_reference(y: mx.array, pair: mx.array, k: int) -> mx.array:
    return mx.sum(y[pair].reshape(-1, k, y.shape[-1]), axis=1)


def _slot_sum_fast(y: mx.array, pair: mx.array, k: int) -> mx.array:
    t, d = pair.size // k, y.shape[-1]
    (out,) = build(SLOT_SUM_KERNEL, current_backend())(
        inputs=[y, pair, mx.array([t], dtype=mx.int32)], template=[("K", k), ("D", d)],
        grid=(256 * -(-t * d // 256), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(t, d)], output_dtypes=[mx.float32])
    return out


def _slot_sum_probe(key: Hashable) -> tuple:
    """Ten tokens' slots in a shuffled order, at the real width."""
    k, d = key
    pair = np.random.default_rng(29).permutation(10 * k).astype(np.uint32)
    return random_activations((10 * k, d), seed=28), mx.array(pair), k


SLOT_SUM = FastPath("slot_sum", _slot_sum_reference, _slot_sum_fast, _slot_sum_probe, tolerance=TOLERANCE,
                    backends=("cuda", "metal"))
"""The routed outputs back in token order, summed over each token's slots, in one launch; key (k, D). Within
float32 reassociation of the reference's gather (a (T k, D) copy: 0.36 ms a 4096-token layer on the H200) and sum."""


def gather_slot_sums(y: mx.array, pair: mx.array, k: int) -> mx.array:
    """(T, D): sum_j y[pair[t k + j]] for float32 pair outputs y (T k, D) and pair (T k,) uint32 (the pair holding
    token t's slot j)."""
    if y.dtype == mx.float32:
        return SLOT_SUM(y, pair, k, key=(k, y.shape[-1]))
    return _slot_sum_reference(y, pair, k)


def trusts_sorted_indices() -> bool:
    """Whether MLX's gather_mm may be told that the pairs are sorted. MLX 0.32.4's CUDA gather_mm gives wrong
    products with sorted_indices=True (measured on the H200: relative error ~1.5 from 64 pairs of 8 small experts
    on, float32 and bf16, and an illegal memory access at 12,288 pairs of 256 Flash experts), so on CUDA the
    grouped GEMM is a custom kernel instead (grouped_tf32.py, grouped_gemm.py)."""
    return registry.current_backend() != "cuda"


def scratch_matmul(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array | None = None
                   ) -> mx.array:
    """x[i] @ scratch[ids[i]].T as float32 (N, OUT), for x (N, IN), scratch (E, OUT, IN), ids sorted ascending and
    counts (E,) the pairs per expert (computed from the ids where not given and needed)."""
    if not trusts_sorted_indices():
        return tensor_core_matmul(x, scratch, sorted_ids, counts)
    y = mx.gather_mm(x[:, None, :].astype(scratch.dtype), mx.swapaxes(scratch, 1, 2), rhs_indices=sorted_ids,
                     sorted_indices=True)
    return y[:, 0, :].astype(mx.float32)


def sliced_grouped(x: mx.array, sorted_ids: mx.array, shape: tuple[int, int, int],
                   experts: Callable[[mx.array, mx.array], mx.array]) -> mx.array:
    """x[i] @ W[ids[i]].T with W's experts as float32 from `experts(index, after)` (the experts `index`, read once
    `after` is computed), SLICE_BYTES at a time: one grouped GEMM per slice over all pairs, the rows of other slices
    masked out. Each slice is read after the previous slice's product, so one slice is alive at a time."""
    n_expert, n_out, n_in = shape
    per_slice = max(1, min(n_expert, SLICE_BYTES // (4 * n_out * n_in)))
    if per_slice == n_expert:
        return scratch_matmul(x, experts(mx.arange(n_expert), x), sorted_ids)
    out = x
    for first in range(0, n_expert, per_slice):
        count = min(per_slice, n_expert - first)
        local = mx.clip(sorted_ids.astype(mx.int32) - first, 0, count - 1).astype(mx.uint32)
        inside = ((sorted_ids >= first) & (sorted_ids < first + count))[:, None]
        part = mx.where(inside, scratch_matmul(x, experts(mx.arange(first, first + count), out), local), 0.0)
        out = part if first == 0 else out + part
    return out


def sliced_reference(x: mx.array, blocks: mx.array, sorted_ids: mx.array, ggml_type: GGMLType,
                     shape: tuple[int, int, int]) -> mx.array:
    """`sliced_grouped` over raw blocks and the reference dequantizer: what the grouped fast paths must equal."""
    rows = blocks.reshape(shape[0], -1)

    def experts(index: mx.array, after: mx.array) -> mx.array:
        return dequantize(mx.depends([rows[index]], [after])[0], ggml_type, (index.size, *shape[1:]))
    return sliced_grouped(x, sorted_ids, shape, experts)


class RawGrouped:
    """The grouped expert GEMM over raw IQ2_XXS / Q2_K blocks: on CUDA a tensor-core kernel reading the blocks
    directly (no scratch, whatever DS4_PREFILL_DTYPE: float32 is also the more accurate; grouped_wgmma.py on Hopper,
    else grouped_raw.py), else the dequantize-to-scratch kernel + grouped GEMM on GPUs (one fast path per scratch
    type), `sliced_reference` elsewhere or where the first-use checks fail."""

    def __init__(self, ggml_type: GGMLType):
        self.ggml_type = ggml_type
        self.fast_paths = {
            dtype: FastPath(f"{ggml_type.name.lower()}_grouped_{name}", self._reference, self._make_fast(dtype),
                            self._probe, tolerance=TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE,
                            backends=("cuda", "metal"))
            for name, dtype in DTYPES.items()
        }
        self.direct = FastPath(f"{ggml_type.name.lower()}_grouped_raw_f16x2", self._reference, self._direct,
                               self._direct_probe, tolerance=TOLERANCE, backends=("cuda",))
        """The raw-bank kernel against the same reference, within float32 reassociation (TOLERANCE, 1e-5 of the
        largest output): it decodes the reference's values exactly, drops ~2^-22 of each product (the two-half
        split of x, halfsplit.py) and reassociates the sums (~1e-6 of the largest output at Flash's K)."""
        self.wgmma = FastPath(f"{ggml_type.name.lower()}_grouped_wgmma", self._reference, self._wgmma,
                              self._direct_probe, tolerance=TOLERANCE, backends=("cuda",))
        """The same by warpgroup products (Hopper), against the same reference and bound."""

    def __call__(self, x: mx.array, blocks: mx.array, sorted_ids: mx.array, counts: mx.array,
                 shape: tuple[int, int, int], rows: mx.array | None = None) -> mx.array:
        """x_i @ W[ids[i]].T (N, OUT) for expert ids sorted ascending, counts (E,) per expert, and x_i = x[rows[i]]
        (or x[i] for x (N, IN) where rows is None): the raw kernel reads the rows it needs, the other paths copy
        them first."""
        key = tuple(shape[1:])
        if grid_fits(sorted_ids.size, shape[0]) and wgmma_fits(shape[2]) and self.wgmma.enabled(key):
            return self.wgmma(x, blocks, sorted_ids, counts, shape, rows, key=key)
        if grid_fits(sorted_ids.size, shape[0]) and self.direct.enabled(key):
            return self.direct(x, blocks, sorted_ids, counts, shape, rows, key=key)
        return self.fast_paths[prefill_dtype()](pair_inputs(x, rows), blocks, sorted_ids, counts, shape, key=key)

    def _reference(self, x, blocks, sorted_ids, counts, shape, rows=None) -> mx.array:
        return sliced_reference(pair_inputs(x, rows), blocks, sorted_ids, self.ggml_type, shape)

    def _make_fast(self, dtype: mx.Dtype):
        def fast(x, blocks, sorted_ids, counts, shape) -> mx.array:
            scratch = dequantize_used(blocks, counts, self.ggml_type, shape, dtype)
            return scratch_matmul(x, scratch, sorted_ids, counts)
        return fast

    def _direct(self, x, blocks, sorted_ids, counts, shape, rows=None) -> mx.array:
        return raw_grouped_gemm(x, blocks, counts, self.ggml_type, shape, rows)

    def _wgmma(self, x, blocks, sorted_ids, counts, shape, rows=None) -> mx.array:
        return wgmma_grouped_gemm(x, blocks, counts, self.ggml_type, shape, rows)

    def _probe(self, key: Hashable) -> tuple:
        """Five experts: one unused, one with a single pair, one with most pairs."""
        n_out, n_in = key
        shape = (5, n_out, n_in)
        blocks = random_blocks(self.ggml_type, 5 * n_out, n_in, seed=21).reshape(5, -1)
        ids = mx.array([0, 1, 1, 1, 1, 1, 3, 3, 4, 4, 4, 4], dtype=mx.uint32)
        return random_activations((ids.size, n_in), seed=22), blocks, ids, expert_counts(ids, 5), shape

    def _direct_probe(self, key: Hashable) -> tuple:
        """Five experts at the real widths: one unused, one with a single pair, one with a partial second row tile
        of the wgmma kernel (134 pairs; three of grouped_raw.py's), the pairs reading 40 tokens' rows in a shuffled
        order (each token by about three pairs)."""
        n_out, n_in = key
        shape = (5, n_out, n_in)
        blocks = random_blocks(self.ggml_type, 5 * n_out, n_in, seed=25).reshape(5, -1)
        ids = mx.array([0] * 3 + [1] + [3] * (WGMMA_TM + 6) + [4] * 2, dtype=mx.uint32)
        rows = mx.array(np.random.default_rng(27).integers(0, 40, ids.size).astype(np.uint32))
        return random_activations((40, n_in), seed=26), blocks, ids, expert_counts(ids, 5), shape, rows


RAW_GROUPED = {t: RawGrouped(t) for t in (GGMLType.IQ2_XXS, GGMLType.Q2_K)}
"""Grouped expert GEMMs over raw blocks, by ggml type."""


def affine_scratch(weight: AffineWeight, dtype: mx.Dtype) -> mx.array:
    """An affine bank (E, OUT, IN) as `dtype`: the reference's float32 values, rounded once if dtype is narrower
    (dequantizing straight into bfloat16 would round scale * q before adding the bias, which cancels)."""
    return weight.dequantize().astype(dtype)


def affine_grouped(weight: AffineWeight, x: mx.array, sorted_ids: mx.array, counts: mx.array | None = None
                   ) -> mx.array:
    """x[i] @ W[ids[i]].T for an affine bank: scratch + grouped GEMM where its check passed (GPUs), else
    gather_qmm over the sorted pairs (no scratch). counts (E,): the pairs per expert, where known."""
    dtype = prefill_dtype()
    ggml_type = {4: GGMLType.Q4_K, 8: GGMLType.Q8_0}[weight.bits]
    if AFFINE_GROUPED[dtype].enabled(ggml_type):
        return scratch_matmul(x, affine_scratch(weight, dtype), sorted_ids, counts)
    y = mx.gather_qmm(x[:, None, :], weight.wq, weight.scales, weight.biases, rhs_indices=sorted_ids,
                      transpose=True, group_size=GROUP_SIZE, bits=weight.bits,
                      sorted_indices=trusts_sorted_indices())
    return y[:, 0, :]


def _bank_probe(ggml_type: GGMLType) -> tuple:
    shape = (5, 64, 512)
    blocks = random_blocks(ggml_type, 5 * 64, 512, seed=23).reshape(5, -1)
    ids = mx.array([0, 1, 1, 1, 3, 3, 4, 4, 4], dtype=mx.uint32)
    return random_activations((ids.size, 512), seed=24), blocks, ids, ggml_type, shape


def _bank_reference(x, blocks, ids, ggml_type, shape) -> mx.array:
    return gathered_reference(x, blocks, ids, ggml_type, shape)


def _affine_fast(dtype: mx.Dtype):
    def fast(x, blocks, ids, ggml_type, shape) -> mx.array:
        return scratch_matmul(x, affine_scratch(to_affine(blocks, ggml_type, shape), dtype), ids)
    return fast


AFFINE_GROUPED = {
    dtype: FastPath(f"affine_grouped_{name}", _bank_reference, _affine_fast(dtype), _bank_probe,
                    tolerance=TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE, backends=("cuda", "metal"))
    for name, dtype in DTYPES.items()
}
"""Affine (Q4_K) banks as a dequantized scratch + grouped GEMM, per scratch type; key: the ggml type."""


def mx_grouped(weight: MxWeight, x: mx.array, sorted_ids: mx.array, counts: mx.array | None = None) -> mx.array:
    """x[i] @ W[ids[i]].T for an MXFP4 bank in MLX's mxfp4 form: as affine banks, scratch + grouped GEMM where its
    check passed (GPUs), else gather_qmm over the sorted pairs (no scratch). counts (E,): the pairs per expert,
    where known."""
    dtype = prefill_dtype()
    if MX_GROUPED[dtype].enabled(GGMLType.MXFP4):
        return scratch_matmul(x, weight.dequantize(dtype), sorted_ids, counts)
    return weight.gather_matmul(x, sorted_ids, sorted_indices=trusts_sorted_indices())


def _mx_fast(dtype: mx.Dtype):
    def fast(x, blocks, ids, ggml_type, shape) -> mx.array:
        return scratch_matmul(x, to_mx(blocks, shape).dequantize(dtype), ids)
    return fast


MX_GROUPED = {
    dtype: FastPath(f"mxfp4_grouped_{name}", _bank_reference, _mx_fast(dtype), _bank_probe,
                    tolerance=TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE, backends=("cuda", "metal"))
    for name, dtype in DTYPES.items()
}
"""MXFP4 banks as a scratch dequantized straight into the GEMM type (exact in float32 and bfloat16:
formats/mxfp4.py) + grouped GEMM, per scratch type; key: the ggml type."""
