"""Compiles every custom kernel a model's decode step and prefill chunks launch on CUDA with the machine's nvcc, as
MLX's NVRTC would compile it, without a GPU: compile errors, registers, spills and shared memory per kernel.

The launches are recorded while the graphs are built for CUDA (`registry.planning`: every CUDA fast path taken,
nothing computed): each kernel with the template constants and the input and output types it is launched with. The
source is then put together as MLX 0.32's CUDA backend does (custom_kernel.cpp `build_kernel`: its default header,
the kernel's header, a `__global__` function in namespace mlx::core::cu taking the inputs then the outputs, the
template constants at the top of the body), except that MLX's own utils.cuh (types for shape arguments, which these
kernels never use) is replaced by the standard headers it brings. A kernel that fails here fails on the GPU
(where its first-use check would fall back); one that compiles here can still be wrong, which its tests check.

    PYTHONPATH=$PWD python bench/nvcc_check.py                      # small.gguf's shapes
    PYTHONPATH=$PWD python bench/nvcc_check.py --synthetic 2        # Flash's shapes (first 2 layers, ~8 GB)

Needs nvcc (CUDA 12 or later) on PATH; the GPU architecture is --arch (default sm_90, the H200).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

import ds4_mlx.kernels
from ds4_mlx.kernels import dialect, registry
from ds4_mlx.kernels.dialect import CUDA, Kernel

CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
              mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.int16: "int16_t",
              mx.uint16: "uint16_t", mx.int8: "int8_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
HEADER = "#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cooperative_groups.h>\n"
"""What MLX's default header (utils.cuh, cooperative_groups.h) gives these kernels."""


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

    for info in pkgutil.iter_modules(ds4_mlx.kernels.__path__):
        module = importlib.import_module(f"ds4_mlx.kernels.{info.name}")
        if hasattr(module, "build"):
            module.build = build
    return seen


def source(kernel: Kernel, launch: dict) -> str:
    """The kernel's text as MLX's CUDA backend puts it together for NVRTC."""
    inputs = [f"    const {CUDA_TYPES[x.dtype]}* {name}" for name, x in zip(kernel.inputs, launch["inputs"], strict=True)]
    outputs = [f"    {CUDA_TYPES[d]}* {name}" for name, d in zip(kernel.outputs, launch["output_dtypes"], strict=True)]
    constants = []
    for name, value in launch.get("template", []):
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {str(value).lower()};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {name} = {value};")
        else:
            constants.append(f"  using {name} = {CUDA_TYPES[value]};")
    return (HEADER + CUDA.header(kernel) + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {kernel.name}(\n" + ",\n".join(inputs + outputs) + ") {\n"
            + "\n".join(constants) + "\n\n" + CUDA.render(kernel.source) + "\n}\n\n} // namespace mlx::core::cu\n")


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
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk tokens (default 64)")
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
            paths.append((name, path))
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda item: compile_one(item[1], args.arch), paths))
    for (name, _), result in zip(paths, results, strict=True):
        failed += result.startswith("FAILED")
        print(f"{name[:90]:90s} {result}")
    print(f"{len(paths)} kernels compiled for {args.arch}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
