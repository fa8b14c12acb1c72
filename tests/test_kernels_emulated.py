"""The CUDA rendering of the dequant-matvec kernels, run on the CPU by emulated_cuda.py (a thread per GPU thread).

The staging, the SIMD reductions and the row and unit indexing are all exercised.

Slow (it compiles C++ with g++ -std=c++20, which must be installed); the GPU tests in test_kernels_matvec.py
check the same kernels through MLX on the device.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.matvec import TOLERANCE, QuantMatvec, gathered_reference, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.kernels.q2_k import Q2_K_MATVEC
from ds4_mlx.model.gguf import BLOCK_SIZES
from emulated_cuda import compile_library, kernel_function

pytestmark = pytest.mark.slow

LAUNCH = r"""
extern "C" void launch(const float* x, const uint8_t* w, const uint32_t* ids, float* y, int groups, int slots,
                       int threads) {
  run_groups(groups, slots, threads, [=] { KERNEL(x, w, ids, y); });
}
"""


def emulated(matvec: QuantMatvec, n_out: int, n_in: int, tmp_path):
    """The kernel for (n_out, n_in) compiled for the CPU: a function of (x, blocks, ids) -> y."""
    block_values, block_bytes = BLOCK_SIZES[matvec.ggml_type]
    row_bytes = n_in // block_values * block_bytes
    simds, rows = launch_plan(row_bytes)
    template = {"OUT": n_out, "IN": n_in, "ROW_BYTES": row_bytes, "UNITS": n_in // matvec.unit_values,
                "SIMDS": simds, "ROWS": rows}
    params = ["const float* x", "const uint8_t* w", "const uint32_t* ids", "float* y"]
    source = kernel_function(matvec.kernel, params, template) + LAUNCH.replace("KERNEL", matvec.kernel.name)
    library = compile_library(source, tmp_path / f"{matvec.kernel.name}_{n_out}_{n_in}")
    groups = -(-n_out // (simds * rows))

    def run(x: np.ndarray, blocks: np.ndarray, ids: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        blocks = np.ascontiguousarray(blocks, np.uint8)
        ids = np.ascontiguousarray(ids, np.uint32)
        y = np.full((ids.size, n_out), np.nan, np.float32)
        pointer = ctypes.c_void_p
        library.launch(pointer(x.ctypes.data), pointer(blocks.ctypes.data), pointer(ids.ctypes.data),
                       pointer(y.ctypes.data), groups, ids.size, simds * 32)
        return y

    return run


@pytest.mark.parametrize("matvec", [IQ2_XXS_MATVEC, Q2_K_MATVEC], ids=lambda m: m.ggml_type.name)
@pytest.mark.parametrize("size", [(64, 256), (40, 512), (24, 2048), (20, 4096)], ids=str)
def test_emulated_cuda_kernel_equals_the_reference(matvec, size, tmp_path):
    """Rows staged by 2-byte (256, 512) and 16-byte loads (2048, 4096), threadgroups left partly idle by row
    counts that do not divide, several experts and slots."""
    n_out, n_in = size
    shape = (3, n_out, n_in)
    blocks = random_blocks(matvec.ggml_type, 3 * n_out, n_in, seed=n_in).reshape(3, -1)
    ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    x = random_activations((4, n_in), seed=n_out)
    want = np.array(gathered_reference(x, blocks, ids, matvec.ggml_type, shape))
    got = emulated(matvec, n_out, n_in, tmp_path)(np.array(x), np.array(blocks), np.array(ids))
    assert np.isfinite(got).all()  # every output row was written
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
