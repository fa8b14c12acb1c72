"""The fast-path registry: first-use check against the reference, fallback with one warning, forced reference."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import Ds4Error
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.registry import FastPath, KernelFallbackWarning


def reference(x: mx.array) -> mx.array:
    return mx.sum(x * x, axis=-1)


def probe(key: int) -> tuple[mx.array]:
    return (mx.random.normal((4, key), key=mx.random.key(key)),)


class Calls:
    """Counts how often each side runs, to show what the registry chose."""

    def __init__(self, fast):
        self.fast_calls = 0
        self.probes = 0
        self._fast = fast

    def fast(self, x: mx.array) -> mx.array:
        self.fast_calls += 1
        return self._fast(x)

    def probe(self, key: int) -> tuple[mx.array]:
        self.probes += 1
        return probe(key)


def make(fast, tolerance=1e-6, backends=registry.BACKENDS) -> tuple[FastPath, Calls]:
    calls = Calls(fast)
    return FastPath("square_sum", reference, calls.fast, calls.probe, tolerance, backends), calls


pytestmark = pytest.mark.usefixtures("kernels_unforced", "on_cpu")  # the registry's rules, checked on the CPU


def test_an_equal_fast_path_is_used_without_warning():
    path, calls = make(lambda x: mx.sum(mx.square(x), axis=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert path.enabled(64)
        x = mx.ones((2, 64))
        np.testing.assert_array_equal(np.array(path(x, key=64)), [64.0, 64.0])
    assert calls.probes == 1  # checked once, on the probe, and remembered
    assert calls.fast_calls == 2  # the check, then the call
    assert path.decisions() == {("cpu", 64): registry.Decision(True)}


def test_a_wrong_fast_path_falls_back_with_one_warning():
    path, calls = make(lambda x: mx.sum(x * x, axis=-1) * 1.001)
    with pytest.warns(KernelFallbackWarning, match=r"fast path square_sum for 32 on cpu is not used: max \|error\|"):
        assert not path.enabled(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not path.enabled(32)
        x = mx.full((1, 32), 2.0)
        np.testing.assert_array_equal(np.array(path(x, key=32)), [128.0])
    assert calls.probes == 1 and calls.fast_calls == 1  # only the check ran the fast side
    decision = path.decisions()["cpu", 32]
    assert not decision.fast and "exceeds 1e-06" in decision.reason


def test_a_fast_path_that_fails_to_compile_falls_back():
    def broken(x):
        raise RuntimeError("nvrtc: error: identifier 'simd_sum' is undefined")

    path, _ = make(broken)
    with pytest.warns(KernelFallbackWarning, match="failed to build or run .RuntimeError: nvrtc: error"):
        assert not path.enabled(16)
    x = mx.ones((1, 16))
    np.testing.assert_array_equal(np.array(path(x, key=16)), [16.0])


def test_decisions_are_per_shape_class():
    path, _ = make(lambda x: mx.where(x.shape[-1] > 32, 0.0, mx.sum(x * x, axis=-1)))  # wrong for long rows only
    assert path.enabled(32)
    with pytest.warns(KernelFallbackWarning, match="for 64 on cpu"):
        assert not path.enabled(64)
    assert path.enabled(32)


def test_a_backend_without_the_kernel_uses_the_reference_silently():
    path, calls = make(lambda x: x, backends=("cuda", "metal"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not path.enabled(8)
        assert np.array(path(mx.ones((1, 8)), key=8)).tolist() == [8.0]
    assert calls.probes == 0 and calls.fast_calls == 0


@pytest.mark.parametrize("force", ["env", "set_mode", "context"])
def test_reference_mode_skips_every_fast_path(monkeypatch, force):
    path, calls = make(lambda x: mx.sum(x * x, axis=-1))
    if force == "env":
        monkeypatch.setenv(registry.ENV, "reference")
        assert not path.enabled(8)
    elif force == "set_mode":
        registry.set_mode("reference")
        assert not path.enabled(8)
    else:
        with registry.forced_mode("reference"):
            assert registry.mode() == "reference"
            assert not path.enabled(8)
        assert registry.mode() == "fast"
    assert calls.probes == 0 and calls.fast_calls == 0


def test_named_reference_paths_skip_only_those(monkeypatch):
    """DS4_REFERENCE_PATHS keeps the fast paths it names on their references (unchecked) and no others; a name
    that is no fast path is refused with the names that are."""
    path, calls = make(lambda x: mx.sum(x * x, axis=-1))
    named, named_calls = make(lambda x: mx.sum(x * x, axis=-1))
    named.name = "square_sum_named"
    registry._NAMES.add(named.name)
    monkeypatch.setenv(registry.PATHS_ENV, " square_sum_named ")
    assert path.enabled(8) and not named.enabled(8)
    assert calls.probes == 1 and named_calls.probes == 0
    monkeypatch.setenv(registry.PATHS_ENV, "square_sum_named,no_such_path")
    with pytest.raises(Ds4Error, match="DS4_REFERENCE_PATHS names no fast path: no_such_path .*square_sum"):
        named.enabled(8)


def test_forced_mode_overrides_the_environment_and_restores(monkeypatch):
    monkeypatch.setenv(registry.ENV, "reference")
    with registry.forced_mode("fast"):
        assert registry.mode() == "fast"
    assert registry.mode() == "reference"


def test_bad_mode_values_are_refused(monkeypatch):
    monkeypatch.setenv(registry.ENV, "turbo")
    with pytest.raises(Ds4Error, match="DS4_KERNELS must be one of fast, reference, got 'turbo'"):
        registry.mode()
    with pytest.raises(Ds4Error, match="kernel mode must be one of"):
        registry.set_mode("gpu")


def test_exact_tolerance_refuses_one_ulp():
    path, _ = make(lambda x: mx.sum(x * x, axis=-1) * (1 + 2**-23), tolerance=0)
    with pytest.warns(KernelFallbackWarning, match="values are not exactly the reference's"):
        assert not path.enabled(8)


def test_outputs_are_compared_one_by_one_with_their_own_bound():
    def ref(x):
        return x, mx.sum(x, axis=-1)

    def fast(x):
        return x, mx.sum(x, axis=-1) * (1 + 1e-6)

    exact_then_loose = FastPath("pair", ref, fast, probe, (0, 1e-5))
    assert exact_then_loose.enabled(8)
    both_exact = FastPath("pair", ref, fast, probe, 0)
    with pytest.warns(KernelFallbackWarning, match="output 1: its values are not exactly"):
        assert not both_exact.enabled(8)


def test_shape_and_finiteness_mismatches_are_disagreements():
    want = mx.array([1.0, 2.0])
    assert "float32[3]" in registry.disagreement(mx.zeros((3,)), want, 1e-3)
    assert "not finite" in registry.disagreement(mx.array([1.0, mx.nan]), want, 1e-3)
    assert registry.disagreement(mx.array([1.0, 2.0 + 1e-4]), want, 1e-3) is None


def test_keys_are_described_by_name():
    from ds4_mlx.model.gguf import GGMLType

    assert registry.describe((GGMLType.Q2_K, 4096, True)) == "(Q2_K, 4096, True)"


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="unknown backends"):
        FastPath("x", reference, reference, probe, 0, backends=("rocm",))


def test_a_fast_path_that_raises_on_real_inputs_falls_back_for_good():
    def picky(x: mx.array) -> mx.array:
        if x.shape[0] > 8:
            raise ValueError("no kernel for this shape")
        return reference(x)

    path, _ = make(picky)
    with pytest.warns(KernelFallbackWarning, match="failed on real inputs"):
        got = path(mx.ones((16, 64)), key=64)
    np.testing.assert_array_equal(np.array(got), np.array(reference(mx.ones((16, 64)))))
    assert path.decisions()["cpu", 64].fast is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path(mx.ones((4, 64)), key=64)  # decided: the reference, silently


def test_planning_takes_gpu_fast_paths_unchecked_and_stands_in_for_kernels():
    from ds4_mlx.kernels.machinery import dialect

    def launches(x: mx.array) -> mx.array:
        (y,) = dialect.build(dialect.Kernel("k", ("x",), ("y",), "y[0] = x[0];"), registry.current_backend())(
            inputs=[x], output_shapes=[(2, 3)], output_dtypes=[mx.int32], grid=(1, 1, 1), threadgroup=(1, 1, 1))
        return y

    path, calls = make(launches, backends=("cuda",))
    x = mx.ones((4, 8))
    rms_norm = mx.fast.rms_norm
    with registry.planning("cuda"):
        assert registry.current_backend() == "cuda" and registry.planned() == "cuda"
        y = path(x, key=8)
        assert (y.shape, y.dtype) == ((2, 3), mx.int32) and not y.any().item()
        assert mx.fast.rms_norm is not rms_norm
    assert calls.probes == 0 and calls.fast_calls == 1  # taken without a check
    assert registry.current_backend() == "cpu" and registry.planned() is None and mx.fast.rms_norm is rms_norm
    assert path(x, key=8).shape == (4,)  # the CPU's reference again, nothing remembered from the plan
    with pytest.raises(Ds4Error, match="plan"):
        with registry.planning("cpu"):
            pass
