"""Prefill in CUDA's chunk size on the device: the chunk changes no result (spec §3.10). On the CPU the chunked
prefill is checked against token-by-token decoding on the tiny and small presets (test_model_cache.py); here the
GPU's kernels at Flash's shapes take a chunk of CUDA_PREFILL_CHUNK tokens (8192), larger than any CPU test's."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.model.model import Model
from ds4_mlx.session import CUDA_PREFILL_CHUNK, Session

TOLERANCE = 2e-3
"""Of the largest logit. The chunks' kernels sum in float32 in an order that depends on the chunk, and the indexer's
top-k picks near a tie can flip with that rounding, which moves everything downstream of them: the logits moved by
6.6e-4 of the largest on the H200 (session 13), the later layers' rows by more on a few percent of their values."""
EXACT = 1e-5
"""Of the largest value: the state of the layers before the first indexer, which no pick touches (equal there)."""


@pytest.mark.gpu
@pytest.mark.cuda
def test_cuda_chunks_equal_smaller_chunks_on_flash_layers(on_cuda):
    """4 Flash layers (synthetic weights): a prompt of one CUDA chunk and a bit prefilled in CUDA's chunks and in
    2048-token chunks gives the same state in the layers before the first indexer (checked first: no indexer tie
    can move it, so a failure there is a chunk dependence of its own), and the same logits."""
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
    first_indexer = next(i for i in range(model.config.n_layer) if model.config.compress_ratio(i) == 4)
    assert first_indexer > 0
    for layer, (a, b) in enumerate(zip(big_cache.layers[:first_indexer], small_cache.layers[:first_indexer])):
        for x, y in zip(a.arrays(), b.arrays(), strict=True):  # first: a move here is no tie of the indexer's
            moved = mx.max(mx.abs(x - y)).item() / max(1.0, mx.max(mx.abs(y)).item())
            assert moved <= EXACT, f"layer {layer}'s state moved by {moved:.2e} of its largest value"
    moved = mx.max(mx.abs(big - small)).item() / mx.max(mx.abs(small)).item()
    assert moved <= TOLERANCE, f"the logits moved by {moved:.2e} of the largest"
