"""Shared fixtures. Tests run on MLX's CPU backend unless marked `gpu`.

Large files are built once per session and removed when it ends, whatever the outcome: the demo model (tiny preset,
real V4 vocabulary, 114 MB) serves every test that needs a tiny model with the real tokenizer, `--demo` runs and the
example notebook included.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import ds4_mlx  # noqa: F401  (sets MLX_ENABLE_TF32=0 before MLX runs anything: tests compare in true float32)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _mlx_device():
    """Pin MLX to the CPU for the default suite so results do not depend on the host's accelerator."""
    import mlx.core as mx

    if os.environ.get("DS4_TEST_DEVICE", "cpu") == "cpu":
        mx.set_default_device(mx.cpu)
    yield


@pytest.fixture(autouse=True, scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_CACHE_HOME (where `--demo` keeps its model) in a folder of this session, for this process and the
    commands it starts: tests never write into the user's cache, and the demo model is built at most once."""
    root = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root)
    yield root
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _memory_limit() -> Iterator[None]:
    """The device memory limit measured anew after each test, and MLX's own limits put back as they were (a CLI
    test's --memory-limit holds for the process; an engine's load applies it to MLX, memory.apply_limit, and MLX
    over its limit waits for every task in flight before each new one: the tests after it would crawl)."""
    import mlx.core as mx

    from ds4_mlx import memory

    memory_limit = mx.set_memory_limit(0)
    mx.set_memory_limit(memory_limit)
    cache_limit = mx.set_cache_limit(0)
    mx.set_cache_limit(cache_limit)
    yield
    memory.set_limit(None)
    mx.set_memory_limit(memory_limit)
    mx.set_cache_limit(cache_limit)


@pytest.fixture(scope="session")
def demo_model(cache_home: Path) -> Path:
    """The demo model's file (tiny preset, q2 experts, real vocabulary, seed 0), built once per session."""
    from ds4_mlx.engine import demo_model_path, ensure_demo_model

    path = ensure_demo_model()
    assert path == demo_model_path() and path.is_relative_to(cache_home)
    return path


@pytest.fixture
def on_cpu():
    """Runs a test on MLX's CPU backend whatever device the suite uses (for rules that are about the CPU)."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def on_gpu():
    """Runs a gpu-marked test on MLX's GPU backend (CUDA or Metal), which the machine must have."""
    import mlx.core as mx

    assert mx.metal.is_available() or mx.cuda.is_available(), "gpu tests need MLX's CUDA or Metal backend"
    before = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(before)


@pytest.fixture
def on_cuda(on_gpu):
    """Runs a test of a CUDA-only kernel (tensor cores; Metal keeps another kernel) on MLX's CUDA backend. Such tests
    are also marked `cuda`: on a Mac, run `-m "gpu and not cuda"`."""
    import mlx.core as mx

    assert mx.cuda.is_available(), "this test needs MLX's CUDA backend: deselect it with -m 'gpu and not cuda'"


@pytest.fixture
def kernels_unforced(monkeypatch):
    """Fast paths decided by the registry itself: no DS4_KERNELS or DS4_REFERENCE_PATHS override, no forced mode,
    before or after."""
    from ds4_mlx.kernels.machinery import registry

    monkeypatch.delenv(registry.ENV, raising=False)
    monkeypatch.delenv(registry.PATHS_ENV, raising=False)
    registry.set_mode(None)
    yield
    registry.set_mode(None)
