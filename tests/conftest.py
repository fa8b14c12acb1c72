"""Shared fixtures. Tests run on MLX's CPU backend unless marked `gpu`."""

import os

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


@pytest.fixture
def on_cpu():
    """Runs a test on MLX's CPU backend whatever device the suite uses (for rules that are about the CPU)."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def kernels_unforced(monkeypatch):
    """Fast paths decided by the registry itself: no DS4_KERNELS override, no forced mode, before or after."""
    from ds4_mlx.kernels import registry

    monkeypatch.delenv(registry.ENV, raising=False)
    registry.set_mode(None)
    yield
    registry.set_mode(None)
