"""The tiny model run as MLX's CUDA backend would run it, every custom kernel's CUDA text emulated on the CPU.

Each kernel has its own emulated tests at Flash shapes; this one runs them all together at the tiny preset's shapes,
the way the model calls them: every fast path written for CUDA is taken, its first-use check made against its
reference (so a kernel that fails at these shapes shows as a fallback warning, an error here), a 2048-token-style
prefill chunk and decode steps through the step's code (mx.compile is off: the emulated kernels read their inputs
on the host). The logits must equal the forced reference path's within float32 reassociation. On the H200 the
gpu-marked tiny-model tests do the same through MLX. Slow: ~5 minutes of g++ compiles and emulation on 2 cores.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels
import ds4_mlx.model
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights
from emulated_cuda import emulated_build

pytestmark = pytest.mark.slow


@pytest.fixture
def emulating_cuda(on_cpu, monkeypatch, tmp_path):
    """Every module that asks which backend this is hears "cuda", and every kernel build is emulated."""
    build = emulated_build(tmp_path)
    monkeypatch.setattr(registry, "current_backend", lambda: "cuda")
    for package in (ds4_mlx.kernels, ds4_mlx.model):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            if hasattr(module, "current_backend"):
                monkeypatch.setattr(module, "current_backend", lambda: "cuda")
            if package is ds4_mlx.kernels and hasattr(module, "build"):
                monkeypatch.setattr(module, "build", build)
    mx.disable_compile()
    yield
    mx.enable_compile()


def test_tiny_model_through_the_emulated_cuda_kernels_equals_the_reference(emulating_cuda, tmp_path):
    weights = open_weights(write_model(tmp_path / "tiny-q4.gguf", preset="tiny", experts="q4", seed=7))
    tokens = np.random.default_rng(11).integers(0, weights.config.n_vocab, 20).astype(np.int32)
    model = Model(weights, simulate_quant=False)

    def logits(decode: bool) -> np.ndarray:
        cache = model.new_cache(64)
        model.prefill(mx.array(tokens[:18]), cache)
        if decode:
            return np.stack([np.array(model.decode(int(t), cache)[1]).reshape(-1) for t in tokens[18:]])
        return np.stack([np.array(model(mx.array(tokens[i:i + 1]), cache)).reshape(-1) for i in range(18, 20)])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that fails its check or its build here is an error
        fast = logits(decode=True)
    with registry.forced_mode("reference"):
        want = logits(decode=False)
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()
