"""GPU threads on the CPU: the machinery that emulated_cuda.py and emulated_metal.py share.

A kernel's text, in either backend's language, is C++ once that language's words are defined for threads on the
CPU. What both need is here: one std::thread per GPU thread, a std::barrier per threadgroup and per 32-thread SIMD
group, a lane exchange through which SIMD shuffles, sums and maxima pass, threadgroups run one after the other by
the same threads (`run_groups`), and the compiler and loader of the resulting library. Each backend's module adds
its own words and declares the kernel as MLX declares it; both export `launch(void** buffers, groups_x, groups_y,
threads)`, which `runner` calls on numpy arrays.

In the C++ text, `emulated_thread.x` is the thread's index in its threadgroup and `emulated_group` the
threadgroup's position (x, y); a kernel reads them only through its backend's words.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

MACHINERY = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct Index { unsigned int x, y, z; };
thread_local Index emulated_thread, emulated_group;
std::barrier<>* group_barrier;
std::barrier<>* simd_barriers[32];
inline void emulated_group_barrier() { group_barrier->arrive_and_wait(); }
inline void emulated_simd_barrier() { simd_barriers[emulated_thread.x >> 5]->arrive_and_wait(); }
// the value of the lane whose index differs by `mask`: every lane of the SIMD group writes its own, then reads
template <class T> T lane_xor(T v, int mask) {
  static T exchange[32][32];
  const unsigned int simd = emulated_thread.x >> 5, lane = emulated_thread.x & 31;
  exchange[simd][lane] = v;
  emulated_simd_barrier();
  const T other = exchange[simd][lane ^ mask];
  emulated_simd_barrier();
  return other;
}
template <class T> T lane_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += lane_xor(v, offset);
  return v;
}
inline float lane_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = std::fmax(v, lane_xor(v, offset));
  return v;
}

// Threadgroups one after the other, by the same threads; a separate barrier ends each group, so a thread that
// leaves the kernel early cannot stand in for one at the kernel's own barriers, and the next group does not touch
// the static threadgroup memory before every thread is done with it.
template <class Body>
void run_groups(int groups_x, int groups_y, int threads, Body body) {
  std::barrier<> all(threads), done(threads);
  group_barrier = &all;
  std::vector<std::unique_ptr<std::barrier<>>> simds;
  for (int s = 0; s < threads / 32; ++s) {
    simds.emplace_back(new std::barrier<>(32));
    simd_barriers[s] = simds.back().get();
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=, &done] {
      emulated_thread = {(unsigned)t, 0, 0};
      for (int y = 0; y < groups_y; ++y) {
        for (int x = 0; x < groups_x; ++x) {
          emulated_group = {(unsigned)x, (unsigned)y, 0};
          body();
          done.arrive_and_wait();
        }
      }
    });
  }
  for (auto& thread : pool) thread.join();
}
"""

SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer"] if os.environ.get("DS4_EMULATE_ASAN") else []
"""With DS4_EMULATE_ASAN=1 (and libasan preloaded: bench/README.md, "Spending the GPU minutes well"), kernels are
built with AddressSanitizer, so a read or write past any input, output or threadgroup array stops the test: what
would be an illegal memory access (or a silent wrong read) on the GPU."""

UNWRITTEN = {np.dtype(np.float32): np.nan, np.dtype(np.float16): np.nan, np.dtype(np.int32): -1,
             np.dtype(np.uint32): 0xFFFFFFFF, np.dtype(np.uint8): 0xFF, np.dtype(np.bool_): False}
"""What outputs hold before a launch: NaN (or -1, all ones) shows a value the kernel did not write."""


def compile_library(source: str, directory: Path, name: str, flags: Sequence[str] = ()) -> ctypes.CDLL:
    """MACHINERY + source as a loaded shared library, compiled once per text in `directory`."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernel tests need g++ (C++20)")
    source = MACHINERY + source
    path = directory / f"{name}_{hashlib.sha1((source + str(SANITIZE) + str(flags)).encode()).hexdigest()[:12]}"
    if not path.with_suffix(".so").exists():
        path.with_suffix(".cpp").write_text(source)
        build = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                                *flags, *SANITIZE, str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-3000:]
    return ctypes.CDLL(str(path.with_suffix(".so")))


Library = Callable[[Sequence[np.ndarray], Sequence[np.dtype]], ctypes.CDLL]
"""A kernel's library for these inputs and output dtypes (each backend types its signature from them)."""


def runner(library: Library) -> Callable:
    """A function of (inputs, output shapes, groups (x, y), threads per group, output dtypes (float32 unless
    given)) -> outputs, which start as UNWRITTEN: the library's kernel launched on numpy arrays."""

    def run(inputs: Sequence[np.ndarray], output_shapes: Sequence[tuple[int, ...]], groups: tuple[int, int],
            threads: int, output_dtypes: Sequence[np.dtype] | None = None) -> list[np.ndarray]:
        inputs = [np.ascontiguousarray(a) for a in inputs]
        output_dtypes = [np.dtype(d) for d in output_dtypes or [np.float32] * len(output_shapes)]
        outputs = [np.full(shape, UNWRITTEN[d], d) for shape, d in zip(output_shapes, output_dtypes)]
        buffers = (ctypes.c_void_p * (len(inputs) + len(outputs)))(*[a.ctypes.data for a in inputs + outputs])
        library(inputs, output_dtypes).launch(buffers, *groups, threads)
        return outputs

    return run


def numpy_dtype(dtype: mx.Dtype) -> np.dtype:
    return np.dtype(str(dtype).rsplit(".", 1)[-1])
