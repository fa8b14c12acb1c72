"""DeepSeek V4 Flash hyperparameters, read from GGUF metadata and checked the way ds4 checks them.

Every value comes from the file, as in ds4.c, so a tiny model with the same structure loads the same way as the
published 43-layer one. The keys fall into three groups:

* **Dimensions** scale freely (layer count, widths, heads, experts, vocabulary, window, indexer top-k, HC streams,
  Sinkhorn iterations). They only have to be consistent: positive, `n_head` divisible by `o_groups`, `n_rot` even
  and within a head, expert counts in range, and the extra constraints the activation simulation puts
  on them (FP8 blocks of 64 over the non-RoPE dims, a power-of-two Hadamard over indexer heads).
* **Structure** is fixed: one shared K=V head (`head_count_kv` 1, key length == value length), one shared expert,
  no expert groups, and the compression schedule (layers 0,1 raw; even layers ≥ 2 ratio 4; odd ≥ 3 ratio 128).
* **Numeric constants** must equal the published values even in a test model: the epsilons (1e-6), the routed
  scale 1.5, the SwiGLU clamp 10 on every layer, the RoPE bases 10000 / 160000, YaRN (factor 16, original context
  65536, betas 32 / 1) and `expert_weights_norm = true`. ds4 rejects any other value, and the forward pass has only
  been checked against the reference with these; a file that changes them is not this model. Floats match when
  |got - expected| <= 1e-6 * max(1, |expected|), as in ds4. The value stored is the one read from the file.

Metadata types are checked when the caller passes the GGUF type names (`GGUFFile.metadata_types`); a plain dict of
Python values is checked by kind instead (int, float, bool, list).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError

ARCH = "deepseek4"

_U32 = ("u32",)
_FLOAT = ("f32", "f64", "u32", "i32")

# (field, key suffix after "deepseek4.") for the u32 dimensions.
_DIM_KEYS: tuple[tuple[str, str], ...] = (
    ("n_layer", "block_count"),
    ("n_embd", "embedding_length"),
    ("n_vocab", "vocab_size"),
    ("n_head", "attention.head_count"),
    ("n_head_kv", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("n_rot", "rope.dimension_count"),
    ("q_lora_rank", "attention.q_lora_rank"),
    ("o_lora_rank", "attention.output_lora_rank"),
    ("o_groups", "attention.output_group_count"),
    ("n_expert", "expert_count"),
    ("n_expert_used", "expert_used_count"),
    ("n_ff_exp", "expert_feed_forward_length"),
    ("n_expert_shared", "expert_shared_count"),
    ("n_hash_layer", "hash_layer_count"),
    ("sliding_window", "attention.sliding_window"),
    ("indexer_n_head", "attention.indexer.head_count"),
    ("indexer_head_dim", "attention.indexer.key_length"),
    ("indexer_top_k", "attention.indexer.top_k"),
    ("n_hc", "hyper_connection.count"),
    ("sinkhorn_iters", "hyper_connection.sinkhorn_iterations"),
)

# (field, key suffix, published value) for the float constants ds4 fixes.
_FLOAT_CONSTANTS: tuple[tuple[str, str, float], ...] = (
    ("rms_eps", "attention.layer_norm_rms_epsilon", 1e-6),
    ("hc_eps", "hyper_connection.epsilon", 1e-6),
    ("expert_weights_scale", "expert_weights_scale", 1.5),
    ("rope_freq_base", "rope.freq_base", 10000.0),
    ("compress_rope_freq_base", "attention.compress_rope_freq_base", 160000.0),
    ("rope_scaling_factor", "rope.scaling.factor", 16.0),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", 32.0),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", 1.0),
)

SWIGLU_CLAMP = 10.0
ROPE_ORIG_CTX = 65536
FP8_BLOCK = 64  # FP8 KV simulation works on blocks of 64 non-RoPE dims
FP4_BLOCK = 32  # FP4 indexer simulation works on blocks of 32


def published_compress_ratio(layer: int) -> int:
    """The compression schedule: layers 0,1 keep only the raw window, then ratio 4 and 128 alternate."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


