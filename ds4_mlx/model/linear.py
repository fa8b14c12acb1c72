"""How the forward pass reads its weights: the one place that turns GGUF tensors into matrix products.

Every matmul in the model is y = x @ W.T for a stored W of shape (OUT, IN) (GGUF ne = [IN, OUT], spec §2.1).
Small matrices are dequantized to float32 once, at load. Large ones stay as their raw GGUF blocks and are
dequantized per call, so memory stays close to the file size. Routed experts always stay raw and only the
experts a token selects are dequantized. Fused dequant-matmul kernels slot in here without touching the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from ds4_mlx.errors import LayoutError
from ds4_mlx.kernels.quants import dequantize

if TYPE_CHECKING:
    from ds4_mlx.model.weights import ModelWeights

RESIDENT_BYTES = 64 << 20
"""Matrices whose float32 form is at most this many bytes are dequantized once at load."""


def loaded_nbytes(weights: ModelWeights) -> int:
    """The bytes a Model built from these weights keeps in memory, known before loading anything.

    Routed experts and large matrices stay as their raw blocks; vectors and matrices whose float32 form fits
    RESIDENT_BYTES are held as float32 (int32 for tid2eid).
    """
    total = 0
    for info in weights.file.tensors.values():
        float_bytes = 4 * info.n_elements
        resident = len(info.shape) < 3 and float_bytes <= RESIDENT_BYTES
        total += float_bytes if resident else info.nbytes
    return total


def _row_major_shape(weights: ModelWeights, name: str) -> tuple[int, ...]:
    return tuple(reversed(weights.info(name).shape))


class Linear:
    """A stored weight matrix W (OUT, IN) applied as x @ W.T in float32."""

    def __init__(self, weights: ModelWeights, name: str, resident_bytes: int | None = None):
        info = weights.info(name)
        shape = _row_major_shape(weights, name)
        if len(shape) != 2:
            raise LayoutError(f"tensor {name} has ne {list(info.shape)}, expected a 2-D matrix")
        self.name = name
        self.shape = shape
        self.ggml_type = info.ggml_type
        raw = mx.array(weights.tensor_bytes(name))
        if shape[0] * shape[1] * 4 <= (RESIDENT_BYTES if resident_bytes is None else resident_bytes):
            self._dense: mx.array | None = dequantize(raw, info.ggml_type, shape)
            self._raw: mx.array | None = None
            mx.eval(self._dense)  # dequantize now, not inside the first forward pass
        else:
            self._dense = None
            self._raw = raw.reshape(shape[0], -1)

    @property
    def weight(self) -> mx.array:
        """W as float32 (dequantized now if it is kept raw)."""
        if self._dense is not None:
            return self._dense
        return dequantize(self._raw, self.ggml_type, self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the float32 matrix, or the raw blocks."""
        return (self._dense if self._dense is not None else self._raw).nbytes

    def rows(self, index: mx.array) -> mx.array:
        """Selected rows of W as float32 (index (N,) -> (N, IN)); dequantizes only those rows."""
        if self._dense is not None:
            return self._dense[index]
        return dequantize(self._raw[index], self.ggml_type, (index.size, self.shape[1]))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


class ExpertBank:
    """The routed experts of one projection, (E, OUT, IN), kept as raw blocks; only used experts are dequantized."""

    def __init__(self, weights: ModelWeights, name: str):
        info = weights.info(name)
        shape = _row_major_shape(weights, name)
        if len(shape) != 3:
            raise LayoutError(f"tensor {name} has ne {list(info.shape)}, expected [IN, OUT, n_expert]")
        self.name = name
        self.shape = shape
        self.ggml_type = info.ggml_type
        self._raw = mx.array(weights.tensor_bytes(name)).reshape(shape[0], -1)

    @property
    def n_expert(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self._raw.nbytes

    def experts(self, ids: mx.array) -> mx.array:
        """Float32 weights of the experts `ids` (K,) -> (K, OUT, IN)."""
        return dequantize(self._raw[ids], self.ggml_type, (ids.size, *self.shape[1:]))
