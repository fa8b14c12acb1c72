"""How the forward pass reads its weights: the one place that turns GGUF tensors into matrix products.

Every matmul in the model is y = x @ W.T for a stored W of shape (OUT, IN) (GGUF ne = [IN, OUT], ds4.c).
A matrix is held in one of four forms (an expert bank in one of five):

- affine: Q8_0 and Q4_K tensors converted at load to MLX's affine quantized layout (kernels/formats/affine.py) and
  multiplied by MLX's quantized matmuls, or for up to 8 rows (decode) and selected experts by one custom kernel on
  GPU backends (kernels/decode/affine_matvec.py). Memory stays close to the file size, and dequantizing the converted
  arrays gives the reference values bit for bit. This is a fast path: it is taken when the kernel mode is "fast"
  and its first-use check passes on this backend (kernels/machinery/registry.py);
- float16: the F16 compressor, indexer and router projections (HALF_LINEARS), kept as the file's float16 values
  where the half-precision matvec (kernels/decode/half.py) has passed its first-use check on this backend for their
  shape: up to 8 rows (a decode token, a short chunk) go through that kernel, more through
  x @ W.astype(float32).T. F16 converts to float32 exactly, so both give the dense form's products up to float32
  summation order, from half its memory. Also a fast path: never taken in the reference mode at load;
- dense: other matrices whose float32 form is at most RESIDENT_BYTES, dequantized once at load;
- raw: the rest, kept as their GGUF blocks and dequantized per call;
- mxfp4: MXFP4 expert banks (0731's MXFP4 file) repacked at load to MLX's own mxfp4 layout, the same format with
  its nibbles in another order (kernels/formats/mxfp4.py): the file's bytes exactly, dequantizing to the reference
  values, multiplied by mx.gather_qmm. A fast path like affine, checked first; taken where the MXFP4 kernels over
  raw blocks are not (the CPU, or a GPU where their check failed: `uses_mx`).

Routed experts (ExpertBank) are affine or mxfp4 when their type allows it, else raw, and only the experts a token
selects are read; for a few (token, expert) pairs, raw IQ2_XXS, Q2_K and MXFP4 experts go through the fused expert
kernels (kernels/decode/experts.py, called by model/moe.py) or the dequant-matvec kernels (GPU only). A prefill
chunk's pairs, sorted by expert, go through grouped GEMMs instead (`ExpertBank.grouped`,
kernels/prefill/grouped.py; raw MXFP4 banks repacked to the mxfp4 form for the chunk first), and projections of
BATCH_TOKENS rows or more through dequantize + dense GEMM on GPU backends (kernels/prefill/batch.py). With
DS4_KERNELS=reference at load every tensor takes the dense or raw form, the reference path; after loading, the
reference mode multiplies affine tensors by their dequantized values and float16 tensors by their float32 values,
which are the reference's.

Matrices that a decode step multiplies by the same input (a layer's q_a and kv, its compressors' kv and gate, the
indexer's proj) are also read as one: `FusedLinear` concatenates those held in one fast form along OUT at load,
one kernel launch per form instead of one per matrix, and each member keeps a view of its rows.

Both take the RMSNorm of their input when every reader of the normed input is a projection (`norm=(weight, eps)`):
the matvec kernels fold it into their launch (kernels/decode/fused_norm.py), which takes an op and a graph node out of a
decode step; every other path (more rows, the reference mode, another backend, the dense and raw forms) applies
rms_norm(x, weight, eps) first, as the caller would have, so its results are unchanged bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import LayoutError
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.formats.affine import AFFINE_GATHER, AFFINE_MATMUL, BITS, AffineWeight, affine_nbytes, to_affine
from ds4_mlx.kernels.decode.affine_matvec import MAX_TOKENS as AFFINE_MATVEC_TOKENS
from ds4_mlx.kernels.decode.affine_matvec import SwigluMatvec, affine_matvec
from ds4_mlx.kernels.decode.affine_matvec import folds as affine_folds
from ds4_mlx.kernels.prefill.batch import BATCH_TOKENS, batch_matmul, grouped_rows_matmul, prefill_dtype
from ds4_mlx.kernels.decode.fused_norm import Norm, apply
from ds4_mlx.kernels.prefill.grouped import (MX_GROUPED, RAW_GROUPED, affine_grouped, mx_grouped, pair_inputs,
                                             sliced_grouped)
from ds4_mlx.kernels.decode.half import MAX_TOKENS as HALF_MATVEC_TOKENS
from ds4_mlx.kernels.decode.half import folds as half_folds
from ds4_mlx.kernels.decode.half import half_matvec, matvec_enabled
from ds4_mlx.kernels.decode.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.decode.matvec import QuantMatvec
from ds4_mlx.kernels.decode.mxfp4_matvec import MXFP4_MATVEC
from ds4_mlx.kernels.formats.mxfp4 import MXFP4_GATHER, MxWeight, mx_nbytes, to_mx
from ds4_mlx.kernels.decode.q2_k import Q2_K_MATVEC
from ds4_mlx.kernels.formats.quants import dequantize
from ds4_mlx.model.gguf import GGMLType

if TYPE_CHECKING:
    from ds4_mlx.model.gguf import TensorInfo
    from ds4_mlx.model.stream import TensorSource
    from ds4_mlx.model.weights import ModelWeights

RESIDENT_BYTES = 64 << 20
"""Matrices without an affine form whose float32 form is at most this many bytes are dequantized once at load."""

MATVECS: dict[int, QuantMatvec] = {GGMLType.IQ2_XXS: IQ2_XXS_MATVEC, GGMLType.Q2_K: Q2_K_MATVEC,
                                   GGMLType.MXFP4: MXFP4_MATVEC}
"""Dequant-matvec kernels over raw blocks (GPU only; elsewhere, or if their check fails, they run the reference)."""


def uses_affine(ggml_type: int, expert_bank: bool = False) -> bool:
    """Whether a tensor of this type is converted to the affine form here (mode, backend and first-use checks)."""
    if ggml_type not in BITS:
        return False
    ggml_type = GGMLType(ggml_type)
    return AFFINE_MATMUL.enabled(ggml_type) and (not expert_bank or AFFINE_GATHER.enabled(ggml_type))


def uses_mx(ggml_type: int, shape: tuple[int, int, int]) -> bool:
    """Whether an expert bank (E, OUT, IN) of this type is repacked to MLX's mxfp4 form here: MXFP4 banks where
    gather_qmm passed its first-use check, except where the raw-block matvec kernel passed its own (GPU backends),
    which keeps the bank as stored for the fused expert kernels. Other MXFP4 matrices (no published file has one)
    stay dense or raw."""
    return (ggml_type == GGMLType.MXFP4 and not MATVECS[GGMLType.MXFP4].enabled(*shape[1:])
            and MXFP4_GATHER.enabled(GGMLType.MXFP4))


HALF_LINEARS = ("compressor_kv.weight", "compressor_gate.weight", "indexer.attn_q_b.weight", "indexer.proj.weight",
                "ffn_gate_inp.weight")
"""Name endings of the matrices that take the float16 form when F16: those the model multiplies by whole. The
other 2-D F16 tensors are the embedding (rows only), and the hyper-connection fn and compressor ape, which the
model reads as float32 vectors (Loader.dense); by name, `loaded_forms` knows before loading what Linear does."""


def uses_half(name: str, ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a matrix is kept as float16 here: an F16 one of HALF_LINEARS whose (OUT, IN) shape the half
    matvec takes and whose first-use check passed on this backend (never in the reference mode)."""
    return ggml_type == GGMLType.F16 and name.endswith(HALF_LINEARS) and matvec_enabled(shape)


