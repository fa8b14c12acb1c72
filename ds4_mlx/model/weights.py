"""The DeepSeek V4 Flash tensor layout (ds4.c), validated against the config before any weight is touched.

`open_weights` checks the whole inventory at open time, the way ds4's `weights_validate_layout` does, so that a
wrong file fails in milliseconds with a message naming the tensor instead of deep inside the forward pass: every
global, per-layer, compressor and indexer tensor present, each with the shape the config implies (ggml ne order,
ne0 fastest) and its published type, nothing unknown under `blk.`. Only the routed experts may change type from
layer to layer (IQ2_XXS, Q2_K or Q4_K, with gate type == up type), which is what tells the published variants
apart. Tensors outside `blk.` that the layout does not name are ignored, as ds4 ignores tensors it does not bind.
Tensor data stays in the mapped file; nothing is dequantized here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import LayoutError
from .config import ModelConfig
from .gguf import GGMLType, GGUFFile, TensorInfo

if TYPE_CHECKING:
    import mlx.core as mx

F16, F32, Q8_0, I32 = GGMLType.F16, GGMLType.F32, GGMLType.Q8_0, GGMLType.I32
ROUTED_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4)
Q2_EXPERTS = (GGMLType.IQ2_XXS, GGMLType.Q2_K)  # (gate/up, down) of the published q2 files
Q4_EXPERTS = (GGMLType.Q4_K, GGMLType.Q4_K)
MTP_PREFIX = "mtp.0."


@dataclass(frozen=True)
class TensorSpec:
    """What the layout requires of one tensor: its ne shape, the types allowed, and whether it may be absent."""

    shape: tuple[int, ...]
    types: tuple[GGMLType, ...]
    optional: bool = False

    def describe(self) -> str:
        return f"{'/'.join(t.name for t in self.types)} {list(self.shape)}"


def global_layout(c: ModelConfig) -> dict[str, TensorSpec]:
    """Embedding, final HC collapse, final norm and LM head."""
    return {
        "token_embd.weight": TensorSpec((c.n_embd, c.n_vocab), (F16,)),
        "output_hc_base.weight": TensorSpec((c.n_hc,), (F32,)),
        "output_hc_fn.weight": TensorSpec((c.n_hc * c.n_embd, c.n_hc), (F16,)),
        "output_hc_scale.weight": TensorSpec((1,), (F32,)),
        "output_norm.weight": TensorSpec((c.n_embd,), (F32,)),
        "output.weight": TensorSpec((c.n_embd, c.n_vocab), (Q8_0,)),
    }


def block_layout(c: ModelConfig, layer: int, mtp: bool = False) -> dict[str, TensorSpec]:
    """Suffixes of one block, or of the MTP block with `mtp=True`: no compressor, indexer or
    hash table, a required router bias, and F16 or F32 for its HC and router projections."""
    hc = (F16, F32) if mtp else (F16,)
    heads_per_group = c.n_head // c.o_groups
    layout = {
        "hc_attn_fn.weight": TensorSpec((c.n_hc * c.n_embd, c.hc_mix), hc),
        "hc_attn_scale.weight": TensorSpec((3,), (F32,)),
        "hc_attn_base.weight": TensorSpec((c.hc_mix,), (F32,)),
        "attn_norm.weight": TensorSpec((c.n_embd,), (F32,)),
        "attn_q_a.weight": TensorSpec((c.n_embd, c.q_lora_rank), (Q8_0,)),
        "attn_q_a_norm.weight": TensorSpec((c.q_lora_rank,), (F32,)),
        "attn_q_b.weight": TensorSpec((c.q_lora_rank, c.n_head * c.head_dim), (Q8_0,)),
        "attn_kv.weight": TensorSpec((c.n_embd, c.head_dim), (Q8_0,)),
        "attn_kv_a_norm.weight": TensorSpec((c.head_dim,), (F32,)),
        "attn_sinks.weight": TensorSpec((c.n_head,), (F32,)),
        "attn_output_a.weight": TensorSpec((heads_per_group * c.head_dim, c.o_groups * c.o_lora_rank), (Q8_0,)),
        "attn_output_b.weight": TensorSpec((c.o_groups * c.o_lora_rank, c.n_embd), (Q8_0,)),
        "hc_ffn_fn.weight": TensorSpec((c.n_hc * c.n_embd, c.hc_mix), hc),
        "hc_ffn_scale.weight": TensorSpec((3,), (F32,)),
        "hc_ffn_base.weight": TensorSpec((c.hc_mix,), (F32,)),
        "ffn_norm.weight": TensorSpec((c.n_embd,), (F32,)),
        "ffn_gate_inp.weight": TensorSpec((c.n_embd, c.n_expert), hc),
        "exp_probs_b.bias": TensorSpec((c.n_expert,), (F32,), optional=not mtp),
        "ffn_gate_exps.weight": TensorSpec((c.n_embd, c.n_ff_exp, c.n_expert), ROUTED_TYPES),
        "ffn_up_exps.weight": TensorSpec((c.n_embd, c.n_ff_exp, c.n_expert), ROUTED_TYPES),
        "ffn_down_exps.weight": TensorSpec((c.n_ff_exp, c.n_embd, c.n_expert), ROUTED_TYPES),
        "ffn_gate_shexp.weight": TensorSpec((c.n_embd, c.n_ff_exp), (Q8_0,)),
        "ffn_up_shexp.weight": TensorSpec((c.n_embd, c.n_ff_exp), (Q8_0,)),
        "ffn_down_shexp.weight": TensorSpec((c.n_ff_exp, c.n_embd), (Q8_0,)),
    }
    if mtp:
        return layout
    if c.is_hash_layer(layer):
        layout["ffn_gate_tid2eid.weight"] = TensorSpec((c.n_expert_used, c.n_vocab), (I32,))
    ratio = c.compress_ratio(layer)
    if ratio:
        width = (2 if ratio == 4 else 1) * c.head_dim
        layout |= {
            "attn_compressor_ape.weight": TensorSpec((width, ratio), (F16,)),
            "attn_compressor_kv.weight": TensorSpec((c.n_embd, width), (F16,)),
            "attn_compressor_gate.weight": TensorSpec((c.n_embd, width), (F16,)),
            "attn_compressor_norm.weight": TensorSpec((c.head_dim,), (F32,)),
        }
    if ratio == 4:
        index_width = 2 * c.indexer_head_dim
        layout |= {
            "indexer.attn_q_b.weight": TensorSpec((c.q_lora_rank, c.indexer_n_head * c.indexer_head_dim), (F16,)),
            "indexer.proj.weight": TensorSpec((c.n_embd, c.indexer_n_head), (F16,)),
            "indexer_compressor_ape.weight": TensorSpec((index_width, 4), (F16,)),
            "indexer_compressor_kv.weight": TensorSpec((c.n_embd, index_width), (F16,)),
            "indexer_compressor_gate.weight": TensorSpec((c.n_embd, index_width), (F16,)),
            "indexer_compressor_norm.weight": TensorSpec((c.indexer_head_dim,), (F32,)),
        }
    return layout


def mtp_layout(c: ModelConfig) -> dict[str, TensorSpec]:
    """The MTP file: its own embedding/hidden projections and head collapse, plus one block."""
    layout = {
        "hc_head_base.weight": TensorSpec((c.n_hc,), (F32,)),
        "hc_head_fn.weight": TensorSpec((c.n_hc * c.n_embd, c.n_hc), (F16, F32)),
        "hc_head_scale.weight": TensorSpec((1,), (F32,)),
        "e_proj.weight": TensorSpec((c.n_embd, c.n_embd), (Q8_0,)),
        "h_proj.weight": TensorSpec((c.n_embd, c.n_embd), (Q8_0,)),
        "enorm.weight": TensorSpec((c.n_embd,), (F32,)),
        "hnorm.weight": TensorSpec((c.n_embd,), (F32,)),
        "norm.weight": TensorSpec((c.n_embd,), (F32,)),
    } | block_layout(c, 0, mtp=True)
    return {MTP_PREFIX + suffix: spec for suffix, spec in layout.items()}


def model_layout(c: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the main file, by full name."""
    layout = global_layout(c)
    for layer in range(c.n_layer):
        layout |= {f"blk.{layer}.{suffix}": spec for suffix, spec in block_layout(c, layer).items()}
    return layout


