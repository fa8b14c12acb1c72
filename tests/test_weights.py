"""Config from metadata and the DeepSeek V4 Flash layout validator: valid files of any size pass with the right
variant; each kind of wrong key or tensor is a LayoutError naming it."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from ds4_mlx.errors import GGUFError, LayoutError
from ds4_mlx.model.config import FLASH, ModelConfig, memory_estimate
from ds4_mlx.model.gguf import GGMLType, GGUFFile
from ds4_mlx.model.weights import model_layout, open_mtp_weights, open_weights

from gguf_build import (BOOL, F32, F64, I32, STR, TINY, U32, U64, Spec, Tensor, ValueType, metadata_for, model_spec,
                        mtp_spec, write)

A = "deepseek4."
REQUIRED_KEYS = [key for key in metadata_for(TINY) if key.startswith(A) or key.startswith("tokenizer.ggml.t")
                 or key == "tokenizer.ggml.merges"]
OPTIONAL_KEYS = {A + "context_length", A + "rope.scaling.type", A + "expert_gating_func", A + "nextn_predict_layers"}


def _config(tmp_path, metadata) -> ModelConfig:
    """Write metadata alone into a GGUF, read it back and build the config (so GGUF types are checked)."""
    path = write(Spec(metadata=metadata), tmp_path / "md.gguf")
    with GGUFFile.open(path) as f:
        return ModelConfig.from_metadata(f.metadata, f.metadata_types)


# ---- config ----------------------------------------------------------------------------------------------------


def test_config_reads_every_field_from_metadata(tmp_path):
    config = _config(tmp_path, metadata_for(TINY))
    for name in ("n_layer", "n_embd", "n_vocab", "n_head", "head_dim", "n_rot", "q_lora_rank", "o_lora_rank",
                 "o_groups", "n_expert", "n_expert_used", "n_ff_exp", "n_hash_layer", "sliding_window",
                 "indexer_n_head", "indexer_head_dim", "indexer_top_k", "n_hc", "sinkhorn_iters",
                 "compress_ratios", "rope_orig_ctx", "context_length", "expert_weights_norm"):
        assert getattr(config, name) == getattr(TINY, name), name
    # f32 metadata: stored as read, equal to the published constants within f32 rounding (rel 6e-8)
    for name in ("rms_eps", "hc_eps", "expert_weights_scale", "rope_freq_base", "compress_rope_freq_base",
                 "rope_scaling_factor", "yarn_beta_fast", "yarn_beta_slow"):
        assert getattr(config, name) == pytest.approx(getattr(FLASH, name), rel=1e-7), name
    assert config.rms_eps == float(np.float32(1e-6))
    assert config.swiglu_clamp == (10.0,) * 6 and len(config.compress_ratios) == 6  # 7 stored, first n_layer kept
    assert [config.compress_ratio(i) for i in range(6)] == [0, 0, 4, 128, 4, 128]
    assert [config.is_hash_layer(i) for i in range(6)] == [True, True, True, False, False, False]
    assert config.hc_mix == 24
    assert not config.is_published_shape


def test_flash_constant_matches_spec_table():
    assert FLASH.is_published_shape
    assert FLASH.compress_ratios[:5] == (0, 0, 4, 128, 4) and FLASH.compress_ratios[-1] == 4
    assert FLASH.compress_ratios.count(4) == 21 and FLASH.compress_ratios.count(128) == 20
    assert (FLASH.n_layer, FLASH.n_embd, FLASH.n_vocab, FLASH.n_head, FLASH.head_dim, FLASH.indexer_top_k) == (
        43, 4096, 129280, 64, 512, 512)


def test_other_dims_are_free(tmp_path):
    """A model with different dimensions but the same structure loads: nothing is taken from constants."""
    other = replace(TINY, n_layer=9, n_embd=512, n_vocab=1000, n_head=8, head_dim=192, n_rot=64, o_groups=4,
                    n_expert=16, n_expert_used=4, n_hash_layer=0, sliding_window=32, indexer_n_head=4,
                    indexer_head_dim=64, indexer_top_k=3, n_hc=2, sinkhorn_iters=5, swiglu_clamp=(10.0,) * 9,
                    compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128, 4), context_length=None)
    config = _config(tmp_path, metadata_for(other))
    assert replace(config, **{n: getattr(other, n) for n in ("rms_eps", "hc_eps")}, context_length=None) == other


def test_plain_dict_metadata_is_checked_by_kind():
    md = {key: value for key, (_, value) in metadata_for(TINY).items()}
    assert ModelConfig.from_metadata(md).n_embd == 256
    with pytest.raises(LayoutError, match=f"{A}block_count is True, expected an unsigned integer"):
        ModelConfig.from_metadata(md | {A + "block_count": True})
    with pytest.raises(LayoutError, match=f"{A}expert_weights_scale is '1.5', expected a number"):
        ModelConfig.from_metadata(md | {A + "expert_weights_scale": "1.5"})


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_required_key(tmp_path, key):
    md = metadata_for(TINY)
    del md[key]
    if key in OPTIONAL_KEYS:
        _config(tmp_path, md)
    else:
        with pytest.raises(LayoutError, match=f"metadata key {key} is missing"):
            _config(tmp_path, md)


@pytest.mark.parametrize(("key", "vtype", "value", "message"), [
    (A + "block_count", I32, 6, "has type i32, expected u32"),
    (A + "embedding_length", U64, 256, "has type u64, expected u32"),
    (A + "expert_weights_scale", STR, "1.5", "has type string, expected f32 or f64 or u32 or i32"),
    (A + "expert_weights_norm", U32, 1, "has type u32, expected bool"),
    (A + "attention.compress_ratios", (ValueType.ARRAY, F32), [0.0] * 7, "has type array[f32], expected array[u32] or array[i32]"),
    (A + "swiglu_clamp_exp", (ValueType.ARRAY, U32), [10] * 7, "has type array[u32], expected array[f32] or array[f64]"),
    (A + "rope.scaling.original_context_length", F32, 65536.0, "has type f32, expected u64 or u32"),
    ("tokenizer.ggml.tokens", STR, "abc", "has type string, expected array[string]"),
])
def test_mistyped_key(tmp_path, key, vtype, value, message):
    md = metadata_for(TINY)
    md[key] = (vtype, value)
    with pytest.raises(LayoutError, match=re.escape(f"metadata key {key} {message}")):
        _config(tmp_path, md)


@pytest.mark.parametrize(("key", "vtype", "value"), [
    (A + "expert_weights_scale", F64, 1.5 + 1.4e-6),  # tolerance 1e-6 * 1.5
    (A + "rope.freq_base", U32, 10000),
    (A + "attention.compress_rope_freq_base", I32, 160000),
    (A + "hyper_connection.epsilon", F64, 1e-6 + 9e-13),
    (A + "rope.scaling.original_context_length", U64, 65536),
    (A + "attention.compress_ratios", (ValueType.ARRAY, I32), [0, 0, 4, 128, 4, 128]),
    (A + "swiglu_clamp_exp", (ValueType.ARRAY, F64), [10.0] * 6),
])
def test_accepted_alternatives(tmp_path, key, vtype, value):
    md = metadata_for(TINY)
    md[key] = (vtype, value)
    _config(tmp_path, md)


@pytest.mark.parametrize(("key", "vtype", "value", "message"), [
    (A + "expert_weights_scale", F64, 1.5 + 2e-6, "expected 1.5"),
    (A + "expert_weights_scale", F32, 1.0, "expected 1.5"),
    (A + "hyper_connection.epsilon", F32, 1e-5, "expected 1e-06"),
    (A + "attention.layer_norm_rms_epsilon", F32, 1e-5, "expected 1e-06"),
    (A + "rope.freq_base", F32, 50000.0, "expected 10000.0"),
    (A + "attention.compress_rope_freq_base", F32, 10000.0, "expected 160000.0"),
    (A + "rope.scaling.factor", F32, 4.0, "expected 16.0"),
    (A + "rope.scaling.yarn_beta_fast", F32, 31.0, "expected 32.0"),
    (A + "rope.scaling.yarn_beta_slow", F32, 2.0, "expected 1.0"),
    (A + "rope.scaling.original_context_length", U32, 4096, "expected 65536"),
    (A + "expert_weights_norm", BOOL, False, "false, expected true"),
    (A + "swiglu_clamp_exp", (ValueType.ARRAY, F32), [10.0, 10.0, 10.0, 7.0, 10.0, 10.0], r"\[3\] is 7.0"),
    (A + "swiglu_clamp_exp", (ValueType.ARRAY, F32), [10.0] * 5, "has 5 entries, expected at least 6"),
    (A + "attention.compress_ratios", (ValueType.ARRAY, U32), [0, 0, 4, 4, 4, 128], r"\[3\] is 4, expected 128"),
    (A + "attention.compress_ratios", (ValueType.ARRAY, U32), [0, 4, 4, 128, 4, 128], r"\[1\] is 4, expected 0"),
    (A + "attention.compress_ratios", (ValueType.ARRAY, U32), [0, 0, 4], "has 3 entries, expected at least 6"),
    (A + "attention.head_count_kv", U32, 2, "is 2, expected 1"),
    (A + "expert_shared_count", U32, 2, "is 2, expected 1"),
    (A + "attention.value_length", U32, 64, "is 64, expected the key length"),
    (A + "expert_group_count", U32, 8, "is 8, expected 0"),
    (A + "attention.output_group_count", U32, 3, "head_count 4 is not divisible by .*output_group_count 3"),
    (A + "rope.dimension_count", U32, 63, "is 63, expected an even value"),
    (A + "rope.dimension_count", U32, 256, "is 256, expected an even value no larger than"),
    (A + "rope.dimension_count", U32, 32, "key_length 128 minus .*dimension_count 32 is not a multiple of 64"),
    (A + "attention.indexer.key_length", U32, 96, "is 96, expected a power of two"),
    (A + "expert_used_count", U32, 9, "expert_used_count 9 exceeds .*expert_count 8"),
    (A + "hash_layer_count", U32, 7, "hash_layer_count 7 exceeds .*block_count 6"),
    (A + "embedding_length", U32, 0, "is 0, expected a positive value"),
    ("general.architecture", STR, "llama", "general.architecture is 'llama', expected 'deepseek4'"),
])
def test_wrong_values(tmp_path, key, vtype, value, message):
    md = metadata_for(TINY)
    md[key] = (vtype, value)
    with pytest.raises(LayoutError, match=message):
        _config(tmp_path, md)


def test_memory_estimate_flash_matches_spec_5_1():
    ctx = 32768
    m = memory_estimate(FLASH, ctx)
    assert m.raw == 43 * 128 * 512 * 4  # one sliding window of rows per layer
    assert m.compressed == 21 * (ctx // 4 + 2) * 512 * 4 + 20 * (ctx // 128 + 2) * 512 * 4
    assert m.indexer == 21 * (ctx // 4 + 2) * 128 * 4
    assert m.frontiers == 21 * (2 * 32768 + 2 * 8192) + 20 * 2 * 262144
    assert m.logits == 129280 * 4
    assert m.total == m.raw + m.compressed + m.indexer + m.frontiers + m.logits
    growth = memory_estimate(FLASH, 2**20).total - memory_estimate(FLASH, 2**19).total
    assert growth / 2**19 == 21 * 640 + 20 * 16  # ≈ 13.8 KB per token
    assert memory_estimate(FLASH, ctx, raw_cap=2304).raw == 43 * 2304 * 512 * 4  # ds4's GPU ring (window + chunk)
    with pytest.raises(ValueError, match="positive"):
        memory_estimate(FLASH, 0)


# ---- layout ----------------------------------------------------------------------------------------------------


def test_flash_inventory_is_the_published_one():
    layout = model_layout(FLASH)
    n_compressed, n_ratio4 = 41, 21
    required = [name for name, spec in layout.items() if not spec.optional]
    optional = [name for name, spec in layout.items() if spec.optional]
    # the tensor count: 6 global + 23 per layer + compressor + indexer + 3 tid2eid (+ 40 exp_probs_b = 1328)
    assert len(required) == 6 + 23 * 43 + 4 * n_compressed + 6 * n_ratio4 + 3
    assert optional == [f"blk.{i}.exp_probs_b.bias" for i in range(43)]
    expected = {  # ds4.c, ne order
        "token_embd.weight": (GGMLType.F16, (4096, 129280)),
        "output_hc_fn.weight": (GGMLType.F16, (16384, 4)),
        "blk.0.hc_attn_fn.weight": (GGMLType.F16, (16384, 24)),
        "blk.7.attn_q_b.weight": (GGMLType.Q8_0, (1024, 32768)),
        "blk.7.attn_output_a.weight": (GGMLType.Q8_0, (4096, 8192)),
        "blk.7.attn_output_b.weight": (GGMLType.Q8_0, (8192, 4096)),
        "blk.1.ffn_gate_tid2eid.weight": (GGMLType.I32, (6, 129280)),
        "blk.42.ffn_down_exps.weight": (GGMLType.Q2_K, (2048, 4096, 256)),
        "blk.2.attn_compressor_ape.weight": (GGMLType.F16, (1024, 4)),
        "blk.3.attn_compressor_ape.weight": (GGMLType.F16, (512, 128)),
        "blk.3.attn_compressor_kv.weight": (GGMLType.F16, (4096, 512)),
        "blk.4.indexer.attn_q_b.weight": (GGMLType.F16, (1024, 8192)),
        "blk.4.indexer.proj.weight": (GGMLType.F16, (4096, 64)),
        "blk.4.indexer_compressor_ape.weight": (GGMLType.F16, (256, 4)),
        "blk.4.indexer_compressor_norm.weight": (GGMLType.F32, (128,)),
    }
    for name, (ggml_type, shape) in expected.items():
        assert layout[name].shape == shape and ggml_type in layout[name].types, name
    assert "blk.3.ffn_gate_tid2eid.weight" not in layout and "blk.3.indexer.proj.weight" not in layout
    assert "blk.1.attn_compressor_kv.weight" not in layout


@pytest.mark.parametrize(("experts", "variant"), [("q2", "q2"), ("q4", "q4"),
                                                   (["q2"] * 37 + ["q4"] * 6, "mixed")])
def test_published_shape_header_reports_variant(tmp_path, experts, variant):
    """The full 1328-tensor directory with the data left as a file hole (81 GB apparent, a few KB on disk)."""
    path = write(model_spec(FLASH, experts), tmp_path / "flash.gguf")
    with open_weights(path) as w:
        assert w.variant == variant and w.config.is_published_shape
        assert len(w.file.tensors) == 1328
        if variant == "q2":
            assert w.nbytes / 2**30 == pytest.approx(80.76, abs=0.005)  # the published q2 file: 80.76 GiB
            assert set(w.bytes_by_type()) == {"IQ2_XXS", "Q2_K", "Q8_0", "F16", "F32", "I32"}
        if variant == "mixed":
            assert w.expert_types[36] == (GGMLType.IQ2_XXS, GGMLType.Q2_K)
            assert w.expert_types[37] == (GGMLType.Q4_K, GGMLType.Q4_K)


def test_imatrix_keys_mark_the_variant(tmp_path):
    spec = model_spec(FLASH, "q4")
    spec.metadata["quantize.imatrix.file"] = (STR, "imatrix.dat")
    spec.metadata["quantize.imatrix.entries_count"] = (I32, 2000)
    with open_weights(write(spec, tmp_path / "flash.gguf")) as w:
        assert w.variant == "q4-imatrix"


def test_tiny_model_validates_and_reads(tmp_path):
    spec = model_spec(TINY, ["q2", "q2", "q4", "q4", "q2", "q4"], router_bias_from=6)  # no router bias at all
    norm = np.linspace(0.5, 1.5, 256, dtype=np.float32)
    with open_weights(write(spec, tmp_path / "tiny.gguf", {"blk.2.attn_norm.weight": norm.tobytes()})) as w:
        assert w.variant == "test model (6 layers, n_embd 256, 4 heads, 8 experts, vocab 512, mixed experts)"
        assert w.expert_types[2] == (GGMLType.Q4_K, GGMLType.Q4_K)
        assert w.has("blk.0.ffn_gate_tid2eid.weight") and not w.has("blk.3.exp_probs_b.bias")
        assert w.info("blk.5.ffn_down_exps.weight").shape == (256, 256, 8)
        np.testing.assert_array_equal(w.tensor_bytes("blk.2.attn_norm.weight").view(np.float32), norm)
        np.testing.assert_array_equal(np.asarray(w.array("blk.2.attn_norm.weight")), norm)
        assert w.array("blk.3.attn_q_a.weight").shape == (64, 256)  # ne [256, 64] -> (OUT, IN)
        assert sum(w.bytes_by_type().values()) == w.nbytes
        with pytest.raises(LayoutError, match="tensor blk.9.attn_norm.weight is not in"):
            w.info("blk.9.attn_norm.weight")


def _broken(tmp_path, mutate) -> Spec:
    spec = model_spec()
    mutate(spec)
    return write(spec, tmp_path / "broken.gguf")


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda s: s.drop("blk.4.attn_q_a.weight"),
     r"tensor blk.4.attn_q_a.weight is missing from .* \(expected Q8_0 \[256, 64\]\)"),
    (lambda s: s.drop("output.weight"), "tensor output.weight is missing"),
    (lambda s: s.drop("blk.2.indexer.proj.weight"), "tensor blk.2.indexer.proj.weight is missing"),
    (lambda s: s.drop("blk.3.attn_compressor_norm.weight"), "tensor blk.3.attn_compressor_norm.weight is missing"),
    (lambda s: s.drop("blk.1.ffn_gate_tid2eid.weight"), "tensor blk.1.ffn_gate_tid2eid.weight is missing"),
    (lambda s: setattr(s.tensor("blk.2.attn_kv.weight"), "shape", (256, 64)),
     r"tensor blk.2.attn_kv.weight has shape \[256, 64\], expected \[256, 128\] \(ggml ne order\)"),
    (lambda s: setattr(s.tensor("token_embd.weight"), "shape", (512, 256)),
     r"token_embd.weight has shape \[512, 256\], expected \[256, 512\]"),
    (lambda s: setattr(s.tensor("blk.3.attn_compressor_ape.weight"), "shape", (256, 4)),
     r"blk.3.attn_compressor_ape.weight has shape \[256, 4\], expected \[128, 128\]"),
    (lambda s: setattr(s.tensor("blk.0.ffn_gate_tid2eid.weight"), "shape", (8, 512)),
     r"has shape \[8, 512\], expected \[2, 512\]"),
    (lambda s: setattr(s.tensor("blk.0.hc_attn_fn.weight"), "ggml_type", GGMLType.F32),
     "tensor blk.0.hc_attn_fn.weight has type F32, expected F16"),
    (lambda s: setattr(s.tensor("blk.5.attn_q_b.weight"), "ggml_type", GGMLType.F16),
     "tensor blk.5.attn_q_b.weight has type F16, expected Q8_0"),
    (lambda s: setattr(s.tensor("blk.5.attn_norm.weight"), "ggml_type", GGMLType.F16),
     "blk.5.attn_norm.weight has type F16, expected F32"),
    (lambda s: setattr(s.tensor("blk.4.ffn_down_exps.weight"), "ggml_type", GGMLType.Q8_0),
     "blk.4.ffn_down_exps.weight has type Q8_0, expected IQ2_XXS or Q2_K or Q4_K"),
    (lambda s: setattr(s.tensor("blk.4.ffn_up_exps.weight"), "ggml_type", GGMLType.Q4_K),
     "blk.4.ffn_up_exps.weight has type Q4_K but blk.4.ffn_gate_exps.weight has IQ2_XXS; routed gate and up must"),
    (lambda s: s.tensors.append(Tensor("blk.3.ffn_gate_tid2eid.weight", (2, 512), GGMLType.I32)),
     "unexpected tensor blk.3.ffn_gate_tid2eid.weight .*: layer 3 is not a hash layer"),
    (lambda s: s.tensors.append(Tensor("blk.1.attn_compressor_norm.weight", (128,), GGMLType.F32)),
     "unexpected tensor blk.1.attn_compressor_norm.weight .*: layer 1 has no such tensor at its compression ratio"),
    (lambda s: s.tensors.append(Tensor("blk.3.indexer.proj.weight", (256, 16), GGMLType.F16)),
     "unexpected tensor blk.3.indexer.proj.weight .*: layer 3 has no such tensor"),
    (lambda s: s.tensors.append(Tensor("blk.6.attn_norm.weight", (256,), GGMLType.F32)),
     "unexpected tensor blk.6.attn_norm.weight .*: there is no layer 6"),
    (lambda s: s.tensors.append(Tensor("blk.0.attn_bias.weight", (256,), GGMLType.F32)),
     "unexpected tensor blk.0.attn_bias.weight .*: not part of the DeepSeek V4 Flash layout"),
])
def test_layout_errors(tmp_path, mutate, message):
    with pytest.raises(LayoutError, match=message):
        open_weights(_broken(tmp_path, mutate))


def test_metadata_error_through_open_weights(tmp_path):
    path = _broken(tmp_path, lambda s: s.metadata.__setitem__(A + "expert_weights_scale", (F32, 2.5)))
    with pytest.raises(LayoutError, match=f"metadata key {A}expert_weights_scale is 2.5, expected 1.5"):
        open_weights(path)


def test_data_past_end_of_file(tmp_path):
    spec = model_spec()
    path = write(spec, tmp_path / "tiny.gguf")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    last = re.escape(spec.tensors[-1].name)
    with pytest.raises(GGUFError, match=f"data of tensor '{last}' ends at byte {size}, past the end of the file "
                                        rf"\({size - 100} bytes\)"):
        open_weights(path)


def test_non_deepseek_tensors_outside_blk_are_ignored(tmp_path):
    with open_weights(_broken(tmp_path, lambda s: s.tensors.append(Tensor("rope_freqs.weight", (32,), 0)))) as w:
        assert w.has("rope_freqs.weight")


# ---- MTP -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hc_type", [GGMLType.F16, GGMLType.F32])
def test_mtp_validates_against_main_config(tmp_path, hc_type):
    with open_mtp_weights(write(mtp_spec(TINY, hc_type), tmp_path / "mtp.gguf"), TINY) as m:
        assert m.variant == "mtp q4" and len(m.file.tensors) == 32
        assert m.info("mtp.0.e_proj.weight").shape == (256, 256)
        assert m.info("mtp.0.hc_head_fn.weight").ggml_type == hc_type


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda s: s.drop("mtp.0.exp_probs_b.bias"), "tensor mtp.0.exp_probs_b.bias is missing"),
    (lambda s: s.drop("mtp.0.hnorm.weight"), "tensor mtp.0.hnorm.weight is missing"),
    (lambda s: setattr(s.tensor("mtp.0.ffn_gate_inp.weight"), "ggml_type", GGMLType.Q8_0),
     "mtp.0.ffn_gate_inp.weight has type Q8_0, expected F16 or F32"),
    (lambda s: setattr(s.tensor("mtp.0.attn_norm.weight"), "ggml_type", GGMLType.F16),
     "mtp.0.attn_norm.weight has type F16, expected F32"),
    (lambda s: setattr(s.tensor("mtp.0.h_proj.weight"), "shape", (256, 512)),
     r"mtp.0.h_proj.weight has shape \[256, 512\], expected \[256, 256\]"),
    (lambda s: s.tensors.append(Tensor("mtp.0.attn_compressor_kv.weight", (256, 128), GGMLType.F16)),
     "unexpected tensor mtp.0.attn_compressor_kv.weight .*: the MTP block has no such tensor"),
    (lambda s: s.tensors.append(Tensor("mtp.0.ffn_gate_tid2eid.weight", (2, 512), GGMLType.I32)),
     "unexpected tensor mtp.0.ffn_gate_tid2eid.weight"),
])
def test_mtp_layout_errors(tmp_path, mutate, message):
    spec = mtp_spec(TINY)
    mutate(spec)
    with pytest.raises(LayoutError, match=message):
        open_mtp_weights(write(spec, tmp_path / "mtp.gguf"), TINY)


def test_mtp_for_other_dims_is_rejected(tmp_path):
    path = write(mtp_spec(TINY), tmp_path / "mtp.gguf")
    with pytest.raises(LayoutError, match="expected"):
        open_mtp_weights(path, FLASH)


# ---- the factory's files (written independently from the published layout) ----------------------------------------


@pytest.mark.parametrize(("preset", "experts", "data", "variant"), [
    ("tiny", "q2", "random", "test model (6 layers, n_embd 256, 4 heads, 8 experts, vocab 512, q2 experts)"),
    ("tiny", "q4", "random", "test model (6 layers, n_embd 256, 4 heads, 8 experts, vocab 512, q4 experts)"),
    ("tiny", "mixed", "random", "test model (6 layers, n_embd 256, 4 heads, 8 experts, vocab 512, mixed experts)"),
    ("small", "q2", "sparse", "test model (8 layers, n_embd 512, 8 heads, 16 experts, vocab 129280, q2 experts)"),
    ("flash", "q2", "sparse", "q2"),
    ("flash", "q4", "sparse", "q4"),
    ("flash", "mixed", "sparse", "mixed"),
])
def test_factory_presets_validate(tmp_path, preset, experts, data, variant):
    from ds4_mlx.model.factory import preset_config, write_model

    path = write_model(tmp_path / f"{preset}.gguf", preset=preset, experts=experts, data=data)
    with open_weights(path) as w:
        assert w.variant == variant
        expected = preset_config(preset)
        assert all(getattr(w.config, n) == getattr(expected, n) for n in ("n_layer", "n_embd", "n_expert",
                                                                           "compress_ratios", "indexer_top_k"))
        if experts == "mixed":
            assert len(set(w.expert_types)) == 2