def loaded_forms(weights: ModelWeights) -> dict[str, tuple[int, int]]:
    """For each form tensors take once loaded ("affine", "mxfp4", "float16", "float32", "raw"): their bytes in the
    file and in memory, known before loading anything (`inspect` shows them; the memory check adds them up).

    Affine tensors take their converted size, MXFP4 banks where `uses_mx` their file size; F16 matrices of
    HALF_LINEARS that fit RESIDENT_BYTES as float32 are held as float16 where `uses_half`; other vectors and
    matrices that fit are held as float32 (int32 for tid2eid); everything else stays as its raw blocks.
    """
    forms = {"affine": (0, 0), "mxfp4": (0, 0), "float16": (0, 0), "float32": (0, 0), "raw": (0, 0)}
    for info in weights.tensor_infos():
        name = info.name
        shape = tuple(reversed(info.shape))
        float_bytes = 4 * info.n_elements
        if uses_affine(info.ggml_type, expert_bank=len(shape) == 3):
            form, loaded = "affine", affine_nbytes(info.ggml_type, shape)
        elif len(shape) == 3 and uses_mx(info.ggml_type, shape):
            form, loaded = "mxfp4", mx_nbytes(shape)
        elif len(shape) == 2 and float_bytes <= RESIDENT_BYTES and uses_half(name, info.ggml_type, shape):
            form, loaded = "float16", 2 * info.n_elements
        elif len(shape) < 3 and float_bytes <= RESIDENT_BYTES:
            form, loaded = "float32", float_bytes
        else:
            form, loaded = "raw", info.nbytes
        stored, held = forms[form]
        forms[form] = (stored + info.nbytes, held + loaded)
    return forms