@dataclass(frozen=True)
class ModelConfig:
    """Every hyperparameter the forward pass needs, in the model's own terms (ds4.c names them)."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_hash_layer: int
    sliding_window: int
    indexer_n_head: int
    indexer_head_dim: int
    indexer_top_k: int
    n_hc: int
    sinkhorn_iters: int
    rms_eps: float
    hc_eps: float
    expert_weights_scale: float
    expert_weights_norm: bool
    swiglu_clamp: tuple[float, ...]
    compress_ratios: tuple[int, ...]
    rope_freq_base: float
    compress_rope_freq_base: float
    rope_scaling_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    rope_orig_ctx: int
    context_length: int | None = None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], types: Mapping[str, str] | None = None) -> ModelConfig:
        """Build and validate a config from GGUF metadata.

        `types` maps keys to GGUF type names ("u32", "f32", "array[u32]", ...), as `GGUFFile.metadata_types`
        gives them; without it the values are checked by Python kind.
        """
        reader = _Reader(md, types)
        arch = md.get("general.architecture")
        if arch is not None and arch != ARCH:
            raise LayoutError(f"general.architecture is {arch!r}, expected {ARCH!r} (DeepSeek V4 Flash)")
        fields: dict[str, Any] = {name: reader.uint(f"{ARCH}.{key}") for name, key in _DIM_KEYS}
        value_length = reader.uint(f"{ARCH}.attention.value_length")
        for name, key, expected in _FLOAT_CONSTANTS:
            fields[name] = reader.constant(f"{ARCH}.{key}", expected)
        fields["rope_orig_ctx"] = reader.uint(f"{ARCH}.rope.scaling.original_context_length", ("u64", "u32"))
        fields["expert_weights_norm"] = reader.boolean(f"{ARCH}.expert_weights_norm")
        n_layer = fields["n_layer"]
        fields["compress_ratios"] = reader.int_array(f"{ARCH}.attention.compress_ratios", n_layer)
        fields["swiglu_clamp"] = reader.float_array(f"{ARCH}.swiglu_clamp_exp", n_layer)
        fields["context_length"] = reader.optional_uint(f"{ARCH}.context_length", ("u64", "u32"))
        group_counts = {
            key: reader.optional_uint(f"{ARCH}.{key}", _U32) or 0
            for key in ("expert_group_count", "expert_group_used_count")
        }
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            reader.string_array(key)

        _expect_equal(f"{ARCH}.attention.value_length", value_length, fields["head_dim"],
                      "the key length (K and V are the same vector)")
        for key, count in group_counts.items():
            _expect_equal(f"{ARCH}.{key}", count, 0, "0 (DeepSeek V4 Flash has no expert groups)")
        if fields["rope_orig_ctx"] != ROPE_ORIG_CTX:
            raise LayoutError(f"{ARCH}.rope.scaling.original_context_length is {fields['rope_orig_ctx']}, "
                              f"expected {ROPE_ORIG_CTX}")
        if not fields["expert_weights_norm"]:
            raise LayoutError(f"{ARCH}.expert_weights_norm is false, expected true")
        for i, clamp in enumerate(fields["swiglu_clamp"]):
            if not _close(clamp, SWIGLU_CLAMP):
                raise LayoutError(f"{ARCH}.swiglu_clamp_exp[{i}] is {clamp!r}, expected {SWIGLU_CLAMP}")
        for i, ratio in enumerate(fields["compress_ratios"]):
            if ratio != published_compress_ratio(i):
                raise LayoutError(f"{ARCH}.attention.compress_ratios[{i}] is {ratio}, expected "
                                  f"{published_compress_ratio(i)} (layers 0,1: 0; even layers: 4; odd layers: 128)")
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        """Check that the dimensions fit together; raise LayoutError naming the first that does not."""
        for name, _ in _DIM_KEYS:
            if getattr(self, name) <= 0 and name != "n_hash_layer":
                raise LayoutError(f"{_key(name)} is {getattr(self, name)}, expected a positive value")
        _expect_equal(_key("n_head_kv"), self.n_head_kv, 1, "1 (one shared K=V head)")
        _expect_equal(_key("n_expert_shared"), self.n_expert_shared, 1, "1 (one shared expert)")
        if self.n_rot % 2 or self.n_rot > min(self.head_dim, self.indexer_head_dim):
            raise LayoutError(f"{_key('n_rot')} is {self.n_rot}, expected an even value no larger than the head "
                              f"widths {self.head_dim} and {self.indexer_head_dim}")
        if (self.head_dim - self.n_rot) % FP8_BLOCK:
            raise LayoutError(f"{_key('head_dim')} {self.head_dim} minus {_key('n_rot')} {self.n_rot} is not a "
                              f"multiple of {FP8_BLOCK} (the FP8 KV simulation block)")
        d = self.indexer_head_dim
        if d & (d - 1) or d % FP4_BLOCK:
            raise LayoutError(f"{_key('indexer_head_dim')} is {d}, expected a power of two and a multiple of "
                              f"{FP4_BLOCK} (Hadamard transform + FP4 blocks)")
        if self.n_head % self.o_groups:
            raise LayoutError(f"{_key('n_head')} {self.n_head} is not divisible by {_key('o_groups')} "
                              f"{self.o_groups}")
        if self.n_expert_used > self.n_expert:
            raise LayoutError(f"{_key('n_expert_used')} {self.n_expert_used} exceeds {_key('n_expert')} "
                              f"{self.n_expert}")
        if self.n_hash_layer > self.n_layer:
            raise LayoutError(f"{_key('n_hash_layer')} {self.n_hash_layer} exceeds {_key('n_layer')} "
                              f"{self.n_layer}")
        for field, n in (("compress_ratios", len(self.compress_ratios)), ("swiglu_clamp", len(self.swiglu_clamp))):
            if n != self.n_layer:
                raise LayoutError(f"{field} has {n} entries, expected one per layer ({self.n_layer})")

    def compress_ratio(self, layer: int) -> int:
        """0 for raw-window-only layers, else the number of tokens pooled into one compressed row."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        """Whether the layer routes tokens through the fixed `ffn_gate_tid2eid` table instead of the router."""
        return layer < self.n_hash_layer

    @property
    def hc_mix(self) -> int:
        """Width of one HC projection: n_hc pre weights, n_hc post weights and an n_hc x n_hc comb matrix."""
        return (2 + self.n_hc) * self.n_hc

    @property
    def is_published_shape(self) -> bool:
        """Whether every dimension equals DeepSeek V4 Flash's (the constants are equal once validated)."""
        return all(getattr(self, name) == getattr(FLASH, name) for name in SHAPE_FIELDS)


