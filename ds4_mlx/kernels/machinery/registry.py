"""Choosing, per backend and shape class, between a fast implementation and the reference it must equal.

A fast path (a custom kernel, or a built-in MLX op over a converted weight layout) is registered together with its
reference: plain MLX ops that run everywhere and stay the source of truth. The first time the fast path is wanted
for a (backend, key) pair, where the key is whatever selects a compiled variant (ggml type, row length, ...), both
run on a small probe input built for that key and their outputs are compared within a stated tolerance. From then
on the answer is remembered: the fast path is used, or the reference is, after one warning that names the fast
path and the reason (it failed to compile or run, or it disagreed). A backend the fast path was not written for
(no custom kernels on the CPU, say) quietly gets the reference: that is not a failure.

`DS4_KERNELS=reference` in the environment, or `set_mode("reference")` / `with forced_mode("reference"):` in
Python, makes every fast path answer "no" without checking anything: for debugging, and for comparing the two.
`DS4_REFERENCE_PATHS=name,...` does that for the named fast paths alone: one measured against the rest in one run.
"""

from __future__ import annotations

import enum
import functools
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from ...errors import Ds4Error
from . import dialect, nvrtc

ENV = "DS4_KERNELS"
PATHS_ENV = "DS4_REFERENCE_PATHS"
_NAMES: set[str] = set()
"""Every fast path's name, as registered."""
MODES = ("fast", "reference")
BACKENDS = ("cpu", "cuda", "metal")

_forced: str | None = None
_planned: str | None = None


class KernelFallbackWarning(RuntimeWarning):
    """A fast path failed its first-use check on this backend; the reference is used instead."""


