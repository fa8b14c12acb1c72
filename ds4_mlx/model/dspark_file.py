"""The DSpark support GGUF (the C engine's `DeepSeek-V4-Flash-DSpark-support-0731.gguf`): layout, checks, a random one.

The file holds a 3-stage drafter for a main model, and nothing of the main model (its embedding and LM head are
shared). As published (`deepseek4-quantize --dspark-support`, default options):

* metadata: `general.architecture` "deepseek4-dspark", `general.name`, `general.alignment`, then u32
  `dspark.block_size` 5, `dspark.markov_rank` 256, `dspark.noise_token_id` 128799, the u32 array
  `dspark.target_layer_ids` [40, 41, 42], `dspark.stage_count` 3 and `dspark.n_layers` 3;
* 81 tensors sorted by name: per stage `mtp.<s>.` the 24 tensors of a raw-window (ratio 0), score-routed V4 block;
  on stage 0 `main_proj` (ne [3 n_embd, n_embd]) and `main_norm`; on the last stage `norm`, `hc_head_{base,fn,scale}`,
  `markov_head.markov_w{1,2}` (ne [rank, n_vocab] each) and `confidence_head.proj` (ne [n_embd + rank, 1]);
* types: routed experts IQ2_XXS gate/up and Q2_K down, `hc_*_fn` F16, norms, biases and HC vectors F32, every other
  2-D weight Q8_0 (the router, `main_proj`, the Markov tables and the confidence projection included).

Those facts come from the converter's source (antirez/ds4 `gguf-tools/deepseek4-quantize.c`: its metadata, the
strcmp order of the tensors, the types) and agree with the C engine's loader and the published size; the published
file's own header was not read (no public dump of it exists), so its tensor offsets rest on the converter's
alignment (32) and order.

The C engine reads each metadata field under any of three spellings (`deepseek4.dspark.X`, `deepseek4.dspark_X`,
`dspark.X`, first found wins), takes the stage count from the tensor names, and tells a DSpark file from a legacy MTP
file by its tensors (`file_kind`). It never refuses a bad support file, it only leaves drafting off; here every
mismatch is one LayoutError naming what is wrong.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import LayoutError
from . import factory
from .config import ModelConfig
from .gguf import GGMLType, GGUFFile
from .weights import F16, F32, Q8_0, ROUTED_TYPES, ModelWeights, TensorSpec, _check_layout, _expert_types, block_layout

ARCH = "deepseek4-dspark"
NAME = "DeepSeek V4 Flash DSpark support"
STAGES = 3
"""The published drafter's stage count (the C engine's loaders, and llama.cpp's, take no other)."""
BLOCK_SIZE = 5
MARKOV_RANK = 256
NOISE_TOKEN = 128799
"""`<｜place▁holder▁no▁799｜>` in the V4 vocabulary: the fill token of the block's non-anchor rows."""
MAX_BLOCK_SIZE = 16
"""The C engine's bound on the block size."""
FIELDS = ("block_size", "markov_rank", "noise_token_id", "target_layer_ids")
DENSE = (F16, F32, Q8_0)
"""What the C engine accepts for a 2-D projection of the drafter (no BF16)."""


def aliases(field: str) -> tuple[str, str, str]:
    """The metadata keys the C engine reads one field under, first found wins."""
    return f"deepseek4.dspark.{field}", f"deepseek4.dspark_{field}", f"dspark.{field}"


@dataclass(frozen=True)
class DSparkSpec:
    """A support file's drafter parameters: block size (anchor + noise rows = drafts per step), Markov rank, noise
    token, the main layers whose outputs it reads, and its stage count."""

    block_size: int
    markov_rank: int
    noise_token: int
    target_layers: tuple[int, ...]
    n_stages: int = STAGES

    def validate(self, config: ModelConfig) -> None:
        """The C engine's metadata checks against the main model, and the published drafter's shape."""
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise LayoutError(f"DSpark block size {self.block_size}, expected 1..{MAX_BLOCK_SIZE} (published: 5)")
        if self.markov_rank <= 0:
            raise LayoutError(f"DSpark Markov rank {self.markov_rank}, expected > 0 (published: 256)")
        if not 0 <= self.noise_token < config.n_vocab:
            raise LayoutError(f"DSpark noise token {self.noise_token} is outside the main model's vocabulary "
                              f"[0, {config.n_vocab})")
        layers = self.target_layers
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or layers[-1] >= config.n_layer:
            raise LayoutError(f"DSpark target layers {list(layers)}: expected strictly increasing ids of the main "
                              f"model's {config.n_layer} layers (published: [40, 41, 42])")
        if self.n_stages != STAGES:
            raise LayoutError(f"the DSpark file has {self.n_stages} stages (mtp.N.*), expected {STAGES}")


