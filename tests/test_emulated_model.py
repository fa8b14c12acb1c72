"""The tiny model run as MLX's CUDA or Metal backend would run it, every custom kernel's text for that backend
emulated on the CPU (emulated_cuda.py, emulated_metal.py).

Each kernel has its own emulated tests at Flash shapes; this one runs them all together at the tiny preset's shapes,
the way the model calls them: every fast path written for the backend is taken, its first-use check made against
its reference (so a kernel that fails at these shapes shows as a fallback warning, an error here), a prefill chunk
and decode steps through the step's code (mx.compile is off: the emulated kernels read their inputs on the host).
The logits must equal the forced reference path's within float32 reassociation. On Metal the kernels launched must
be every kernel the same calls launch when planned for Metal (registry.planning), each launch within Apple's limits
(emulated_metal.APPLE_LIMITS), and nothing CUDA-only may be reached: no CUDA library loaded (NVRTC, the driver's
graphs, page-locked memory all go through kernels/machinery/cudalib.py), no kernel built for CUDA, no tensor-core
kernel. On the H200 the gpu-marked tiny-model tests do the same through MLX. Slow: ~2-5 minutes a case of g++
compiles and emulation on 2 cores.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels
import ds4_mlx.kernels.tensor_cores
import ds4_mlx.model
import emulated_cuda
import emulated_metal
from ds4_mlx.kernels.machinery import cudalib, dialect, registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

pytestmark = pytest.mark.slow

BUILDS = {"cuda": emulated_cuda.emulated_build, "metal": emulated_metal.emulated_build}


def modules(package) -> list:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]


def patch_builds(monkeypatch, build: Callable, packages=(ds4_mlx.kernels,)) -> None:
    for package in packages:
        for module in modules(package):
            if hasattr(module, "build"):
                monkeypatch.setattr(module, "build", build)


@pytest.fixture
def emulating(request, on_cpu, monkeypatch, tmp_path) -> str:
    """Every module that asks which backend this is hears the parameter's, and every kernel build is emulated (on
    Metal, in the model's modules too: a CUDA build there fails)."""
    backend = request.param
    monkeypatch.setattr(registry, "current_backend", lambda: backend)
    for module in modules(ds4_mlx.kernels) + modules(ds4_mlx.model):
        if hasattr(module, "current_backend"):
            monkeypatch.setattr(module, "current_backend", lambda: backend)
    packages = (ds4_mlx.kernels,) if backend == "cuda" else (ds4_mlx.kernels, ds4_mlx.model)
    patch_builds(monkeypatch, BUILDS[backend](tmp_path), packages)
    mx.disable_compile()
    yield backend
    mx.enable_compile()


def planned_kernels(run: Callable[[], object], monkeypatch) -> set[str]:
    """The kernels `run` launches when its graphs are planned for Metal (stand-ins for the launches)."""
    names: set[str] = set()

    def build(kernel: dialect.Kernel, backend: str) -> Callable:
        def launch(**kw):
            names.add(kernel.name)
            return dialect.stand_in(**kw)
        return launch

    with monkeypatch.context() as m:
        patch_builds(m, build)
        with registry.planning("metal"):
            mx.eval(run())
    return names


def tensor_core_kernels() -> set[str]:
    """The names of the kernels defined in kernels/tensor_cores (CUDA-only fast paths)."""
    return {value.name for module in modules(ds4_mlx.kernels.tensor_cores) for value in vars(module).values()
            if isinstance(value, dialect.Kernel)}


@pytest.mark.parametrize(("emulating", "experts"), [("cuda", "q4"), ("metal", "q4"), ("metal", "q2")],
                         indirect=["emulating"])
def test_tiny_model_through_the_emulated_kernels_equals_the_reference(emulating, experts, monkeypatch, tmp_path):
    """q4 experts (affine matvecs, MLX's gather_qmm), and on Metal also q2's (their own dequant-matvec and dequant
    kernels)."""
    weights = open_weights(write_model(tmp_path / "tiny.gguf", preset="tiny", experts=experts, seed=7))
    tokens = np.random.default_rng(11).integers(0, weights.config.n_vocab, 20).astype(np.int32)
    model = Model(weights, simulate_quant=False)

    def logits(decode: bool) -> np.ndarray:
        cache = model.new_cache(64)
        model.prefill(mx.array(tokens[:18]), cache)
        if decode:
            return np.stack([np.array(model.decode(int(t), cache)[1]).reshape(-1) for t in tokens[18:]])
        return np.stack([np.array(model(mx.array(tokens[i:i + 1]), cache)).reshape(-1) for i in range(18, 20)])

    libraries: list[str] = []
    monkeypatch.setattr(cudalib, "load", lambda name, bind: libraries.append(name))
    if emulating == "metal":
        planned = planned_kernels(lambda: logits(decode=True), monkeypatch)
        emulated_metal.LAUNCHES.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that fails its check or its build here is an error
        fast = logits(decode=True)
    with registry.forced_mode("reference"):
        want = logits(decode=False)
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()
    if emulating == "metal":
        launched = {launch.kernel for launch in emulated_metal.LAUNCHES}
        assert len(planned) >= 25 and planned <= launched, planned - launched
        assert not launched & tensor_core_kernels() and not libraries
