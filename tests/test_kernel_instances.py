"""A prefill chunk of a new length, or at a new position, launches only kernel instances launched before.

A kernel instance is a kernel's text with its template constants; on CUDA each is one NVRTC compile (~1 s on the
H200, then kept on disk, kernels/machinery/nvrtc.py). With a chunk's row or token count among the constants, every
prompt of a new length compiled ~8 instances inside the user's prefill. Planned for CUDA on the CPU (registry.planning):
every launch is recorded by kernel and template, and stands in for its work.
"""

from __future__ import annotations

import importlib
import pkgutil

import mlx.core as mx

import ds4_mlx.kernels
from ds4_mlx.kernels.machinery import dialect, registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights


def test_chunks_of_new_lengths_and_positions_launch_no_new_kernel_instances(tmp_path, monkeypatch):
    instances: set[tuple] = set()

    def build(kernel: dialect.Kernel, backend: str):
        def launch(**kw):
            instances.add((kernel.name, tuple((name, str(value)) for name, value in kw.get("template", []))))
            return dialect.stand_in(**kw)
        return launch

    for info in pkgutil.walk_packages(ds4_mlx.kernels.__path__, "ds4_mlx.kernels."):
        module = importlib.import_module(info.name)
        if hasattr(module, "build"):
            monkeypatch.setattr(module, "build", build)
    path = write_model(tmp_path / "small.gguf", preset="small")
    added = []
    with registry.planning("cuda"):
        model = Model(open_weights(path))
        cache = model.new_cache(2048)
        for n in (512, 512, 300, 301, 257):  # the preset's ratio-4 layers pick rows from 2048 tokens on
            before = len(instances)
            mx.eval(model.prefill(mx.arange(n, dtype=mx.int32) % 1000 + 5, cache, chunk_size=512))
            added.append(len(instances) - before)
    assert added[0] >= 15 and added[1:] == [0, 0, 0, 0], added
