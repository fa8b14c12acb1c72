"""The full DeepSeek V4 Flash layout on synthetic weights, built in memory without a file (`ds4-mlx bench
--synthetic`).

Every tensor has the published name, ne shape and GGUF type (the factory's inventory, ds4.c) and holds random
valid quant blocks drawn by the factory's block builders, so the forward pass does the work it does on the real
file. Tensors with the same role, shape and type in several layers share one random draw: the whole model draws
about one layer's worth of blocks (the routed experts once, the attention tensors once per compression ratio)
instead of 81 GB, yet each layer still gets its own resident copy, so the memory traffic is the real model's.
Speed does not depend on the values, only on their types and shapes: a tensor larger than factory.REPEAT_AFTER
(the embedding, the LM head, an expert bank) repeats its first rows.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import Ds4Error, UsageError
from . import factory
from .config import FLASH, ModelConfig
from .factory import TensorSpec, model_tensors, routed_expert_types, tensor_data
from .gguf import GGMLType, TensorInfo
from .weights import ModelWeights

SYNTHETIC_KINDS = ("q2", "q4", "mxfp4")
"""The published variants: q2 (IQ2_XXS/Q2_K experts, ~81 GB), q4 (Q4_K experts, ~150 GB) and mxfp4 (0731's MXFP4
experts, ~145 GiB)."""

_LAYER = re.compile(r"^blk\.\d+\.")


def flash_config(layers: int = FLASH.n_layer) -> ModelConfig:
    """The published hyperparameters, cut to the first `layers` layers (their compression schedule kept)."""
    if not 1 <= layers <= FLASH.n_layer:
        raise UsageError(f"--layers must be between 1 and {FLASH.n_layer}, got {layers}")
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
        self.tensors: dict[str, TensorInfo] = {}
        offset = 0
        for name, spec in self._specs.items():  # offsets as a file would lay them out: the loader reads in order
            self.tensors[name] = TensorInfo(name, tuple(spec.ne), GGMLType(int(spec.ggml_type)), offset, spec.n_bytes)
            offset += spec.n_bytes
        self._draws: dict[tuple, np.ndarray] = {}
        self._first: dict[tuple, str] = {}
        for name in self.tensors:
            self._first.setdefault(self._key(name), name)

    def _key(self, name: str) -> tuple:
        spec = self._specs[name]
        return (_LAYER.sub("blk.*.", name), spec.ne, spec.ggml_type)

    def twin(self, name: str) -> str:
        """The first tensor (in file order) holding the same bytes as `name` (`name` itself if it is the first):
        the loader copies that one's resident arrays on the device instead of moving the same bytes again."""
        return self._first[self._key(name)]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw blocks; the same array for every layer's tensor of the same role, shape and type."""
        key = self._key(name)
        data = self._draws.get(key)
        if data is None:
            data = self._draws[key] = _draw(self._specs[name], self.seed)
        return data

    def close(self) -> None:
        """Drops the drawn blocks (the model holds its own copies once built)."""
        self._draws.clear()


def synthetic_weights(config: ModelConfig, experts: str = "q2", seed: int = 0) -> ModelWeights:
    """ModelWeights over a SyntheticFile: what `open_weights` returns for a real file of this layout."""
    if experts not in SYNTHETIC_KINDS:
        raise Ds4Error(f"--synthetic must be one of {', '.join(SYNTHETIC_KINDS)}, got {experts}")
    file = SyntheticFile(config, experts, seed)
    expert_types = [
        tuple(GGMLType(int(t)) for t in routed_expert_types(config, experts, layer)) for layer in range(config.n_layer)
    ]
    return ModelWeights(file, config, expert_types, variant=f"synthetic {experts}")


def _draw(spec: TensorSpec, seed: int) -> np.ndarray:
    """One tensor's blocks as the factory's "repeated" data yields them (its first factory.REPEAT_AFTER bytes of
    random rows, then those rows again), written into a single buffer. Drawing every row of the embedding, the LM
    head and an expert bank took ~40 s of each benchmark process on the H200's host (bench/RESULTS.md), for values
    speed does not depend on."""
    out = np.empty(spec.n_bytes, dtype=np.uint8)
    pos = 0
    for chunk in tensor_data(spec, seed, repeat_after=factory.REPEAT_AFTER):
        out[pos : pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        pos += len(chunk)
    return out
