"""Which fast path each part of a decode step and a prefill chunk takes on Metal, and what those launches ask of an
Apple GPU, planned on the CPU (registry.planning: every fast path written for Metal taken without its check, each
launch a stand-in).

The listing is the contract for Macs: a change that sends a part of the step to the reference on Metal (a fast
path's backends, a `fits` that stops taking the shapes) changes it and fails here. The tiny preset has Flash's
structure (hash layers, ratio-4 and ratio-128 compressed layers, the indexer, the hyper-connections) at smaller
widths: what only Flash's widths take is not asked here (the learned router's kernel wants whole SIMD groups of
experts, Flash's 256; tiny's 8 take the reference without asking). The launches' threadgroups are held to Apple's
limits, their Metal text to what Metal has (emulated_metal.checked_text), and no tensor-core kernel may be among
them. Whether each kernel computes its reference is the slow emulated tests' part (test_emulated_model.py,
test_kernels_emulated.py, test_kernels_emulated_metal.py).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import mlx.core as mx
import pytest

import ds4_mlx.kernels
import ds4_mlx.kernels.tensor_cores
from ds4_mlx.kernels.machinery import dialect, registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights
from emulated_metal import APPLE_LIMITS, checked_text

METAL_PATHS = {
    "q2": {
        "prefill": {
            "affine_batch_float32": "fast",
            "affine_matmul": "fast",
            "affine_matvec": "fast",
            "chunk_attention": "fast",
            "chunk_attention_tensor": "reference",
            "compressor_chunk": "fast",
            "dense_affine_f16x2": "reference",
            "finish_rows": "fast",
            "half_batch_f16x2": "reference",
            "half_matvec": "fast",
            "hash_route": "fast",
            "hc_head": "fast",
            "hc_split": "fast",
            "hc_update": "fast",
            "invert_permutation": "fast",
            "iq2_xxs_grouped_float32": "fast",
            "iq2_xxs_grouped_raw_f16x2": "reference",
            "q2_k_grouped_float32": "fast",
            "q2_k_grouped_raw_f16x2": "reference",
            "rope": "fast",
            "slot_sum": "fast",
        },
        "decode": {
            "affine_gather_matmul": "fast",
            "affine_matvec": "fast",
            "compressor_step": "fast",
            "compressor_step_pair": "fast",
            "decode_attention": "fast",
            "down_sum": "fast",
            "embed_streams": "fast",
            "finish_into_window": "fast",
            "finish_rows": "fast",
            "gate_up_swiglu": "fast",
            "half_matvec": "fast",
            "hash_route": "fast",
            "hc_head": "fast",
            "hc_post_pre": "fast",
            "hc_pre": "fast",
            "hc_update": "fast",
            "indexer_pick": "fast",
            "swiglu_affine_matvec": "fast",
        },
    },
    "q4": {
        "prefill": {
            "affine_batch_float32": "fast",
            "affine_gather_matmul": "fast",
            "affine_grouped_float32": "fast",
            "affine_matmul": "fast",
            "affine_matvec": "fast",
            "chunk_attention": "fast",
            "chunk_attention_tensor": "reference",
            "compressor_chunk": "fast",
            "dense_affine_f16x2": "reference",
            "finish_rows": "fast",
            "half_batch_f16x2": "reference",
            "half_matvec": "fast",
            "hash_route": "fast",
            "hc_head": "fast",
            "hc_split": "fast",
            "hc_update": "fast",
            "invert_permutation": "fast",
            "rope": "fast",
            "slot_sum": "fast",
        },
        "decode": {
            "affine_gather_matmul": "fast",
            "affine_matvec": "fast",
            "compressor_step": "fast",
            "compressor_step_pair": "fast",
            "decode_attention": "fast",
            "embed_streams": "fast",
            "finish_into_window": "fast",
            "finish_rows": "fast",
            "half_matvec": "fast",
            "hash_route": "fast",
            "hc_head": "fast",
            "hc_post_pre": "fast",
            "hc_pre": "fast",
            "hc_update": "fast",
            "indexer_pick": "fast",
            "swiglu_affine_matvec": "fast",
        },
    },
}
"""The fast paths an 18-token prefill chunk and then a decode step of the tiny model ask for on Metal, by its
experts' type, and what each answers (a path asked several times answers the same each time); those answering
"reference" are CUDA-only tensor-core paths, whose work the SIMT kernels and MLX ops listed beside them do."""


def kernels_modules() -> list:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(ds4_mlx.kernels.__path__, "ds4_mlx.kernels.")]


@pytest.fixture(params=["q2", "q4"])
def planned_metal(request, on_cpu, monkeypatch, tmp_path) -> dict:
    """A tiny model's (q2 or q4 experts) prefill chunk and decode step planned for Metal: the fast paths asked in
    each phase with their answers, and every launch (kernel, threadgroup, grid)."""
    asked: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    launches: list[tuple[dialect.Kernel, tuple, tuple]] = []
    phase = ["prefill"]
    enabled = registry.FastPath.enabled

    def recorded(self, key) -> bool:
        answer = enabled(self, key)
        before = asked[phase[0]].setdefault(self.name, "fast" if answer else "reference")
        assert before == ("fast" if answer else "reference"), f"{self.name} answered both ways"
        return answer

    def build(kernel: dialect.Kernel, backend: str) -> Callable:
        assert backend == "metal", f"{kernel.name} built for {backend}"

        def launch(**kw):
            launches.append((kernel, tuple(kw["threadgroup"]), tuple(kw["grid"])))
            return dialect.stand_in(**kw)
        return launch

    monkeypatch.setattr(registry.FastPath, "enabled", recorded)
    for module in kernels_modules():
        if hasattr(module, "build"):
            monkeypatch.setattr(module, "build", build)
    weights = open_weights(write_model(tmp_path / "tiny.gguf", preset="tiny", experts=request.param, seed=7))
    with registry.planning("metal"):
        model = Model(weights, simulate_quant=False)
        cache = model.new_cache(64)
        mx.eval(model.prefill(mx.arange(18, dtype=mx.int32) % 400 + 5, cache))
        phase[0] = "decode"
        mx.eval(model.decode(7, cache)[1])
    return {"experts": request.param, "asked": asked, "launches": launches}


def test_each_part_of_a_step_takes_its_metal_fast_path(planned_metal):
    assert planned_metal["asked"] == METAL_PATHS[planned_metal["experts"]]


def test_metal_launches_fit_apple_gpus_and_use_nothing_cuda_only(planned_metal):
    launches = planned_metal["launches"]
    tensor_cores = {value.name: value for info in pkgutil.walk_packages(ds4_mlx.kernels.tensor_cores.__path__,
                                                                        "ds4_mlx.kernels.tensor_cores.")
                    for value in vars(importlib.import_module(info.name)).values()
                    if isinstance(value, dialect.Kernel)}
    assert len({kernel.name for kernel, _, _ in launches}) >= 25
    told = []  # the text check tells the tensor-core kernels by their helpers, CUDA's alone
    for kernel in tensor_cores.values():
        try:
            checked_text(kernel)
        except AssertionError as error:
            told.append(kernel.name)
            assert "which Metal does not have" in str(error)
    assert len(told) >= 5, told
    for kernel, threadgroup, grid in launches:
        threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
        assert threads <= APPLE_LIMITS["threads_per_threadgroup"] and threads % APPLE_LIMITS["simd_width"] == 0
        assert grid[0] % threadgroup[0] == 0, f"{kernel.name}: a partial threadgroup"
        assert kernel.name not in tensor_cores and not kernel.shared_memory, kernel.name
        checked_text(kernel)
