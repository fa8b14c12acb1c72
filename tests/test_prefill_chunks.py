"""Prefill in CUDA's chunk size on the device: the chunk changes no result (spec §3.10). On the CPU the chunked
prefill is checked against token-by-token decoding on the tiny and small presets (test_model_cache.py); here the
GPU's kernels at Flash's shapes take a chunk of CUDA_PREFILL_CHUNK tokens (8192), larger than any CPU test's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.model.graphstep import row_ratios
from ds4_mlx.model.model import Model
from ds4_mlx.session import CUDA_PREFILL_CHUNK, Session

TOLERANCE = 1e-3
"""Of the largest logit (or state value). The chunks' kernels sum in float32 (tensor cores at float32 accuracy), in
an order that depends on the chunk: ~1e-5 expected; an indexer pick flipped by that rounding would move a logit
further."""
FLIPPED = 0.01
"""The share of cached values that may differ by more: rows simulated in FP8 or FP4 (spec's KV_FP8, the indexer's
FP4) round to a grid of e4m3 or e2m1 steps, and a value within ~1e-6 of a rounding boundary lands on either side
(seen on the H200: 0.0625 at values of 0.5-1, one e4m3 step), never by more than one step."""


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
        x, y = np.array(x[:live]), np.array(y[:live])
        finite = np.isfinite(y)
        assert np.array_equal(finite, np.isfinite(x))
        x, y = x[finite], y[finite]
        close = TOLERANCE * max(1.0, float(np.abs(y).max(initial=0.0)))
        diff = np.abs(x - y)
        step = np.exp2(np.floor(np.log2(np.maximum(np.abs(y), 2.0**-6))) - 1)  # one e2m1 step at y (e4m3's: 1/4 of it)
        assert np.all(diff <= np.maximum(step, close))
        assert np.mean(diff > close) <= FLIPPED
