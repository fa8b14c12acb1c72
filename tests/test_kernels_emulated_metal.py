"""The emulated tests of the kernels Metal launches, run on their Metal text (emulated_metal.py).

The tests are the CUDA emulation's own, at the shapes they were written for (Flash's widths among them: decode and
chunk attention at 64 heads of 512, the indexer's 64 heads of 128 over 2050 rows, the shared expert at 4096 x
2048, the learned router at 256 experts), collected again here: `metal` points each source module's `emulated` and
`emulated_build` at emulated_metal's, and the kernels modules' `current_backend` at "metal", so the wrappers
choose as they do on a Mac (SIMT kernels, Apple's threadgroup-memory budget) and every launch is held to Apple's
limits. Tests of CUDA-only kernels (tensor cores, the gated route, split decode attention) are not collected;
test_kernels_emulated.py runs each of its tests on both backends itself. The grouped-matmul helpers' two tests run
in the default suite (small: a few seconds of g++), the rest are slow. A fast path that falls back is an error.
"""

from __future__ import annotations

import importlib
import pkgutil

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels
import emulated_metal
import test_kernels_attention
import test_kernels_chunk_attention
import test_kernels_ends
import test_kernels_grouped
import test_kernels_indexer
import test_kernels_moe
import test_kernels_rows
from ds4_mlx.kernels.decode import router
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.registry import KernelFallbackWarning
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.moe import ROUTE, route
from test_kernels_attention import (test_emulated_decode_attention_equals_reference, test_emulated_probe_passes,
                                    test_emulated_rope_equals_reference)
from test_kernels_chunk_attention import test_emulated_chunk_attention_equals_reference
from test_kernels_ends import test_emulated_embed_equals_the_reference_exactly, test_emulated_head_equals_the_reference
from test_kernels_grouped import (test_emulated_inverse_permutation_equals_the_reference,
                                  test_emulated_slot_sum_kernel_equals_the_sums)
from test_kernels_indexer import (test_emulated_cuda_kernels_equal_reference,
                                  test_emulated_cuda_kernels_finish_queries_as_the_model_does,
                                  test_emulated_cuda_kernels_tie_zero_scores,
                                  test_emulated_cuda_scores_rotate_queries_of_every_width,
                                  test_emulated_cuda_scores_scale_the_weights_as_the_model_does,
                                  test_emulated_cuda_scores_within_tolerance)
from test_kernels_moe import (test_emulated_hash_route_equals_the_reference,
                              test_emulated_shared_expert_at_flash_shapes,
                              test_emulated_swiglu_matvec_equals_the_reference)
from test_kernels_rows import (test_emulated_indexer_fp4_kernel_is_exact,
                               test_emulated_kernel_equals_the_reference_on_random_rows,
                               test_emulated_kernel_equals_the_reference_on_steady_rows,
                               test_emulated_kernel_passes_its_probe,
                               test_emulated_kernel_rotates_at_the_aligned_position,
                               test_emulated_window_kernel_shifts_and_finishes)

pytestmark = pytest.mark.filterwarnings(f"error::{KernelFallbackWarning.__module__}.KernelFallbackWarning")

SOURCES = (test_kernels_attention, test_kernels_chunk_attention, test_kernels_ends, test_kernels_grouped,
           test_kernels_indexer, test_kernels_moe, test_kernels_rows)
"""The modules whose emulated tests are collected above."""


@pytest.fixture(autouse=True)
def metal(monkeypatch) -> None:
    """The collected tests' emulation is Metal's, and the kernels modules' wrappers build for "metal" (the registry
    still answers "cpu": the references the tests compute stay references)."""
    for module in SOURCES:
        for name in ("emulated", "emulated_build"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(emulated_metal, name))
    for info in pkgutil.walk_packages(ds4_mlx.kernels.__path__, "ds4_mlx.kernels."):
        module = importlib.import_module(info.name)
        if hasattr(module, "current_backend") and module is not registry:
            monkeypatch.setattr(module, "current_backend", lambda: "metal")


@pytest.mark.slow
def test_emulated_route_kernel_equals_reference_at_flash_experts(on_cpu, monkeypatch, tmp_path):
    """The learned router's kernel at Flash's 256 experts (one threadgroup of 256 threads a token), a saturated
    token and an all-tied one among them: ids exactly, weights within the route's TOLERANCE."""
    monkeypatch.setattr(router, "build", emulated_metal.emulated_build(tmp_path))
    logits = random_activations((5, 256), seed=3) * 3.0
    logits = mx.concatenate([logits, mx.full((1, 256), 25.0), mx.zeros((1, 256))])
    bias = random_activations((256,), seed=4) * 0.05
    ids, weights = ROUTE._kernel(logits, bias, 6, 1.5)
    want_ids, want_weights = route(logits, bias, 6, 1.5)
    assert mx.array_equal(ids, want_ids)
    assert np.abs(np.array(weights) - np.array(want_weights)).max() <= router.TOLERANCE * np.abs(
        np.array(want_weights)).max()