def _checked_mode(value: str, source: str) -> str:
    if value not in MODES:
        raise Ds4Error(f"{source} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def mode() -> str:
    """"fast" (fast paths that pass their check are used) or "reference" (never), from set_mode or DS4_KERNELS."""
    if _forced is not None:
        return _forced
    return _checked_mode(os.environ.get(ENV, "fast") or "fast", ENV)


def reference_paths() -> frozenset[str]:
    """The fast paths DS4_REFERENCE_PATHS (comma-separated names) keeps on their references."""
    return _parsed_paths(os.environ.get(PATHS_ENV, ""), len(_NAMES))


@functools.cache
def _parsed_paths(value: str, registered: int) -> frozenset[str]:
    """DS4_REFERENCE_PATHS's names, checked against the `registered` fast paths so far: parsed once per value
    (FastPath.enabled asks at every call), again once more paths are registered."""
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = names - _NAMES
    if unknown:
        raise Ds4Error(f"{PATHS_ENV} names no fast path: {', '.join(sorted(unknown))} (fast paths: "
                       f"{', '.join(sorted(_NAMES))})")
    return names


def set_mode(value: str | None) -> None:
    """Force a mode for this process; None goes back to the environment (DS4_KERNELS, default "fast")."""
    global _forced
    _forced = None if value is None else _checked_mode(value, "the kernel mode")


@contextmanager
def forced_mode(value: str) -> Iterator[None]:
    """Run a block with the kernel mode forced, restoring the previous setting afterwards."""
    global _forced
    before = _forced
    set_mode(value)
    try:
        yield
    finally:
        _forced = before


@contextmanager
def planning(backend: str) -> Iterator[None]:
    """Build graphs as `backend` would, on whatever machine this is, to count their launches: every fast path
    written for `backend` is taken without its check, and each custom kernel launch is a stand-in node
    (dialect.stand_in) whose outputs are zeros, as is each mx.fast.rms_norm (one launch there, three ops on the
    CPU). Nothing computed inside means anything but the graph's shape."""
    global _planned
    if backend not in dialect.DIALECTS:
        raise Ds4Error(f"can only plan for a backend with custom kernels ({', '.join(dialect.DIALECTS)}), "
                       f"not {backend!r}")
    before = _planned, dialect.STAND_INS, mx.fast.rms_norm
    _planned, dialect.STAND_INS = backend, True
    mx.fast.rms_norm = _one_launch_rms_norm  # one kernel on GPU backends, composed of three ops on the CPU
    try:
        yield
    finally:
        _planned, dialect.STAND_INS, mx.fast.rms_norm = before


def _one_launch_rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    inputs = [x] if weight is None else [x, weight]
    return dialect.stand_in(inputs=inputs, output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def planned() -> str | None:
    """The backend graphs are being planned for (see `planning`), or None."""
    return _planned


def current_backend() -> str:
    """The backend MLX computes on now ("cpu", "cuda" or "metal"), or the one being planned for."""
    if _planned is not None:
        return _planned
    if mx.default_device().type == mx.DeviceType.gpu:
        return "cuda" if mx.cuda.is_available() else "metal"
    return "cpu"


def describe(key: Hashable) -> str:
    """A shape-class key for messages: enum members by name, tuples element by element."""
    if isinstance(key, tuple):
        return "(" + ", ".join(describe(part) for part in key) + ")"
    return key.name if isinstance(key, enum.Enum) else str(key)


@dataclass(frozen=True)
class Decision:
    """The outcome of a first-use check: use the fast path or not, and why not."""

    fast: bool
    reason: str = ""


def disagreement(got: mx.array, want: mx.array, tolerance: float) -> str | None:
    """Why `got` is not `want` within `tolerance`, or None when it is.

    The bound is max|got - want| <= tolerance * max|want|: relative to the output's scale, since a matmul's
    reassociation error grows with its largest terms, not with each element. A tolerance of 0 asks for equal
    values: the same bits, except that zeros of either sign are equal and NaN matches NaN.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"it returned {got.dtype}{list(got.shape)} where the reference returns {want.dtype}{list(want.shape)}"
    if tolerance == 0:
        same = mx.all((got == want) | (mx.isnan(got) & mx.isnan(want))).item()
        return None if same else "its values are not exactly the reference's"
    if not mx.all(mx.isfinite(got) == mx.isfinite(want)).item():
        return "it is not finite where the reference is (or the other way round)"
    finite = mx.isfinite(want)
    error = mx.max(mx.where(finite, mx.abs(got - want), 0)).item()
    scale = mx.max(mx.where(finite, mx.abs(want), 0)).item()
    if error > tolerance * scale:
        return f"max |error| {error:.3g} exceeds {tolerance:g} x max |reference| {scale:.3g}"
    return None


class FastPath:
    """A fast implementation of one operation, used where it has shown that it equals the reference.

    `probe(key)` builds the arguments of a small check input for one shape class; `reference(*args)` and
    `fast(*args)` return an array or a tuple of arrays, compared output by output with `tolerance` (one bound, or
    one per output; see `disagreement`). `backends` lists where the fast path can run at all.
    """

    def __init__(
        self,
        name: str,
        reference: Callable[..., mx.array | tuple[mx.array, ...]],
        fast: Callable[..., mx.array | tuple[mx.array, ...]],
        probe: Callable[[Hashable], Sequence[object]],
        tolerance: float | tuple[float, ...],
        backends: Sequence[str] = BACKENDS,
    ):
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"fast path {name}: unknown backends {sorted(unknown)}, expected some of {BACKENDS}")
        self.name = name
        _NAMES.add(name)
        self.reference = reference
        self.fast = fast
        self.probe = probe
        self.tolerance = tolerance
        self.backends = tuple(backends)
        self._decisions: dict[tuple[str, Hashable], Decision] = {}
        self._lock = threading.Lock()

    def enabled(self, key: Hashable) -> bool:
        """Whether to use the fast path for shape class `key` now (checking it first if this is its first use)."""
        if mode() == "reference" or self.name in reference_paths():
            return False
        backend = current_backend()
        if backend not in self.backends:
            return False
        if _planned is not None:
            return True
        with self._lock:
            decision = self._decisions.get((backend, key))
            if decision is None:
                decision = self._decisions[backend, key] = self._check(backend, key)
        return decision.fast

    def __call__(self, *args: object, key: Hashable) -> mx.array | tuple[mx.array, ...]:
        """The fast path where it passed its check; the reference otherwise, and from now on if it raises here."""
        if not self.enabled(key):
            return self.reference(*args)
        try:
            return self.fast(*args)
        except Exception as error:  # real inputs can reach what the probe did not: fall back, never fail a request
            reason = f"it failed on real inputs ({type(error).__name__}: {error})"
            with self._lock:
                self._decisions[current_backend(), key] = Decision(False, reason)
            warnings.warn(f"fast path {self.name} for {describe(key)} on {current_backend()} is not used: {reason}; "
                          "using the reference", KernelFallbackWarning, stacklevel=2)
            return self.reference(*args)

    def decisions(self) -> dict[tuple[str, Hashable], Decision]:
        """The first-use checks made so far, by (backend, key)."""
        return dict(self._decisions)

    def _check(self, backend: str, key: Hashable) -> Decision:
        try:
            args = self.probe(key)
            with nvrtc.paused():  # not part of a step being recorded for a CUDA graph
                want, got = self.reference(*args), self.fast(*args)
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            mx.eval(*want, *got)
            reason = None
            if len(got) != len(want):
                reason = f"it returned {len(got)} outputs where the reference returns {len(want)}"
            bounds = self.tolerance if isinstance(self.tolerance, tuple) else (self.tolerance,) * len(want)
            for i, (g, w, bound) in enumerate(zip(got, want, bounds)):
                if reason is None and (problem := disagreement(g, w, bound)) is not None:
                    reason = problem if len(want) == 1 else f"output {i}: {problem}"
        except Exception as error:  # a kernel that does not compile or launch must not take the model down
            reason = f"it failed to build or run ({type(error).__name__}: {error})"
        if reason is None:
            return Decision(True)
        warnings.warn(
            f"fast path {self.name} for {describe(key)} on {backend} is not used: {reason}; using the reference",
            KernelFallbackWarning,
            stacklevel=4,
        )
        return Decision(False, reason)
