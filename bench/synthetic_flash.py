"""Prefill and decode speed of the full DeepSeek V4 Flash layout, on synthetic weights built in memory.

    python bench/synthetic_flash.py                  # all 43 layers, q2 experts (85.5 GiB loaded): an H200
    python bench/synthetic_flash.py --layers 4       # the first 4 layers (every kind of layer once), ~9 GB
    python bench/synthetic_flash.py --json --gen-tokens 32

No file is read or written. Every tensor has the published name, ne shape and GGUF type (the factory's inventory,
spec §2) and holds random valid quant blocks drawn by the factory's block builders, so the forward pass does the
work it does on the real file. Tensors with the same role, shape and type in several layers share one random
draw: building the whole model draws about one layer's worth of blocks (the routed experts once, the attention
tensors once per compression ratio) instead of 81 GB, yet each layer still gets its own copy in MLX memory, so
the memory traffic is that of the real model. Speed does not depend on the values, only on their types and shapes.

Before anything is built, the engine's memory check refuses a layout that does not fit this device together with
the session state at --ctx, naming what would. `--experts q4` is the q4 file's layout (~150 GB of weights).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ds4_mlx.commands.bench import add_bench_options, bench_session, check_sizes, describe, print_result
from ds4_mlx.commands.options import select_backend
from ds4_mlx.errors import Ds4Error
from ds4_mlx.model.config import FLASH, ModelConfig
from ds4_mlx.model.factory import EXPERT_KINDS, TensorSpec, tensor_data, model_tensors, routed_expert_types
from ds4_mlx.model.gguf import GGMLType, TensorInfo
from ds4_mlx.model.weights import ModelWeights

_LAYER = re.compile(r"^blk\.\d+\.")


def flash_config(layers: int) -> ModelConfig:
    """The published hyperparameters, cut to the first `layers` layers (their compression schedule kept)."""
    if not 1 <= layers <= FLASH.n_layer:
        raise Ds4Error(f"--layers must be between 1 and {FLASH.n_layer}, got {layers}")
    config = replace(
        FLASH,
        n_layer=layers,
        n_hash_layer=min(FLASH.n_hash_layer, layers),
        compress_ratios=FLASH.compress_ratios[:layers],
        swiglu_clamp=FLASH.swiglu_clamp[:layers],
    )
    config.validate()
    return config


class SyntheticFile:
    """Stands in for a mapped GGUFFile under ModelWeights: the published tensor directory, and each tensor's raw
    blocks drawn when the model asks for them (`tensor_bytes`)."""

    def __init__(self, config: ModelConfig, experts: str = "q2", seed: int = 0) -> None:
        self.path = Path(f"<synthetic DeepSeek V4 Flash, {config.n_layer} layers, {experts} experts>")
        self.metadata: dict = {}
        self.seed = seed
        self._specs = {spec.name: spec for spec in model_tensors(config, experts)}
        self.tensors = {
            name: TensorInfo(name, tuple(spec.ne), GGMLType(int(spec.ggml_type)), 0, spec.n_bytes)
            for name, spec in self._specs.items()
        }
        self._draws: dict[tuple, np.ndarray] = {}

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw blocks; the same array for every layer's tensor of the same role, shape and type."""
        spec = self._specs[name]
        key = (_LAYER.sub("blk.*.", name), spec.ne, spec.ggml_type)
        data = self._draws.get(key)
        if data is None:
            data = self._draws[key] = _draw(spec, self.seed)
        return data

    def close(self) -> None:
        """Drops the drawn blocks (the model holds its own copies once built)."""
        self._draws.clear()


def synthetic_weights(config: ModelConfig, experts: str = "q2", seed: int = 0) -> ModelWeights:
    """ModelWeights over a SyntheticFile: what `open_weights` returns for a real file of this layout."""
    file = SyntheticFile(config, experts, seed)
    expert_types = [
        tuple(GGMLType(int(t)) for t in routed_expert_types(config, experts, layer)) for layer in range(config.n_layer)
    ]
    return ModelWeights(file, config, expert_types, variant=f"synthetic {experts}")


def _draw(spec: TensorSpec, seed: int) -> np.ndarray:
    """One tensor's random blocks, written into a single buffer as the factory yields them."""
    out = np.empty(spec.n_bytes, dtype=np.uint8)
    pos = 0
    for chunk in tensor_data(spec, seed):
        out[pos : pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        pos += len(chunk)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=FLASH.n_layer, help=f"layers to build (default {FLASH.n_layer})")
    p.add_argument("--experts", choices=EXPERT_KINDS, default="q2", help="routed expert types (default q2)")
    p.add_argument("-c", "--ctx", type=int, default=32768, help="context size in tokens (default 32768)")
    p.add_argument("--backend", choices=("cpu", "gpu"), help="MLX device (default: MLX's default device)")
    p.add_argument("--no-quant-sim", action="store_true", help="turn off the FP8 KV / FP4 indexer simulation")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_bench_options(p)
    args = p.parse_args(argv)
    try:
        return _run(args)
    except Ds4Error as e:
        print(f"synthetic_flash: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from ds4_mlx.engine import check_memory, device_memory_bytes
    from ds4_mlx.model.linear import loaded_nbytes
    from ds4_mlx.model.model import Model
    from ds4_mlx.progress import Progress
    from ds4_mlx.session import Session

    check_sizes(args.prompt_tokens, args.gen_tokens, args.repeats, args.ctx)
    select_backend(args)
    config = flash_config(args.layers)
    t0 = time.perf_counter()
    weights = synthetic_weights(config, args.experts, args.seed)
    check_memory(weights, loaded_nbytes(weights), args.ctx, device_memory_bytes())
    with Progress(quiet=args.quiet).bar("building", unit="bytes") as bar:
        model = Model(weights, simulate_quant=not args.no_quant_sim, progress=bar.update)
    weights.close()
    load_seconds = time.perf_counter() - t0
    result = bench_session(
        Session(model, args.ctx),
        label=f"synthetic flash, {args.experts} experts ({describe(model)})",
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        repeats=args.repeats,
        seed=args.seed,
        load_seconds=load_seconds,
    )
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