class ModelWeights:
    """A validated DeepSeek V4 Flash GGUF: its config, its tensors (raw blocks, mapped lazily) and its variant."""

    whole_tensors = True
    """Whether each tensor's bytes are its bytes in the file (a rank's slices, model/shard.py, are not)."""

    def __init__(self, file: GGUFFile, config: ModelConfig, expert_types: list[tuple[GGMLType, GGMLType]],
                 variant: str) -> None:
        self.file = file
        self.config = config
        self.expert_types = expert_types
        self.variant = variant

    def info(self, name: str) -> TensorInfo:
        try:
            return self.file.tensors[name]
        except KeyError:
            raise LayoutError(f"tensor {name} is not in {self.file.path}") from None

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def twin(self, name: str) -> str | None:
        """The first tensor known to hold the same bytes as `name` (itself if it is the first), or None where
        nothing is known (a real file: only synthetic layouts share bytes)."""
        twin = getattr(self.file, "twin", None)
        return None if twin is None else twin(name)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw ggml blocks of a tensor as a zero-copy uint8 view of the mapped file."""
        self.info(name)
        return self.file.tensor_bytes(name)

    def tensor_rows(self, name: str, first: int, end: int) -> np.ndarray:
        """Rows [first, end) of a tensor's raw blocks, (end - first, row bytes) uint8 (a view of the mapped file)."""
        info = self.info(name)
        return self.tensor_bytes(name).reshape(-1, info.row_bytes)[first:end]

    def tensor_infos(self) -> list[TensorInfo]:
        """The tensors a model built from these weights reads (all of the file's)."""
        return list(self.file.tensors.values())

    def read(self, name: str, convert: Callable[[mx.array], Sequence[mx.array]]) -> list[mx.array]:
        """`convert` applied to the tensor's raw rows (uint8, (rows, row_bytes)), evaluated now: the tensor source
        model/linear.py reads through, without streaming (the model's Loader streams; this serves direct use)."""
        import mlx.core as mx

        info = self.info(name)
        out = list(convert(mx.array(self.tensor_rows(name, 0, info.nbytes // info.row_bytes))))
        mx.eval(out)
        return out

    def array(self, name: str) -> mx.array:
        """The tensor dequantized to float32 (I32 stays int32), in row-major order: ne [IN, OUT] -> (OUT, IN)."""
        import mlx.core as mx

        from ..kernels.formats.quants import dequantize

        info = self.info(name)
        rows = self.tensor_rows(name, 0, info.nbytes // info.row_bytes)
        return dequantize(mx.array(rows), info.ggml_type, tuple(reversed(info.shape)))

    def bytes_by_type(self) -> dict[str, int]:
        """Tensor bytes per ggml type name, largest first."""
        return _bytes_by_type(self.file.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.file.tensors.values())

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MTPWeights(ModelWeights):
    """The optional MTP draft block; its shapes follow the main model's config."""


def open_weights(path: str | os.PathLike[str]) -> ModelWeights:
    """Open a DeepSeek V4 Flash GGUF and validate its metadata and full tensor layout."""
    file = GGUFFile.open(path)
    try:
        config = ModelConfig.from_metadata(file.metadata, file.metadata_types)
        _check_layout(file, model_layout(config), prefix="blk.")
        _check_vocabulary(file, config)
        _check_hash_routing(file, config)
        expert_types = [_expert_types(file, f"blk.{layer}.") for layer in range(config.n_layer)]
        variant = _variant(config, expert_types, file.metadata)
    except BaseException:
        file.close()
        raise
    return ModelWeights(file, config, expert_types, variant)


def open_mtp_weights(path: str | os.PathLike[str], main_config: ModelConfig) -> MTPWeights:
    """Open the MTP GGUF and validate its tensors against the main model's dimensions (its metadata is not read,
    as in ds4)."""
    file = GGUFFile.open(path)
    try:
        if not any(name.startswith("mtp.") for name in file.tensors):
            raise LayoutError(f"{path} is not an MTP file: it has no mtp.* tensors (the main model file given as "
                              f"--mtp?); the draft file comes from ./download_model.sh mtp")
        _check_layout(file, mtp_layout(main_config), prefix="mtp.")
        expert_types = [_expert_types(file, MTP_PREFIX)]
    except BaseException:
        file.close()
        raise
    return MTPWeights(file, main_config, expert_types, "mtp " + _expert_kind(expert_types))


def _check_vocabulary(file: GGUFFile, config: ModelConfig) -> None:
    """The token strings are the vocabulary by id, and the logits have one entry per id: the counts must agree."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != config.n_vocab:
        raise LayoutError(f"tokenizer.ggml.tokens has {len(tokens)} entries, expected deepseek4.vocab_size = "
                          f"{config.n_vocab}")


def _check_hash_routing(file: GGUFFile, config: ModelConfig) -> None:
    """Every expert id of the hash-routing tables must name an expert: the model gathers by them unchecked."""
    for layer in range(config.n_hash_layer):
        name = f"blk.{layer}.ffn_gate_tid2eid.weight"
        table = file.tensor_bytes(name).view("<i4").reshape(-1, config.n_expert_used)
        bad = np.argwhere((table < 0) | (table >= config.n_expert))
        if bad.size:
            row, col = bad[0]
            raise LayoutError(f"tensor {name} routes token {row} to expert {table[row, col]}, expected an id in "
                              f"[0, {config.n_expert})")


def _check_layout(file: GGUFFile, layout: dict[str, TensorSpec], prefix: str) -> None:
    """Every required tensor present with its shape and type; no unknown tensor under `prefix`."""
    for name, spec in layout.items():
        info = file.tensors.get(name)
        if info is None:
            if spec.optional:
                continue
            raise LayoutError(f"tensor {name} is missing from {file.path} (expected {spec.describe()})")
        if info.shape != spec.shape:
            raise LayoutError(f"tensor {name} has shape {list(info.shape)}, expected {list(spec.shape)} "
                              f"(ggml ne order)")
        if info.ggml_type not in spec.types:
            raise LayoutError(f"tensor {name} has type {info.type_name}, expected "
                              f"{' or '.join(t.name for t in spec.types)}")
    for name in file.tensors:
        if name.startswith(prefix) and name not in layout:
            raise LayoutError(f"unexpected tensor {name} in {file.path}: {_why_unexpected(name, layout)}")


def _why_unexpected(name: str, layout: dict[str, TensorSpec]) -> str:
    """Say why a tensor does not belong, when the name is one the layout knows for other layers."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[1].isdigit():
        if parts[0] == "mtp":
            return "the MTP block has no such tensor"
        if not any(n.startswith(f"blk.{parts[1]}.") for n in layout):
            return f"there is no layer {parts[1]}"
        if parts[2] == "ffn_gate_tid2eid.weight":
            return f"layer {parts[1]} is not a hash layer"
        if any(n.endswith("." + parts[2]) for n in layout):
            return f"layer {parts[1]} has no such tensor at its compression ratio"
    return "not part of the DeepSeek V4 Flash layout"


def _expert_types(file: GGUFFile, prefix: str) -> tuple[GGMLType, GGMLType]:
    gate = file.tensors[prefix + "ffn_gate_exps.weight"].ggml_type
    up = file.tensors[prefix + "ffn_up_exps.weight"].ggml_type
    if gate != up:
        raise LayoutError(f"tensor {prefix}ffn_up_exps.weight has type {up.name} but {prefix}ffn_gate_exps.weight "
                          f"has {gate.name}; routed gate and up must have the same type")
    return gate, file.tensors[prefix + "ffn_down_exps.weight"].ggml_type


def _expert_kind(expert_types: list[tuple[GGMLType, GGMLType]]) -> str:
    if all(t == Q2_EXPERTS for t in expert_types):
        return "q2"
    if all(t == Q4_EXPERTS for t in expert_types):
        return "q4"
    return "mixed"


def _variant(config: ModelConfig, expert_types: list[tuple[GGMLType, GGMLType]], metadata: dict) -> str:
    """"q2", "q4" or "mixed" (+ "-imatrix") for the published shape, else a short description of the test model."""
    kind = _expert_kind(expert_types)
    if config.is_published_shape:
        imatrix = any(key.startswith("quantize.imatrix.") for key in metadata)
        return kind + ("-imatrix" if imatrix else "")
    return (f"test model ({config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads, "
            f"{config.n_expert} experts, vocab {config.n_vocab}, {kind} experts)")


def _bytes_by_type(tensors: Iterable[TensorInfo]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for t in tensors:
        totals[t.type_name] = totals.get(t.type_name, 0) + t.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
