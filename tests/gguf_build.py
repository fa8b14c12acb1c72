"""Raw GGUF v3 writing for the reader/validator tests: full control over every byte, data left as a file hole.

The layout tests need files that are wrong in one precise way (a shape, a type, an offset), and a published-shape
file without 81 GB of data, so they write the container by hand instead of going through `gguf.GGUFWriter`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ds4_mlx.model.config import FLASH, ModelConfig
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType, ValueType
from ds4_mlx.model.weights import model_layout, mtp_layout

_FORMATS = {ValueType.U8: "<B", ValueType.I8: "<b", ValueType.U16: "<H", ValueType.I16: "<h", ValueType.U32: "<I",
            ValueType.I32: "<i", ValueType.F32: "<f", ValueType.BOOL: "<?", ValueType.U64: "<Q",
            ValueType.I64: "<q", ValueType.F64: "<d"}

U32, I32, F32, F64, U64, BOOL, STR = (ValueType.U32, ValueType.I32, ValueType.F32, ValueType.F64, ValueType.U64,
                                      ValueType.BOOL, ValueType.STRING)


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def encode_value(vtype: ValueType | tuple[ValueType, ValueType], value: Any) -> bytes:
    """A metadata value with its type tag; an array type is written as (ARRAY, element type)."""
    if isinstance(vtype, tuple):
        _, etype = vtype
        body = b"".join(encode_value(etype, v)[4:] for v in value)
        return struct.pack("<IIQ", ValueType.ARRAY, etype, len(value)) + body
    if vtype == ValueType.STRING:
        return struct.pack("<I", vtype) + _string(value)
    return struct.pack("<I", vtype) + struct.pack(_FORMATS[vtype], value)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int | None = None  # relative data offset; None = next aligned slot

    @property
    def nbytes(self) -> int:
        elements, size = BLOCK_SIZES[GGMLType(self.ggml_type)]
        n = self.shape[0] // elements * size
        for d in self.shape[1:]:
            n *= d
        return n


@dataclass
class Spec:
    """Everything that goes into a file; tests mutate it, then `write` it."""

    metadata: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (type, value)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32
    version: int = 3
    magic: bytes = b"GGUF"

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def drop(self, name: str) -> None:
        self.tensors = [t for t in self.tensors if t.name != name]


def header_bytes(spec: Spec) -> tuple[bytes, list[int]]:
    """Header, metadata and directory (padded to the alignment), and each tensor's relative offset."""
    out = [spec.magic, struct.pack("<IQQ", spec.version, len(spec.tensors), len(spec.metadata))]
    for key, (vtype, value) in spec.metadata.items():
        out.append(_string(key) + encode_value(vtype, value))
    offsets, pos = [], 0
    for t in spec.tensors:
        rel = pos if t.offset is None else t.offset
        offsets.append(rel)
        pos = -(-(rel + t.nbytes) // spec.alignment) * spec.alignment
        out.append(_string(t.name) + struct.pack("<I", len(t.shape)) + struct.pack(f"<{len(t.shape)}Q", *t.shape)
                   + struct.pack("<IQ", t.ggml_type, rel))
    head = b"".join(out)
    head += b"\0" * (-len(head) % spec.alignment)
    return head, offsets


def write(spec: Spec, path: Path, tensor_data: dict[str, bytes] | None = None) -> Path:
    """Write `spec`; tensor data is zero (a sparse hole) unless given in `tensor_data`."""
    head, offsets = header_bytes(spec)
    end = max((rel + t.nbytes for t, rel in zip(spec.tensors, offsets)), default=0)
    with open(path, "wb") as f:
        f.write(head)
        for t, rel in zip(spec.tensors, offsets):
            if tensor_data and t.name in tensor_data:
                f.seek(len(head) + rel)
                f.write(tensor_data[t.name])
        f.truncate(len(head) + end)
    return path


TINY = replace(
    FLASH, n_layer=6, n_embd=256, n_vocab=512, n_head=4, head_dim=128, n_rot=64, q_lora_rank=64, o_lora_rank=32,
    o_groups=2, n_expert=8, n_expert_used=2, n_ff_exp=256, n_hash_layer=3, sliding_window=16, indexer_n_head=16,
    indexer_head_dim=128, indexer_top_k=8, swiglu_clamp=(10.0,) * 6, compress_ratios=(0, 0, 4, 128, 4, 128),
    context_length=4096,
)
"""A tiny model with the published structure (the factory's `tiny` dims)."""


def metadata_for(c: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """Every metadata key ds4.c reads, with the published GGUF types, plus the keys the published file only carries."""
    a = "deepseek4."
    md: dict[str, tuple[Any, Any]] = {
        "general.architecture": (STR, "deepseek4"),
        "general.name": (STR, "DeepSeek V4 Flash" if c.n_layer == 43 else "tiny"),
        a + "block_count": (U32, c.n_layer),
        a + "context_length": (U64, c.context_length or 1048576),
        a + "embedding_length": (U32, c.n_embd),
        a + "vocab_size": (U32, c.n_vocab),
        a + "attention.head_count": (U32, c.n_head),
        a + "attention.head_count_kv": (U32, c.n_head_kv),
        a + "attention.key_length": (U32, c.head_dim),
        a + "attention.value_length": (U32, c.head_dim),
        a + "rope.dimension_count": (U32, c.n_rot),
        a + "attention.q_lora_rank": (U32, c.q_lora_rank),
        a + "attention.output_lora_rank": (U32, c.o_lora_rank),
        a + "attention.output_group_count": (U32, c.o_groups),
        a + "expert_count": (U32, c.n_expert),
        a + "expert_used_count": (U32, c.n_expert_used),
        a + "expert_feed_forward_length": (U32, c.n_ff_exp),
        a + "expert_shared_count": (U32, c.n_expert_shared),
        a + "hash_layer_count": (U32, c.n_hash_layer),
        a + "attention.sliding_window": (U32, c.sliding_window),
        a + "attention.indexer.head_count": (U32, c.indexer_n_head),
        a + "attention.indexer.key_length": (U32, c.indexer_head_dim),
        a + "attention.indexer.top_k": (U32, c.indexer_top_k),
        a + "hyper_connection.count": (U32, c.n_hc),
        a + "hyper_connection.sinkhorn_iterations": (U32, c.sinkhorn_iters),
        a + "attention.compress_ratios": ((ValueType.ARRAY, U32), list(c.compress_ratios) + [0]),
        a + "swiglu_clamp_exp": ((ValueType.ARRAY, F32), list(c.swiglu_clamp) + [10.0]),
        a + "rope.scaling.original_context_length": (U32, c.rope_orig_ctx),
        a + "rope.freq_base": (F32, c.rope_freq_base),
        a + "rope.scaling.factor": (F32, c.rope_scaling_factor),
        a + "rope.scaling.yarn_beta_fast": (F32, c.yarn_beta_fast),
        a + "rope.scaling.yarn_beta_slow": (F32, c.yarn_beta_slow),
        a + "attention.compress_rope_freq_base": (F32, c.compress_rope_freq_base),
        a + "expert_weights_scale": (F32, c.expert_weights_scale),
        a + "attention.layer_norm_rms_epsilon": (F32, c.rms_eps),
        a + "hyper_connection.epsilon": (F32, c.hc_eps),
        a + "expert_weights_norm": (BOOL, c.expert_weights_norm),
        a + "rope.scaling.type": (STR, "yarn"),
        a + "expert_gating_func": (U32, 4),
        a + "nextn_predict_layers": (U32, 1),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.pre": (STR, "joyai-llm"),
        "tokenizer.ggml.tokens": ((ValueType.ARRAY, STR), ["<bos>", "<eos>", "a", "b", "ab"]
                                  + [f"<t{i}>" for i in range(5, c.n_vocab)]),
        "tokenizer.ggml.merges": ((ValueType.ARRAY, STR), ["a b"]),
    }
    return md


EXPERTS = {
    "q2": (GGMLType.IQ2_XXS, GGMLType.Q2_K),
    "q4": (GGMLType.Q4_K, GGMLType.Q4_K),
}


def model_spec(c: ModelConfig = TINY, experts: str | list[str] = "q2", router_bias_from: int = 3) -> Spec:
    """A complete valid layout: published types, per-layer expert types, router bias on layers >= 3."""
    per_layer = [experts] * c.n_layer if isinstance(experts, str) else experts
    tensors = []
    for name, spec in model_layout(c).items():
        if name.endswith("exp_probs_b.bias") and int(name.split(".")[1]) < router_bias_from:
            continue
        ggml_type = spec.types[0]
        if "_exps." in name:
            gate_up, down = EXPERTS[per_layer[int(name.split(".")[1])]]
            ggml_type = down if "ffn_down_exps" in name else gate_up
        tensors.append(Tensor(name, spec.shape, ggml_type))
    return Spec(metadata=metadata_for(c), tensors=tensors)


def mtp_spec(c: ModelConfig = TINY, hc_type: GGMLType = GGMLType.F32) -> Spec:
    """An MTP file for a model of config `c`, with F32 (or `hc_type`) HC and router projections."""
    tensors = []
    for name, spec in mtp_layout(c).items():
        ggml_type = hc_type if len(spec.types) == 2 else spec.types[0]
        if "_exps." in name:
            ggml_type = GGMLType.Q4_K
        tensors.append(Tensor(name, spec.shape, ggml_type))
    return Spec(metadata={"general.architecture": (STR, "deepseek4")}, tensors=tensors)