SHAPE_FIELDS: tuple[str, ...] = tuple(name for name, _ in _DIM_KEYS) + ("compress_ratios",)

FLASH = ModelConfig(
    n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, n_head_kv=1, head_dim=512, n_rot=64,
    q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6, n_ff_exp=2048,
    n_expert_shared=1, n_hash_layer=3, sliding_window=128, indexer_n_head=64, indexer_head_dim=128,
    indexer_top_k=512, n_hc=4, sinkhorn_iters=20, rms_eps=1e-6, hc_eps=1e-6, expert_weights_scale=1.5,
    expert_weights_norm=True, swiglu_clamp=(SWIGLU_CLAMP,) * 43,
    compress_ratios=tuple(published_compress_ratio(i) for i in range(43)), rope_freq_base=10000.0,
    compress_rope_freq_base=160000.0, rope_scaling_factor=16.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    rope_orig_ctx=ROPE_ORIG_CTX, context_length=1048576,
)
"""The published DeepSeek V4 Flash (ds4.c)."""


@dataclass(frozen=True)
class SessionMemory:
    """Bytes of live session state for one context size (ds4.c), all f32."""

    raw: int
    compressed: int
    indexer: int
    frontiers: int
    logits: int

    @property
    def total(self) -> int:
        return self.raw + self.compressed + self.indexer + self.frontiers + self.logits