def loaded_nbytes(weights: ModelWeights) -> int:
    """The bytes a Model built from these weights keeps in memory, known before loading anything."""
    return sum(held for _, held in loaded_forms(weights).values())


def _row_major_shape(info: TensorInfo) -> tuple[int, ...]:
    return tuple(reversed(info.shape))


def _fast() -> bool:
    return registry.mode() == "fast"


def _stored(source: TensorSource, name: str, ndim: int, expected: str) -> tuple[tuple[int, ...], int]:
    """A tensor's row-major shape and ggml type, checking that it has the dimensions the model uses."""
    info = source.info(name)
    shape = _row_major_shape(info)
    if len(shape) != ndim:
        raise LayoutError(f"tensor {name} has ne {list(info.shape)}, expected {expected}")
    return shape, info.ggml_type


def _raw(source: TensorSource, name: str, shape: tuple[int, ...]) -> mx.array:
    """The tensor's blocks as stored, uint8 (shape[0], -1): the form dequantized per call."""
    (raw,) = source.read(name, lambda rows: (rows,))
    return raw.reshape(shape[0], -1)


def _dense(source: TensorSource, name: str, ggml_type: int, shape: tuple[int, ...]) -> mx.array:
    """The tensor dequantized once, float32 of row-major `shape`."""
    (dense,) = source.read(name, lambda rows: (dequantize(rows, ggml_type, (rows.shape[0], shape[-1])),))
    return dense.reshape(shape)


def _half(source: TensorSource, name: str, shape: tuple[int, ...]) -> mx.array:
    """An F16 tensor's values as float16 of row-major `shape`: the file's bytes, viewed."""
    (values,) = source.read(name, lambda rows: (mx.view(rows, mx.float16),))
    return values.reshape(shape)


def _affine_now(source: TensorSource, name: str, ggml_type: int, shape: tuple[int, ...]) -> AffineWeight:
    """The tensor converted to the affine form at load, a batch of rows at a time (the rows are independent)."""

    def convert(rows: mx.array) -> tuple[mx.array, ...]:
        w = to_affine(rows, ggml_type, (rows.shape[0], shape[-1]))
        return w.wq, w.scales, w.biases

    wq, scales, biases = (a.reshape(*shape[:-1], -1) for a in source.read(name, convert))
    return AffineWeight(wq, scales, biases, BITS[ggml_type])


def _mx_now(source: TensorSource, name: str, shape: tuple[int, ...]) -> MxWeight:
    """An MXFP4 tensor repacked to MLX's mxfp4 form at load, a batch of rows at a time."""

    def convert(rows: mx.array) -> tuple[mx.array, ...]:
        w = to_mx(rows, (rows.shape[0], shape[-1]))
        return w.wq, w.scales

    wq, scales = (a.reshape(*shape[:-1], -1) for a in source.read(name, convert))
    return MxWeight(wq, scales)


