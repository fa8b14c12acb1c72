"""Prefill in CUDA's chunk size on the device: the chunk changes no result (spec §3.10). On the CPU the chunked
prefill is checked against token-by-token decoding on the tiny and small presets (test_model_cache.py); here the
GPU's kernels at Flash's shapes take a chunk of CUDA_PREFILL_CHUNK tokens (8192), larger than any CPU test's."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.model.graphstep import row_ratios
from ds4_mlx.model.model import Model
from ds4_mlx.session import CUDA_PREFILL_CHUNK, Session

TOLERANCE = 1e-3
"""Of the largest logit. The chunks' kernels sum in float32 (tensor cores at float32 accuracy), in an order that
depends on the chunk: ~1e-5 expected; an indexer pick flipped by that rounding would move a logit further."""


@pytest.mark.gpu
@pytest.mark.cuda
def test_cuda_chunks_equal_smaller_chunks_on_flash_layers(on_cuda):
    """4 Flash layers (synthetic weights): a prompt of one CUDA chunk and a bit prefilled in CUDA's chunks and in
    2048-token chunks gives the same logits and the same live rows."""
    from ds4_mlx.model.synthetic import flash_config, synthetic_weights

    model = Model(synthetic_weights(flash_config(4)))
    prompt = [(13 * i + 7) % 9000 + 1 for i in range(CUDA_PREFILL_CHUNK + 300)]
    results = []
    for chunk in (CUDA_PREFILL_CHUNK, 2048):
        session = Session(model, len(prompt) + 64)
        assert session.chunk_size == CUDA_PREFILL_CHUNK
        session.chunk_size = chunk
        logits = session.prefill(prompt)
        mx.eval(logits)
        results.append((logits, session.cache))
    (big, big_cache), (small, small_cache) = results
    scale = mx.max(mx.abs(small)).item()
    assert mx.max(mx.abs(big - small)).item() <= TOLERANCE * scale
    for x, y, ratio in zip(big_cache.arrays(), small_cache.arrays(), row_ratios(big_cache), strict=True):
        live = len(prompt) // ratio if ratio else x.shape[0]  # a row buffer's live rows; else the whole array
        x, y = x[:live], y[:live]
        finite = mx.isfinite(y)
        assert mx.array_equal(finite, mx.isfinite(x))
        assert mx.max(mx.abs(mx.where(finite, x - y, 0))).item() <= TOLERANCE * max(
            1.0, mx.max(mx.abs(mx.where(finite, y, 0))).item())