def memory_estimate(config: ModelConfig, ctx: int, raw_cap: int | None = None) -> SessionMemory:
    """Session-state bytes at context `ctx`: raw rings, compressed and indexer rows, compressor frontiers, logits.

    Compressed caches hold ctx/ratio + 2 rows; a frontier holds state_kv and state_score, each coff*ratio rows of
    coff*width floats (coff = 2 for ratio 4, else 1). The raw ring holds `raw_cap` rows per layer, by default the
    sliding window (what our session cache keeps; ds4's GPU ring adds a prefill chunk: 2304 rows for Flash).
    """
    if ctx <= 0:
        raise ValueError(f"context size must be positive, got {ctx}")
    f32 = 4
    rows = config.sliding_window if raw_cap is None else raw_cap
    raw = compressed = indexer = frontiers = 0
    for layer in range(config.n_layer):
        raw += rows * config.head_dim * f32
        ratio = config.compress_ratio(layer)
        if ratio == 0:
            continue
        coff = 2 if ratio == 4 else 1
        compressed += (ctx // ratio + 2) * config.head_dim * f32
        frontiers += 2 * coff * ratio * coff * config.head_dim * f32
        if ratio == 4:
            indexer += (ctx // 4 + 2) * config.indexer_head_dim * f32
            frontiers += 2 * coff * ratio * coff * config.indexer_head_dim * f32
    return SessionMemory(raw=raw, compressed=compressed, indexer=indexer, frontiers=frontiers,
                         logits=config.n_vocab * f32)


def _key(field: str) -> str:
    """The metadata key a dimension field comes from, for messages."""
    for name, key in _DIM_KEYS:
        if name == field:
            return f"{ARCH}.{key}"
    return field


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= 1e-6 * max(1.0, abs(expected))


def _expect_equal(key: str, got: Any, expected: Any, what: str) -> None:
    if got != expected:
        raise LayoutError(f"{key} is {got}, expected {what}")


class _Reader:
    """Typed access to metadata that turns every missing or mistyped key into a LayoutError naming it."""

    def __init__(self, md: Mapping[str, Any], types: Mapping[str, str] | None) -> None:
        self.md = md
        self.types = types

    def _get(self, key: str, accepted: tuple[str, ...], kind: str) -> Any:
        if key not in self.md:
            raise LayoutError(f"metadata key {key} is missing (expected {kind})")
        value = self.md[key]
        if self.types is not None:
            got = self.types.get(key, "?")
            if got not in accepted:
                raise LayoutError(f"metadata key {key} has type {got}, expected {' or '.join(accepted)}")
        return value

    def uint(self, key: str, accepted: tuple[str, ...] = _U32) -> int:
        value = self._get(key, accepted, "an unsigned integer")
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise LayoutError(f"metadata key {key} is {value!r}, expected an unsigned integer")
        return int(value)

    def optional_uint(self, key: str, accepted: tuple[str, ...]) -> int | None:
        return self.uint(key, accepted) if key in self.md else None

    def constant(self, key: str, expected: float) -> float:
        value = self._get(key, _FLOAT, "a number")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise LayoutError(f"metadata key {key} is {value!r}, expected a number")
        if not _close(float(value), expected):
            raise LayoutError(f"metadata key {key} is {value!r}, expected {expected} (fixed by DeepSeek V4 Flash)")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self._get(key, ("bool",), "a bool")
        if not isinstance(value, bool):
            raise LayoutError(f"metadata key {key} is {value!r}, expected a bool")
        return value

    def _array(self, key: str, accepted: tuple[str, ...], kind: str, n_layer: int) -> list[Any]:
        values = list(self._get(key, tuple(f"array[{t}]" for t in accepted), f"an array of {kind}"))
        if len(values) < n_layer:
            raise LayoutError(f"metadata key {key} has {len(values)} entries, expected at least {n_layer} "
                              f"(one per layer)")
        return values[:n_layer]

    def int_array(self, key: str, n_layer: int) -> tuple[int, ...]:
        values = self._array(key, ("u32", "i32"), "integers", n_layer)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
            raise LayoutError(f"metadata key {key} holds non-integers, expected an array of u32 or i32")
        return tuple(int(v) for v in values)

    def float_array(self, key: str, n_layer: int) -> tuple[float, ...]:
        values = self._array(key, ("f32", "f64"), "floats", n_layer)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
            raise LayoutError(f"metadata key {key} holds non-numbers, expected an array of f32 or f64")
        return tuple(float(v) for v in values)

    def string_array(self, key: str) -> list[str]:
        values = self._get(key, ("array[string]",), "an array of strings")
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise LayoutError(f"metadata key {key} is not an array of strings")
        return values