class Linear:
    """A stored weight matrix W (OUT, IN) applied as x @ W.T in float32."""

    def __init__(self, source: TensorSource, name: str, resident_bytes: int | None = None):
        self.name = name
        self.shape, self.ggml_type = _stored(source, name, 2, "a 2-D matrix")
        shape = self.shape
        self._affine: AffineWeight | None = None
        self._half: mx.array | None = None
        self._dense: mx.array | None = None
        self._raw: mx.array | None = None
        self._banks: dict[int, AffineWeight] = {}
        fits = shape[0] * shape[1] * 4 <= (RESIDENT_BYTES if resident_bytes is None else resident_bytes)
        if uses_affine(self.ggml_type):
            self._affine = _affine_now(source, name, self.ggml_type, shape)
        elif fits and uses_half(name, self.ggml_type, shape):
            self._half = _half(source, name, shape)
        elif fits:
            self._dense = _dense(source, name, self.ggml_type, shape)
        else:
            self._raw = _raw(source, name, shape)

    @property
    def weight(self) -> mx.array:
        """W as float32 (dequantized now if it is not held dense)."""
        if self._dense is not None:
            return self._dense
        if self._half is not None:
            return self._half.astype(mx.float32)
        if self._affine is not None:
            return self._affine.dequantize()
        return dequantize(self._raw, self.ggml_type, self.shape)

    @property
    def half(self) -> mx.array | None:
        """W as the float16 matrix it is held as, or None where it is held in another form."""
        return self._half

    @property
    def table(self) -> mx.array | None:
        """W as held where a row reads as it is: the float32 or float16 matrix, or an F16 tensor's file rows
        (OUT, 2 * IN) uint8; None for the other forms."""
        for held in (self._dense, self._half):
            if held is not None:
                return held
        return self._raw if self._raw is not None and self.ggml_type == GGMLType.F16 else None

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the affine arrays, the float16 or float32 matrix, or the raw blocks."""
        if self._affine is not None:
            return self._affine.nbytes
        held = next(a for a in (self._half, self._dense, self._raw) if a is not None)
        return held.nbytes

    def rows(self, index: mx.array) -> mx.array:
        """Selected rows of W as float32 (index (N,) -> (N, IN)); dequantizes only those rows."""
        if self._dense is not None:
            return self._dense[index]
        if self._half is not None:
            return self._half[index].astype(mx.float32)
        if self._affine is not None:
            return self._affine.take(index).dequantize()
        return dequantize(self._raw[index], self.ggml_type, (index.size, self.shape[1]))

    def hold_groups(self, groups: int) -> None:
        """Keeps W's rows as `groups` banks from load on, for `grouped`: a compiled decode step then reads them as
        they are, without three reshapes of its own every token."""
        if self._affine is not None:
            self._banks[groups] = self._as_banks(groups)

    def _as_banks(self, groups: int) -> AffineWeight:
        w = self._affine
        return AffineWeight(*(a.reshape(groups, -1, a.shape[-1]) for a in (w.wq, w.scales, w.biases)), w.bits)

    def grouped(self, x: mx.array, groups: int) -> mx.array:
        """Group g of W's rows applied to group g of each row's inputs: x (T, ...) whose T rows hold the groups'
        inputs one after another (groups * IN values) -> (T, OUT), the groups' products side by side. A few
        tokens' x is read as it is stored: a decode step's attention heads (T, H, D) go in, the products come out
        as out_b reads them, and no reshape around the launch is a graph node of its own."""
        t = x.shape[0]
        if self._affine is not None and _fast():
            split = self._banks[groups] if groups in self._banks else self._as_banks(groups)
            if t < BATCH_TOKENS and AFFINE_GATHER.enabled(GGMLType(self.ggml_type)):
                # a few tokens: each (token, group) pair is a matvec against its group's rows, in one launch of
                # the matvec kernel over the groups as a bank (MLX's batched quantized_matmul of one row per batch,
                # and its 8-bit gather_qmm, both take its slow naive kernel: 127 us a layer on the H200)
                ids = mx.array(np.arange(groups, dtype=np.uint32))  # a constant: no op of its own in the step
                ids = ids if t == 1 else mx.tile(ids, t)
                return affine_matvec(x, split, ids, shape=(t, self.shape[0]))
            if t >= BATCH_TOKENS:
                return grouped_rows_matmul(x.reshape(t, groups, -1), split).reshape(t, -1)
            return mx.swapaxes(split.matmul(mx.swapaxes(x.reshape(t, groups, -1), 0, 1)), 0, 1).reshape(t, -1)
        return mx.einsum("tgi,goi->tgo", x.reshape(t, groups, -1),
                         self.weight.reshape(groups, -1, self.shape[1])).reshape(t, -1)

    def __call__(self, x: mx.array, norm: Norm | None = None) -> mx.array:
        """x @ W.T, or with `norm` (weight (IN,), eps) rms_norm(x, weight, eps) @ W.T: the matvec kernels fold the
        norm into their launch, the other paths (and the kernels' own fallbacks) apply it first."""
        if self._affine is not None and _fast():
            if x.size >= BATCH_TOKENS * x.shape[-1]:
                return batch_matmul(apply(x, norm), self._affine)
            # a few rows: one kernel launch (GPU), quantized_matmul elsewhere
            return affine_matvec(x, self._affine, norm=norm)
        if self._half is not None:
            return half_matvec(x, self._half, norm)
        return apply(x, norm) @ self.weight.T

    def folds(self, x: mx.array, norm: Norm) -> bool:
        """Whether __call__(x, norm=norm) folds the norm into a matvec kernel (checked on first use), rather than
        applying rms_norm first: for a caller that would otherwise norm x once for several readers."""
        if self._affine is not None and _fast():
            return x.size < BATCH_TOKENS * x.shape[-1] and affine_folds(x, self._affine, False, norm)
        return self._half is not None and half_folds(x, self._half, norm)

    def after_swiglu(self, gate_up: mx.array, swiglu: SwigluMatvec, clamp: float) -> mx.array:
        """swiglu.activation(gate, up, clamp) @ W.T for gate_up (..., 2 IN) = [gate | up]: a few rows of an affine
        matrix by one launch that applies the activation as it reads its input (kernels/decode/affine_matvec.py), the
        other paths by the activation, then __call__."""
        if self._affine is not None and _fast() and gate_up.size < BATCH_TOKENS * gate_up.shape[-1]:
            return swiglu(gate_up, self._affine, clamp)
        gate, up = mx.split(gate_up, 2, axis=-1)
        return self(swiglu.activation(gate, up, clamp))


FUSED_TOKENS = min(AFFINE_MATVEC_TOKENS, HALF_MATVEC_TOKENS)
"""Most rows of input a FusedLinear multiplies by its fused matrices (the matvec kernels' limit); more (a prefill
chunk) go member by member, as they did before."""


class FusedLinear:
    """Matrices that multiply the same input, applied with one matvec launch per storage form (decode).

    Why: on a GPU backend every graph node costs host time (~5 us on MLX CUDA) and a decode token multiplies its
    normed input by up to seven small matrices a layer. At construction (at load, in the fast mode) the members
    held in one fast form with the same IN, affine of one width or float16, are concatenated along OUT into one
    matrix (float16 only where the half matvec has passed its check for the concatenated shape) and evaluated; each
    member then holds a view of its rows of it instead of its own arrays, so memory stays the members' bytes and
    the members' own products (the chunk path's) are unchanged. Other members (dense, raw, a form of their own)
    are applied alone.

    Each output element is the same dot product of the same values as the member's own, only in another launch.
    """

    def __init__(self, members: Sequence[Callable[[mx.array], mx.array]]):
        self.members = list(members)
        by_form: dict[tuple, list[int]] = {}
        for i, member in enumerate(self.members):
            form = _fusable_form(member)
            if form is not None:
                by_form.setdefault(form, []).append(i)
        self._groups: list[tuple[list[int], list[int], AffineWeight | mx.array]] = []
        """(member indices, their OUT offsets in the fused matrix and its total, the fused matrix)."""
        for indices in by_form.values():
            parts = [self.members[i] for i in indices]
            offsets = [0, *accumulate(p.shape[0] for p in parts)]
            if len(parts) > 1 and (fused := _concatenate(parts, offsets)) is not None:
                self._groups.append((indices, offsets, fused))

    @property
    def launches(self) -> int:
        """Products a call of up to FUSED_TOKENS rows makes: one per fused matrix, one per other member."""
        return len(self.members) - sum(len(indices) - 1 for indices, _, _ in self._groups)

    def __call__(self, x: mx.array, norm: Norm | None = None) -> list[mx.array]:
        """Each member's x @ W.T, in order, for x (..., IN); with `norm` (weight (IN,), eps), of rms_norm(x, weight,
        eps): folded into the matvec launches, applied once first where the members go another way."""
        rows = x.size // x.shape[-1]
        if not _fast() or rows > FUSED_TOKENS:
            x = apply(x, norm)
            return [member(x) for member in self.members]
        out: list[mx.array | None] = [None] * len(self.members)
        for indices, offsets, fused in self._groups:
            y = _product(x, fused, norm)
            for i, part in zip(indices, mx.split(y, offsets[1:-1], axis=-1)):  # one graph node, views
                out[i] = part
        normed = None
        for i, member in enumerate(self.members):
            if out[i] is not None:
                continue
            if _fusable_form(member) is not None:  # a matvec kernel of its own: the norm folds into it too
                out[i] = member(x, norm=norm)
            else:
                normed = apply(x, norm) if normed is None else normed
                out[i] = member(normed)
        return out

    def joined(self, x: mx.array, norm: Norm | None = None) -> mx.array | None:
        """All members' products side by side, (..., total OUT) = [member 0 | member 1 | ...], by one launch: where
        every member is in the one fused matrix and x is at most FUSED_TOKENS rows; None otherwise (__call__ then).
        For a reader of the products together (the shared expert's down, through their SwiGLU)."""
        rows = x.size // x.shape[-1]
        if not _fast() or rows > FUSED_TOKENS or len(self._groups) != 1 or len(self._groups[0][0]) != len(self.members):
            return None
        return _product(x, self._groups[0][2], norm)

    def folds(self, x: mx.array, norm: Norm) -> bool:
        """Whether __call__(x, norm=norm) folds the norm into every launch it makes (checked on first use), rather
        than applying rms_norm once: for a caller that would otherwise norm x once for several readers."""
        if not _fast() or x.size // x.shape[-1] > FUSED_TOKENS:
            return False
        grouped = {i for indices, _, _ in self._groups for i in indices}
        alone = [member for i, member in enumerate(self.members) if i not in grouped]
        return (all(_folds(x, fused, norm) for _, _, fused in self._groups)
                and all(isinstance(member, Linear) and member.folds(x, norm) for member in alone))


def _product(x: mx.array, fused: AffineWeight | mx.array, norm: Norm | None) -> mx.array:
    """x (with `norm`, rms_norm(x, *norm)) times a fused matrix, affine or float16: one matvec launch."""
    return affine_matvec(x, fused, norm=norm) if isinstance(fused, AffineWeight) else half_matvec(x, fused, norm)


def _folds(x: mx.array, fused: AffineWeight | mx.array, norm: Norm) -> bool:
    """Whether _product(x, fused, norm) folds the norm into its launch."""
    return affine_folds(x, fused, False, norm) if isinstance(fused, AffineWeight) else half_folds(x, fused, norm)


def _fusable_form(member: object) -> tuple | None:
    """The key FusedLinear groups a member by: its fast form (affine and its width, or float16) and IN."""
    if not isinstance(member, Linear):
        return None
    if member._affine is not None:
        return "affine", member._affine.bits, member.shape[1]
    if member._half is not None:
        return "float16", member.shape[1]
    return None


def _concatenate(parts: list[Linear], offsets: list[int]) -> AffineWeight | mx.array | None:
    """The parts' matrices, of one form, concatenated along OUT and evaluated, each part now holding a view of its
    rows (its own arrays are freed); None where the float16 matvec does not take the concatenated shape."""
    if parts[0]._affine is not None:
        weights = [p._affine for p in parts]
        fused = AffineWeight(*(mx.concatenate([getattr(w, a) for w in weights]) for a in ("wq", "scales", "biases")),
                             weights[0].bits)
        for part, lo, hi in zip(parts, offsets, offsets[1:]):
            part._affine = fused.take(slice(lo, hi))
        mx.eval(fused.wq, fused.scales, fused.biases, *(a for p in parts for a in (p._affine.wq, p._affine.scales,
                                                                                   p._affine.biases)))
        return fused
    if not matvec_enabled((offsets[-1], parts[0].shape[1])):
        return None
    fused = mx.concatenate([p._half for p in parts])
    for part, lo, hi in zip(parts, offsets, offsets[1:]):
        part._half = fused[lo:hi]
    mx.eval(fused, *(p._half for p in parts))
    return fused


class ExpertBank:
    """The routed experts of one projection, (E, OUT, IN); only the experts a token selects are read."""

    def __init__(self, source: TensorSource, name: str):
        self.name = name
        self.shape, self.ggml_type = _stored(source, name, 3, "[IN, OUT, n_expert]")
        self._affine: AffineWeight | None = None
        self._mx: MxWeight | None = None
        self._raw: mx.array | None = None
        if uses_affine(self.ggml_type, expert_bank=True):
            self._affine = _affine_now(source, name, self.ggml_type, self.shape)
        elif uses_mx(self.ggml_type, self.shape):
            self._mx = _mx_now(source, name, self.shape)
        else:
            self._raw = _raw(source, name, self.shape)

    @property
    def n_expert(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return next(w for w in (self._affine, self._mx, self._raw) if w is not None).nbytes

    @property
    def raw(self) -> mx.array | None:
        """The GGUF blocks (E, bytes per expert) of a bank held raw, for kernels that read several banks in one
        launch (kernels/decode/experts.py); None for an affine or mxfp4 bank."""
        return self._raw

    def experts(self, ids: mx.array) -> mx.array:
        """Float32 weights of the experts `ids` (K,) -> (K, OUT, IN)."""
        if self._affine is not None:
            return self._affine.take(ids).dequantize()
        if self._mx is not None:
            return self._mx.take(ids).dequantize()
        return dequantize(self._raw[ids], self.ggml_type, (ids.size, *self.shape[1:]))

    def __call__(self, x: mx.array, ids: mx.array, norm: Norm | None = None) -> mx.array:
        """x[i] @ W[ids[i]].T for each of N (input, expert) pairs: x (N, IN), ids (N,) -> (N, OUT); with `norm`,
        of rms_norm(x, weight, eps): folded into the affine matvec kernel, applied first on the other paths."""
        if self._affine is not None and _fast():
            return affine_matvec(x, self._affine, ids, norm=norm)
        x = apply(x, norm)
        if self._mx is not None and _fast():
            return self._mx.gather_matmul(x, ids)
        if self._raw is not None and self.ggml_type in MATVECS:
            return MATVECS[self.ggml_type](x, self._raw, ids, self.shape)
        return (x[:, None, :] @ mx.swapaxes(self.experts(ids), 1, 2))[:, 0, :]

    def folds(self, x: mx.array, norm: Norm) -> bool:
        """Whether __call__ of x's rows (repeated per slot) with `norm` folds it into the matvec kernel (checked on
        first use): affine banks where their kernel passed its normed check."""
        return self._affine is not None and _fast() and affine_folds(x, self._affine, True, norm)

    def grouped(self, x: mx.array, rows: mx.array | None, sorted_ids: mx.array, counts: mx.array, after: mx.array
                ) -> mx.array:
        """x_i @ W[ids[i]].T for N (input, expert) pairs sorted by expert: x_i = x[rows[i]] (x a chunk's tokens) or,
        with rows None, x[i] (x (N, IN)); ids (N,) uint32 ascending, counts (E,) pairs per expert -> (N, OUT).
        Grouped GEMMs over all the pairs at once (kernels/prefill/grouped.py).

        The bank is read (and its float scratch made) only once `after` is computed: chaining the projections
        of a layer this way keeps one scratch alive at a time, whatever order MLX would otherwise pick.
        """
        if self._raw is not None and self.ggml_type in RAW_GROUPED:
            raw = mx.depends([self._raw], [after])[0]
            return RAW_GROUPED[self.ggml_type](x, raw, sorted_ids, counts, self.shape, rows)
        if self._raw is not None and self.ggml_type == GGMLType.MXFP4 and MX_GROUPED[prefill_dtype()].enabled(
                GGMLType.MXFP4):  # held raw for the decode kernels (GPUs): repacked for this chunk, then the scratch
            raw = mx.depends([self._raw], [after])[0]
            return mx_grouped(to_mx(raw, self.shape), pair_inputs(x, rows), sorted_ids, counts)
        x = pair_inputs(x, rows)
        if self._affine is not None and _fast():
            w = self._affine
            return affine_grouped(AffineWeight(*mx.depends([w.wq, w.scales, w.biases], [after]), w.bits), x,
                                  sorted_ids, counts)
        if self._mx is not None and _fast():
            return mx_grouped(MxWeight(*mx.depends([self._mx.wq, self._mx.scales], [after])), x, sorted_ids, counts)
        return sliced_grouped(x, sorted_ids, self.shape,
                              lambda index, slice_after: self.experts(mx.depends([index], [slice_after, after])[0]))
