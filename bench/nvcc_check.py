"""Compiles every custom kernel a model's decode step and prefill chunks launch on CUDA, without a GPU: compile
errors, registers, spills and shared memory per kernel with the machine's nvcc, or with `--nvrtc LIB` the runtime's
own compile (kernels/machinery/nvrtc.py: that NVRTC library, its options, cubin size and seconds per kernel).

The launches are recorded while the graphs are built for CUDA (`registry.planning`: every CUDA fast path taken,
nothing computed): each kernel with the template constants and the input and output types it is launched with. The
text is kernels/machinery/nvrtc.py's `kernel_text`, laid out as MLX 0.32's CUDA backend lays out a `cuda_kernel`
(custom_kernel.cpp `build_kernel`) with the standard CUDA headers in place of MLX's (which these kernels never use).
A kernel that fails here fails on the GPU (where MLX's compile, then its first-use check, would take over); one
that compiles here can still be wrong, which its tests check.

    PYTHONPATH=$PWD python bench/nvcc_check.py                      # small.gguf's shapes
    PYTHONPATH=$PWD python bench/nvcc_check.py --synthetic 2        # Flash's shapes (first 2 layers, ~8 GB)
    PYTHONPATH=$PWD python bench/nvcc_check.py --nvrtc .../nvidia/cu13/lib/libnvrtc.so.13   # pip nvidia-cuda-nvrtc

Needs nvcc (CUDA 12 or later) on PATH, or a libnvrtc; the GPU architecture is --arch (default sm_90a, the H200 as
the runtime compiles for it: the wgmma kernels need the "a").
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

import ds4_mlx.kernels
from ds4_mlx.kernels.machinery import dialect, nvrtc, registry
from ds4_mlx.kernels.machinery.dialect import CUDA, Kernel


def record_launches() -> dict[str, tuple[Kernel, dict]]:
    """Replaces `build` in every kernels module by one that records each launch (then stands in for it); returns
    the record, filled as graphs are built: source name -> (kernel, launch arguments)."""
    seen: dict[str, tuple[Kernel, dict]] = {}

    def build(kernel: Kernel, backend: str):
        def launch(**kw):
            template = tuple((name, str(value)) for name, value in kw.get("template", []))
            seen.setdefault(f"{kernel.name}{''.join('_' + v for _, v in template)}", (kernel, kw))
            return dialect.stand_in(**kw)
        return launch

    for info in pkgutil.walk_packages(ds4_mlx.kernels.__path__, "ds4_mlx.kernels."):
        module = importlib.import_module(info.name)
        if hasattr(module, "build"):
            module.build = build
    return seen


def source(kernel: Kernel, launch: dict) -> str:
    """The kernel's text as the runtime compiles it (kernels/machinery/nvrtc.py)."""
    template = launch.get("template", [])
    return nvrtc.kernel_text(
        nvrtc.function_name(kernel.name, template), CUDA.header(kernel), CUDA.render(kernel.source),
        [(name, x.dtype) for name, x in zip(kernel.inputs, launch["inputs"], strict=True)],
        list(zip(kernel.outputs, launch["output_dtypes"], strict=True)), template, kernel.launch_bounds)


def nvrtc_one(compiler: nvrtc.Nvrtc, options: list[str], text: str, function: str) -> str:
    """One line: the cubin's size and the compile's seconds, or NVRTC's first error: the runtime's own compile
    (kernels/machinery/nvrtc.py)."""
    start = time.perf_counter()
    try:
        cubin, _ = compiler.compile(text, function, options)
    except nvrtc.CompileError as error:
        return "FAILED: " + str(error).splitlines()[0][:300]
    return f"cubin {len(cubin)} B in {time.perf_counter() - start:.2f} s"


def compile_one(path: Path, arch: str) -> str:
    """One line: registers, spills, shared memory; or the compiler's first error."""
    run = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(path.with_suffix(".cubin")),
                          str(path)], capture_output=True, text=True)
    text = run.stdout + run.stderr
    if run.returncode:
        errors = [line for line in text.splitlines() if "error" in line]
        return "FAILED: " + (errors[0] if errors else text.strip().splitlines()[-1])[:300]
    registers = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    smem = re.findall(r"(\d+) bytes smem", text)
    return (f"{registers[-1] if registers else '?'} registers, {spills[-1] if spills else '?'} B spilled, "
            f"{smem[-1] if smem else '?'} B shared")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="/tmp/m/small.gguf")
    parser.add_argument("--synthetic", type=int, metavar="LAYERS", help="Flash's layout, first LAYERS layers")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk tokens (default 64)")
    parser.add_argument("--nvrtc", metavar="LIBNVRTC", help="compile with this libnvrtc.so as the runtime does "
                        "(kernels/machinery/nvrtc.py: its options for --arch, its text) instead of nvcc")
    args = parser.parse_args()
    from ds4_mlx.model.model import Model

    launches = record_launches()
    with registry.planning("cuda"):
        if args.synthetic:
            from ds4_mlx.model.synthetic import flash_config, synthetic_weights

            model = Model(synthetic_weights(flash_config(args.synthetic)))
        else:
            from ds4_mlx.model.weights import open_weights

            model = Model(open_weights(args.model))
        cache = model.new_cache(4 * args.chunk + 8)
        for _ in range(3):  # a chunk at position 0, then chunks meeting the rows earlier ones left
            mx.eval(model.prefill(mx.arange(args.chunk, dtype=mx.int32) % 1000 + 5, cache, chunk_size=args.chunk))
        for _ in range(2):  # the eager first step, then the compiled one
            mx.eval(model.decode(7, cache)[1], *cache.arrays())
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, (kernel, launch) in sorted(launches.items()):
            path = Path(tmp) / f"{name[:120]}.cu"
            path.write_text(source(kernel, launch))
            paths.append((name, path, nvrtc.function_name(kernel.name, launch.get("template", []))))
        with ThreadPoolExecutor(2) as pool:
            if args.nvrtc:
                compiler = nvrtc.Nvrtc(ctypes.CDLL(args.nvrtc))
                options = nvrtc.compile_options(int(args.arch[3]), int(args.arch[4:].rstrip("a")))
                results = list(pool.map(lambda item: nvrtc_one(compiler, options, item[1].read_text(), item[2]),
                                        paths))
            else:
                results = list(pool.map(lambda item: compile_one(item[1], args.arch), paths))
    for (name, *_), result in zip(paths, results, strict=True):
        failed += result.startswith("FAILED")
        print(f"{name[:90]:90s} {result}")
    print(f"{len(paths)} kernels compiled for {args.arch}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