def published_spec(config: ModelConfig) -> DSparkSpec:
    """The published file's parameters for a main model of this config: its last three layers as targets, and
    the noise token where the vocabulary has it (the small test vocabulary's pad token, id 2, otherwise)."""
    noise = NOISE_TOKEN if config.n_vocab > NOISE_TOKEN else 2
    return DSparkSpec(BLOCK_SIZE, MARKOV_RANK, noise, tuple(range(config.n_layer - STAGES, config.n_layer)))


def stage_count(names: list[str]) -> int:
    """The C engine's stage count: 1 + the largest N of the tensors named mtp.N.*."""
    stages = [int(m.group(1)) for name in names if (m := re.match(r"mtp\.(\d+)\.", name))]
    return max(stages) + 1 if stages else 0


def file_kind(names: list[str]) -> str | None:
    """"dspark", "mtp" (legacy MTP-1) or None, from the tensor names as the C engine decides: DSpark needs >= 3
    stages and a main_proj, Markov head and confidence head under mtp.*; legacy MTP mtp.0.e_proj, h_proj and
    hc_head_base."""
    under = [n for n in names if n.startswith("mtp.")]
    if stage_count(under) >= 3 and all(any(part in n for n in under)
                                       for part in (".main_proj.", ".markov_head.", ".confidence_head.")):
        return "dspark"
    if {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_base.weight"} <= set(names):
        return "mtp"
    return None


def read_spec(file: GGUFFile) -> DSparkSpec:
    """The drafter parameters of a support file's metadata (each under any of its aliases); one error for a field
    that is missing or of the wrong kind."""
    values = {}
    for field in FIELDS:
        key = next((k for k in aliases(field) if k in file.metadata), None)
        if key is None:
            raise LayoutError(f"the DSpark file {file.path} has no {field} (metadata key {' or '.join(aliases(field))})")
        value = file.metadata[key]
        if field == "target_layer_ids":
            if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or (value < 0).any():
                raise LayoutError(f"{key} is {value!r}, expected an array of unsigned layer ids")
            value = tuple(int(v) for v in value)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise LayoutError(f"{key} is {value!r}, expected an unsigned integer")
        values[field] = value
    return DSparkSpec(values["block_size"], values["markov_rank"], values["noise_token_id"],
                      values["target_layer_ids"], stage_count(list(file.tensors)))


def dspark_layout(c: ModelConfig, spec: DSparkSpec) -> dict[str, TensorSpec]:
    """Every tensor of the support file by full name, with the ne shapes and the types the C engine accepts."""
    block = block_layout(c, 0, mtp=True)
    hc_width = c.n_hc * c.n_embd
    for suffix, tensor in block.items():
        if len(tensor.shape) == 2 and suffix.endswith("_fn.weight"):
            block[suffix] = replace(tensor, types=(F16, F32))
        elif len(tensor.shape) == 2:
            block[suffix] = replace(tensor, types=DENSE)
        elif len(tensor.shape) == 3:
            block[suffix] = replace(tensor, types=ROUTED_TYPES)
    layout: dict[str, TensorSpec] = {}
    for stage in range(spec.n_stages):
        layout |= {f"mtp.{stage}.{suffix}": tensor for suffix, tensor in block.items()}
    last = f"mtp.{spec.n_stages - 1}."
    return layout | {
        "mtp.0.main_proj.weight": TensorSpec((len(spec.target_layers) * c.n_embd, c.n_embd), DENSE),
        "mtp.0.main_norm.weight": TensorSpec((c.n_embd,), (F32,)),
        last + "norm.weight": TensorSpec((c.n_embd,), (F32,)),
        last + "hc_head_base.weight": TensorSpec((c.n_hc,), (F32,)),
        last + "hc_head_fn.weight": TensorSpec((hc_width, c.n_hc), (F16, F32)),
        last + "hc_head_scale.weight": TensorSpec((1,), (F32,)),
        last + "markov_head.markov_w1.weight": TensorSpec((spec.markov_rank, c.n_vocab), DENSE),
        last + "markov_head.markov_w2.weight": TensorSpec((spec.markov_rank, c.n_vocab), DENSE),
        last + "confidence_head.proj.weight": TensorSpec((c.n_embd + spec.markov_rank, 1), DENSE),
    }


class DSparkWeights(ModelWeights):
    """A validated DSpark support file; its shapes follow the main model's config, its parameters `spec`."""

    def __init__(self, file: GGUFFile, config: ModelConfig, spec: DSparkSpec,
                 expert_types: list[tuple[GGMLType, GGMLType]]) -> None:
        super().__init__(file, config, expert_types, "dspark")
        self.spec = spec


def open_dspark_weights(path: str | os.PathLike[str], main_config: ModelConfig) -> DSparkWeights:
    """Open a DSpark support GGUF and check its metadata and every tensor against the main model's dimensions."""
    file = GGUFFile.open(path)
    try:
        if file_kind(list(file.tensors)) != "dspark":
            raise LayoutError(f"{path} is not a DSpark support file: it lacks >= 3 mtp.N stages with main_proj, "
                              f"markov_head and confidence_head tensors")
        spec = read_spec(file)
        spec.validate(main_config)
        _check_layout(file, dspark_layout(main_config, spec), prefix="mtp.")
        expert_types = [_expert_types(file, f"mtp.{s}.") for s in range(spec.n_stages)]
    except BaseException:
        file.close()
        raise
    return DSparkWeights(file, main_config, spec, expert_types)


def support_kind(path: str | os.PathLike[str]) -> str:
    """"dspark" or "mtp": which drafter a --mtp file holds, by its tensors (one error if neither)."""
    with GGUFFile.open(path) as file:
        kind = file_kind(list(file.tensors))
    if kind is None:
        raise LayoutError(f"unsupported --mtp file {Path(path).name}: expected legacy MTP tensors (mtp.0.e_proj, "
                          f"h_proj, hc_head_base) or DSpark ones (3 mtp.N stages, main_proj, markov_head, "
                          f"confidence_head)")
    return kind


def dspark_tensors(config: ModelConfig, spec: DSparkSpec) -> list[factory.TensorSpec]:
    """Every tensor of a support file for a main model of this config, with the published names, types and ne
    shapes (scaled with the config), in the published order: sorted by name."""
    c, T = config, factory.T
    hc_width = c.n_hc * c.n_embd
    tensors = []
    for stage in range(spec.n_stages):
        block = factory._block_tensors(c, f"mtp.{stage}.", (T.IQ2_XXS, T.Q2_K), ratio=0, hash_routing=False,
                                       hc_type=T.F16)
        tensors += [replace(t, ggml_type=T.Q8_0) if t.name.endswith("ffn_gate_inp.weight") else t for t in block]
    last, rank = f"mtp.{spec.n_stages - 1}.", spec.markov_rank
    tensors += [
        factory.TensorSpec("mtp.0.main_proj.weight", (len(spec.target_layers) * c.n_embd, c.n_embd), T.Q8_0,
                           factory._linear(len(spec.target_layers) * c.n_embd)),
        factory.TensorSpec("mtp.0.main_norm.weight", (c.n_embd,), T.F32, factory._NORM),
        factory.TensorSpec(last + "norm.weight", (c.n_embd,), T.F32, factory._NORM),
        factory.TensorSpec(last + "hc_head_base.weight", (c.n_hc,), T.F32, factory._HC_BASE),
        factory.TensorSpec(last + "hc_head_fn.weight", (hc_width, c.n_hc), T.F16, factory._hc_fn(hc_width)),
        factory.TensorSpec(last + "hc_head_scale.weight", (1,), T.F32, factory._HC_SCALE),
        factory.TensorSpec(last + "markov_head.markov_w1.weight", (rank, c.n_vocab), T.Q8_0, factory._EMBED),
        factory.TensorSpec(last + "markov_head.markov_w2.weight", (rank, c.n_vocab), T.Q8_0, factory._linear(rank)),
        factory.TensorSpec(last + "confidence_head.proj.weight", (c.n_embd + rank, 1), T.Q8_0,
                           factory._linear(c.n_embd + rank)),
    ]
    return sorted(tensors, key=lambda t: t.name.encode())


def dspark_metadata(spec: DSparkSpec, name: str = NAME) -> list[factory.MetadataEntry]:
    """The published file's nine keys, in its order, every number u32."""
    V = factory.V
    return [
        ("general.architecture", V.STRING, ARCH, None),
        ("general.name", V.STRING, name, None),
        ("general.alignment", V.UINT32, factory.ALIGNMENT, None),
        ("dspark.block_size", V.UINT32, spec.block_size, None),
        ("dspark.markov_rank", V.UINT32, spec.markov_rank, None),
        ("dspark.noise_token_id", V.UINT32, spec.noise_token, None),
        ("dspark.target_layer_ids", V.ARRAY, list(spec.target_layers), V.UINT32),
        ("dspark.stage_count", V.UINT32, spec.n_stages, None),
        ("dspark.n_layers", V.UINT32, spec.n_stages, None),
    ]


def write_dspark_model(path: str | os.PathLike[str], main_preset: str = "tiny", seed: int = 0, data: str = "random",
                       vocab: str | None = None, progress: factory.Progress | None = None) -> Path:
    """Write a random DSpark support file in the published layout for the main model of a preset (and its
    vocabulary: `vocab` as make-model's); the same arguments give the same bytes."""
    config = factory.preset_config(main_preset)
    words = factory.build_vocab(factory.PRESET_VOCAB[main_preset] if vocab is None else vocab)
    config = replace(config, n_vocab=len(words.tokens))
    factory._check_choice("data", data, factory.DATA_MODES)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    spec = published_spec(config)
    preset = "" if main_preset == "flash" else f" {main_preset}"
    name = f"{NAME}{preset} ({factory.RANDOM_WEIGHTS}, seed {seed})"
    return factory._write_file(path, dspark_metadata(spec, name), dspark_tensors(config, spec), seed, data, progress)
