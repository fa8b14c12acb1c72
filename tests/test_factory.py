"""The model-file factory: layout against ds4's tensor inventory, metadata, random values, vocabularies, the
transformers reference export, determinism and the make-model command.

Files are read back with gguf-py's reader and dequantizers, not with this package's loader, and the expected
inventory is rebuilt here from the published tensor tables (names, shapes, types), independently of the factory.
"""

from __future__ import annotations

import filecmp
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

from ds4_mlx.cli import main
from ds4_mlx.model import factory
from ds4_mlx.model.config import ModelConfig
from ds4_mlx.tokenizer import BYTE_TO_CHAR
from ds4_mlx.model.factory import (SMALL_VOCAB_SPECIALS, tensor_data, build_vocab,
                                   export_reference, hf_names, model_tensors, preset_config, write_model)

V = GGUFValueType

TINY = dict(n_layer=6, ratios=[0, 0, 4, 128, 4, 128], n_hash=3, n_embd=256, n_head=4, head_dim=128, n_rot=64,
            q_lora=64, o_groups=2, o_lora=32, window=16, idx_heads=16, idx_dim=128, top_k=8, n_expert=8,
            n_used=2, n_ff=256, n_hc=4, sinkhorn=20, n_vocab=512)
FLASH = dict(n_layer=43, ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)], n_hash=3, n_embd=4096,
             n_head=64, head_dim=512, n_rot=64, q_lora=1024, o_groups=8, o_lora=1024, window=128, idx_heads=64,
             idx_dim=128, top_k=512, n_expert=256, n_used=6, n_ff=2048, n_hc=4, sinkhorn=20, n_vocab=129280)


def expected_inventory(d: dict, routed: list[tuple[str, str]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type, ne) from the published tensor tables; `routed[L]` is layer L's (gate/up, down) type."""
    E, V_, HC, D = d["n_embd"], d["n_vocab"], d["n_hc"], d["head_dim"]
    mix = 2 * HC + HC * HC
    inv = {
        "token_embd.weight": ("F16", (E, V_)),
        "output_hc_base.weight": ("F32", (HC,)),
        "output_hc_fn.weight": ("F16", (HC * E, HC)),
        "output_hc_scale.weight": ("F32", (1,)),
        "output_norm.weight": ("F32", (E,)),
        "output.weight": ("Q8_0", (E, V_)),
    }
    for L, ratio in enumerate(d["ratios"]):
        b = f"blk.{L}."
        gate_up, down = routed[L]
        X, F = d["n_expert"], d["n_ff"]
        inv.update({
            b + "hc_attn_fn.weight": ("F16", (HC * E, mix)), b + "hc_attn_scale.weight": ("F32", (3,)),
            b + "hc_attn_base.weight": ("F32", (mix,)), b + "attn_norm.weight": ("F32", (E,)),
            b + "attn_q_a.weight": ("Q8_0", (E, d["q_lora"])), b + "attn_q_a_norm.weight": ("F32", (d["q_lora"],)),
            b + "attn_q_b.weight": ("Q8_0", (d["q_lora"], d["n_head"] * D)), b + "attn_kv.weight": ("Q8_0", (E, D)),
            b + "attn_kv_a_norm.weight": ("F32", (D,)), b + "attn_sinks.weight": ("F32", (d["n_head"],)),
            b + "attn_output_a.weight": ("Q8_0", (d["n_head"] * D // d["o_groups"], d["o_groups"] * d["o_lora"])),
            b + "attn_output_b.weight": ("Q8_0", (d["o_groups"] * d["o_lora"], E)),
            b + "hc_ffn_fn.weight": ("F16", (HC * E, mix)), b + "hc_ffn_scale.weight": ("F32", (3,)),
            b + "hc_ffn_base.weight": ("F32", (mix,)), b + "ffn_norm.weight": ("F32", (E,)),
            b + "ffn_gate_inp.weight": ("F16", (E, X)),
            b + "ffn_gate_exps.weight": (gate_up, (E, F, X)), b + "ffn_up_exps.weight": (gate_up, (E, F, X)),
            b + "ffn_down_exps.weight": (down, (F, E, X)),
            b + "ffn_gate_shexp.weight": ("Q8_0", (E, F)), b + "ffn_up_shexp.weight": ("Q8_0", (E, F)),
            b + "ffn_down_shexp.weight": ("Q8_0", (F, E)),
        })
        if L >= d["n_hash"]:
            inv[b + "exp_probs_b.bias"] = ("F32", (X,))
        else:
            inv[b + "ffn_gate_tid2eid.weight"] = ("I32", (d["n_used"], V_))
        if ratio:
            W = (2 if ratio == 4 else 1) * D
            inv.update({b + "attn_compressor_ape.weight": ("F16", (W, ratio)),
                        b + "attn_compressor_kv.weight": ("F16", (E, W)),
                        b + "attn_compressor_gate.weight": ("F16", (E, W)),
                        b + "attn_compressor_norm.weight": ("F32", (D,))})
        if ratio == 4:
            I, IW = d["idx_dim"], 2 * d["idx_dim"]
            inv.update({b + "indexer.attn_q_b.weight": ("F16", (d["q_lora"], d["idx_heads"] * I)),
                        b + "indexer.proj.weight": ("F16", (E, d["idx_heads"])),
                        b + "indexer_compressor_ape.weight": ("F16", (IW, 4)),
                        b + "indexer_compressor_kv.weight": ("F16", (E, IW)),
                        b + "indexer_compressor_gate.weight": ("F16", (E, IW)),
                        b + "indexer_compressor_norm.weight": ("F32", (I,))})
    return inv


def expected_count(d: dict) -> int:
    """The tensor count: 6 + 23L + 4·#compressed + 6·#ratio-4 + #exp_probs_b + #hash."""
    ratios = d["ratios"]
    return (6 + 23 * d["n_layer"] + 4 * sum(r != 0 for r in ratios) + 6 * sum(r == 4 for r in ratios)
            + (d["n_layer"] - d["n_hash"]) + d["n_hash"])


def inventory(reader: GGUFReader) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}


def values(tensor) -> np.ndarray:
    if tensor.tensor_type.name == "I32":
        return np.asarray(tensor.data)
    return gguf_quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def metadata(reader: GGUFReader) -> tuple[dict, dict]:
    """(key -> value, key -> GGUF type name as ModelConfig.from_metadata takes it)."""
    names = {V.UINT32: "u32", V.INT32: "i32", V.UINT64: "u64", V.FLOAT32: "f32", V.FLOAT64: "f64",
             V.BOOL: "bool", V.STRING: "string"}
    md, types = {}, {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        md[key] = field.contents()
        main_type = field.types[0]
        types[key] = f"array[{names[field.types[-1]]}]" if main_type == V.ARRAY else names[main_type]
    return md, types


Q2 = ("IQ2_XXS", "Q2_K")
Q4 = ("Q4_K", "Q4_K")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("factory")
    return {experts: write_model(tmp / f"tiny-{experts}.gguf", experts=experts) for experts in ("q2", "q4", "mixed")}


@pytest.fixture(scope="module")
def tiny(files) -> GGUFReader:
    return GGUFReader(files["q2"])


def test_tiny_preset_has_the_requested_dimensions():
    c = preset_config("tiny")
    assert (c.n_layer, list(c.compress_ratios), c.n_hash_layer, c.n_embd, c.n_head, c.head_dim, c.n_rot) == (
        6, TINY["ratios"], 3, 256, 4, 128, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (64, 2, 32, 16)
    assert (c.indexer_n_head, c.indexer_head_dim, c.indexer_top_k) == (16, 128, 8)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_hc, c.sinkhorn_iters, c.n_vocab) == (8, 2, 256, 4, 20, 512)


@pytest.mark.parametrize("experts, routed", [
    ("q2", [Q2] * 6),
    ("q4", [Q4] * 6),
    ("mixed", [Q2] * 4 + [Q4] * 2),  # the last third of the layers from q4
])
def test_tiny_inventory_matches_the_spec(files, experts, routed):
    reader = GGUFReader(files[experts])
    assert inventory(reader) == expected_inventory(TINY, routed)
    assert len(reader.tensors) == expected_count(TINY) == 178


def test_tensor_data_is_aligned_and_fills_the_file(files, tiny):
    starts = sorted((t.data_offset, t.n_bytes) for t in tiny.tensors)
    assert all(offset % 32 == 0 for offset, _ in starts)
    assert all(a + n <= b for (a, n), (b, _) in zip(starts, starts[1:]))
    assert starts[-1][0] + starts[-1][1] == files["q2"].stat().st_size


def test_metadata_has_every_key_with_the_published_types_and_values(tiny):
    md, types = metadata(tiny)
    u32 = {
        "block_count": 6, "embedding_length": 256, "vocab_size": 512, "attention.head_count": 4,
        "attention.head_count_kv": 1, "attention.key_length": 128, "attention.value_length": 128,
        "rope.dimension_count": 64, "attention.q_lora_rank": 64, "attention.output_lora_rank": 32,
        "attention.output_group_count": 2, "expert_count": 8, "expert_used_count": 2,
        "expert_feed_forward_length": 256, "expert_shared_count": 1, "hash_layer_count": 3,
        "expert_group_count": 0, "expert_group_used_count": 0, "attention.sliding_window": 16,
        "attention.indexer.head_count": 16, "attention.indexer.key_length": 128, "attention.indexer.top_k": 8,
        "hyper_connection.count": 4, "hyper_connection.sinkhorn_iterations": 20,
        "rope.scaling.original_context_length": 65536, "expert_gating_func": 4, "nextn_predict_layers": 1,
    }
    f32 = {
        "rope.freq_base": 10000.0, "rope.scaling.factor": 16.0, "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0, "attention.compress_rope_freq_base": 160000.0,
        "expert_weights_scale": 1.5, "attention.layer_norm_rms_epsilon": np.float32(1e-6),
        "hyper_connection.epsilon": np.float32(1e-6),
    }
    for key, value in u32.items():
        assert (types[f"deepseek4.{key}"], md[f"deepseek4.{key}"]) == ("u32", value), key
    for key, value in f32.items():
        assert (types[f"deepseek4.{key}"], md[f"deepseek4.{key}"]) == ("f32", value), key
    assert (types["deepseek4.expert_weights_norm"], md["deepseek4.expert_weights_norm"]) == ("bool", True)
    assert (types["deepseek4.context_length"], md["deepseek4.context_length"]) == ("u64", 1048576)
    # one entry per layer plus the MTP block's (ratio 0), as in the published config
    assert types["deepseek4.attention.compress_ratios"] == "array[u32]"
    assert md["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128, 4, 128, 0]
    assert types["deepseek4.swiglu_clamp_exp"] == "array[f32]"
    assert md["deepseek4.swiglu_clamp_exp"] == [10.0] * 7
    strings = {"general.architecture": "deepseek4", "deepseek4.rope.scaling.type": "yarn",
               "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "joyai-llm"}
    for key, value in strings.items():
        assert (types[key], md[key]) == ("string", value), key
    assert types["general.name"] == "string" and "random" in md["general.name"]
    assert (types["tokenizer.ggml.tokens"], types["tokenizer.ggml.merges"]) == ("array[string]", "array[string]")
    assert types["tokenizer.ggml.token_type"] == "array[i32]"
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (0, 1)
    vocab = build_vocab("small")
    assert md["tokenizer.ggml.tokens"] == list(vocab.tokens)
    assert md["tokenizer.ggml.merges"] == list(vocab.merges)
    assert md["tokenizer.ggml.token_type"] == list(vocab.token_types)


def test_model_config_accepts_the_metadata(tiny):
    md, types = metadata(tiny)
    config = ModelConfig.from_metadata(md, types)
    # the epsilons come back as the f32 nearest 1e-6
    assert config == replace(preset_config("tiny"), rms_eps=float(np.float32(1e-6)), hc_eps=float(np.float32(1e-6)))


def test_routed_experts_dequantize_to_the_target_std(files):
    """Built-from-bits blocks: finite, centred, std 1/sqrt(fan_in). The sample is 2^19 values per tensor, so the
    sampling error of the std is well under 1%; 3% leaves room for the fp16 rounding of d and dmin."""
    seen = set()
    for path in files.values():
        for tensor in GGUFReader(path).tensors:
            if "_exps" not in tensor.name:
                continue
            seen.add(tensor.tensor_type.name)
            w = values(tensor)
            target = 1 / np.sqrt(int(tensor.shape[0]))
            assert np.isfinite(w).all(), tensor.name
            assert abs(w.mean()) < 0.02 * target, tensor.name
            assert w.std() == pytest.approx(target, rel=0.03), tensor.name
            assert len(np.unique(w[0, 0])) > 4, tensor.name  # sub-block scales and quants vary
    assert seen == {"IQ2_XXS", "Q2_K", "Q4_K"}


def test_every_parameter_family_is_random_with_a_realistic_magnitude(tiny):
    families = defaultdict(list)
    for tensor in tiny.tensors:
        families[tensor.name.split(".", 2)[-1] if tensor.name.startswith("blk.") else tensor.name].append(tensor)
    for family, tensors in families.items():
        w = np.concatenate([values(t).ravel() for t in tensors]).astype(np.float64)
        if family == "ffn_gate_tid2eid.weight":
            continue
        assert np.isfinite(w).all(), family
        if family == "output_hc_scale.weight":  # one value: it must not be the constant 1 an init would leave
            assert w[0] != 1.0 and 0.2 < w[0] < 2.0
            continue
        assert w.std() > 0, family
        if family.endswith("norm.weight"):
            assert abs(w.mean() - 1) < 0.05 and 0.05 < w.std() < 0.2, family
        elif len(tensors[0].shape) >= 2 and "ape" not in family and "hc_" not in family:
            if family == "token_embd.weight":
                fan_in_std = 1.0
            else:
                fan_in_std = 1 / np.sqrt(int(tensors[0].shape[0]))
            assert w.std() == pytest.approx(fan_in_std, rel=0.1), family
        else:  # sinks, biases, HC bases and scales, ape: O(1) at most
            assert 0.01 < w.std() < 1.5 and abs(w.mean()) < 1.5, family


def test_tid2eid_rows_are_distinct_expert_ids(tiny):
    tables = [t for t in tiny.tensors if t.name.endswith("ffn_gate_tid2eid.weight")]
    assert [t.name for t in tables] == [f"blk.{i}.ffn_gate_tid2eid.weight" for i in range(3)]
    for t in tables:
        ids = np.asarray(t.data)
        assert ids.shape == (512, 2) and ids.min() >= 0 and ids.max() < 8
        assert (ids[:, 0] != ids[:, 1]).all()
        assert len({tuple(r) for r in ids}) > 20  # not one constant row
    assert not np.array_equal(tables[0].data, tables[1].data)


def test_same_seed_same_bytes_different_seed_different(tmp_path, files):
    again = write_model(tmp_path / "again.gguf", experts="q2", seed=0)
    other = write_model(tmp_path / "other.gguf", experts="q2", seed=1)
    assert filecmp.cmp(again, files["q2"], shallow=False)
    assert again.stat().st_size == other.stat().st_size
    assert not filecmp.cmp(again, other, shallow=False)
    a, b = GGUFReader(again), GGUFReader(other)
    assert inventory(a) == inventory(b)
    for ta, tb in zip(a.tensors, b.tensors):
        assert not np.array_equal(ta.data, tb.data), ta.name


def test_parallel_writer_gives_the_same_bytes(tmp_path, files):
    """`make-model --jobs N` draws tensors in N processes and writes each at its offset: the same file."""
    progress = []
    parallel = write_model(tmp_path / "parallel.gguf", experts="mixed", jobs=2, progress=lambda d, t: progress.append(d))
    assert filecmp.cmp(parallel, files["mixed"], shallow=False)
    assert progress[-1] == parallel.stat().st_size and progress == sorted(progress)
    assert not (tmp_path / "parallel.gguf.part").exists()


def test_sparse_file_has_the_same_header_and_zero_data(tmp_path, files):
    sparse = write_model(tmp_path / "sparse.gguf", data="sparse")
    dense = files["q2"].read_bytes()
    raw = sparse.read_bytes()
    assert len(raw) == len(dense)
    reader = GGUFReader(sparse)
    data_start = min(t.data_offset for t in reader.tensors)
    assert raw[:data_start] == dense[:data_start]
    assert not any(raw[data_start:])
    assert all(np.isfinite(values(t)).all() for t in reader.tensors)  # all-zero blocks are valid blocks


def test_repeated_data_draws_the_first_rows_and_repeats_them(tmp_path, monkeypatch):
    """`make-model --repeat`: each tensor's first chunks of rows, up to REPEAT_AFTER bytes, are the random file's,
    and the rest repeats them in order, whole rows; a tensor drawn in fewer bytes is the random file's."""
    monkeypatch.setattr(factory, "_CHUNK_VALUES", 1 << 12)  # small chunks, so that tiny's tensors repeat
    monkeypatch.setattr(factory, "REPEAT_AFTER", 1 << 16)
    dense = GGUFReader(write_model(tmp_path / "random.gguf"))
    repeated = GGUFReader(write_model(tmp_path / "repeated.gguf", data="repeated"))  # one process: the patches hold
    specs = {s.name: s for s in model_tensors(preset_config("tiny"), "q2")}
    grew = 0
    for want, got in zip(dense.tensors, repeated.tensors, strict=True):
        a, b = np.asarray(want.data).view(np.uint8).ravel(), np.asarray(got.data).view(np.uint8).ravel()
        chunk = len(next(tensor_data(specs[got.name], seed=0)))
        drawn = min(a.size, -(-(1 << 16) // chunk) * chunk)
        assert want.name == got.name and (b[:drawn] == a[:drawn]).all(), got.name
        if drawn < a.size:
            grew += 1
            assert (b[drawn:] == np.resize(b[:drawn], a.size - drawn)).all(), got.name
        assert np.isfinite(values(got)).all(), got.name
    assert grew >= 3  # the embedding, the LM head, the expert banks at least


def test_sparse_flash_has_the_published_inventory(tmp_path):
    """The 1328 tensors of the published file with their shapes and q2 types (small vocab keeps the read fast)."""
    path = write_model(tmp_path / "flash.gguf", preset="flash", vocab="small", data="sparse")
    reader = GGUFReader(path)
    d = dict(FLASH, n_vocab=512)
    assert len(reader.tensors) == expected_count(FLASH) == 1328
    assert inventory(reader) == expected_inventory(d, [Q2] * 43)
    md, types = metadata(reader)
    config = ModelConfig.from_metadata(md, types)
    assert config.n_layer == 43 and config.n_vocab == 512


def test_flash_q2_file_is_the_published_size(tmp_path):
    """With the real vocabulary the q2 flash file has the published q2 size, 80.76 GiB."""
    path = write_model(tmp_path / "flash.gguf", preset="flash", data="sparse")
    assert round(path.stat().st_size / 2**30, 2) == 80.76
    mixed = write_model(tmp_path / "mixed.gguf", preset="flash", experts="mixed", data="sparse")
    assert mixed.stat().st_size > path.stat().st_size


@pytest.mark.parametrize("experts", ["q2", "q4"])
def test_flash_tensors_are_generated_in_bounded_chunks(experts):
    """A flash tensor is produced a few MB at a time (the writer never holds a whole 0.5-1 GB tensor), and the
    published widths (fan-in 4096 and 2048) get the same target std as the tiny ones."""
    by_name = {s.name: s for s in model_tensors(preset_config("flash"), experts)}
    for name in ("token_embd.weight", "output.weight", "blk.3.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"):
        spec = by_name[name]
        chunks = tensor_data(spec, seed=0)
        first = next(chunks)
        assert len(first) <= 16 * 2**20 and len(first) < spec.n_bytes, name
        if "_exps" in name:
            n_rows = len(first) // (spec.n_bytes // (spec.ne[1] * spec.ne[2]))
            w = gguf_quants.dequantize(np.frombuffer(first, np.uint8).reshape(n_rows, -1), spec.ggml_type)
            assert w.shape == (n_rows, spec.ne[0])
            assert w.std() == pytest.approx(spec.ne[0] ** -0.5, rel=0.03), name


def test_small_vocab_is_a_valid_bpe_with_the_specials():
    vocab = build_vocab("small")
    tokens = vocab.tokens
    assert len(tokens) == 512 and len(set(tokens)) == 512
    assert tokens[:3] == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
    assert list(tokens[3:259]) == list(BYTE_TO_CHAR.values())
    assert tokens[-6:] == SMALL_VOCAB_SPECIALS == ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                                                   "｜DSML｜", "<｜latest_reminder｜>")
    known = set(tokens[3:259])
    for merge in vocab.merges:  # every merge's parts exist before it, and its result is a token
        left, right = merge.split(" ")
        assert left in known and right in known, merge
        known.add(left + right)
    assert known | set(tokens[:3]) | set(SMALL_VOCAB_SPECIALS) == set(tokens)
    assert [i for i, t in enumerate(vocab.token_types) if t == 3] == [0, 1, 2, *range(506, 512)]
    assert set(vocab.token_types) == {1, 3}


def test_real_vocab_has_the_v4_ids():
    vocab = build_vocab("real")
    tokens = vocab.tokens
    assert len(tokens) == 129280
    ids = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "<｜User｜>": 128803,
           "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822, "｜DSML｜": 128825,
           "<｜latest_reminder｜>": 128828}
    for text, i in ids.items():
        assert tokens[i] == text and vocab.token_types[i] == 3, text
    assert (vocab.bos_id, vocab.eos_id) == (0, 1)
    assert vocab.token_types[270] == 1 and tokens[270] == "Ġthe"
    assert len(vocab.merges) == 127741 and all(m.count(" ") == 1 for m in vocab.merges[:1000])
    small = build_vocab("small")
    assert small.tokens[:506] == tokens[:506]  # the small vocabulary is the real one's prefix
    assert small.merges == vocab.merges[:247]


@pytest.mark.slow
def test_real_vocab_round_trips_through_the_file(tmp_path):
    """129280 tokens and 127741 merges written and read back unchanged (gguf-py's reader takes ~5 s here)."""
    vocab = build_vocab("real")
    path = write_model(tmp_path / "real.gguf", vocab="real", data="sparse")
    md, types = metadata(GGUFReader(path))
    assert md["tokenizer.ggml.tokens"] == list(vocab.tokens)
    assert md["tokenizer.ggml.merges"] == list(vocab.merges)
    assert md["tokenizer.ggml.token_type"] == list(vocab.token_types)
    assert md["deepseek4.vocab_size"] == 129280


def test_hf_names_follow_the_published_checkpoint():
    assert hf_names("token_embd.weight") == ["embed.weight"]
    assert hf_names("output_hc_fn.weight") == ["hc_head_fn"]
    assert hf_names("blk.7.attn_sinks.weight") == ["layers.7.attn.attn_sink"]
    assert hf_names("blk.2.indexer_compressor_ape.weight") == ["layers.2.attn.indexer.compressor.ape"]
    assert hf_names("blk.3.exp_probs_b.bias") == ["layers.3.ffn.gate.bias"]
    assert hf_names("blk.0.ffn_down_exps.weight", 2) == ["layers.0.ffn.experts.0.w2.weight",
                                                        "layers.0.ffn.experts.1.w2.weight"]
    from ds4_mlx.errors import LayoutError

    with pytest.raises(LayoutError, match="blk.0.attn_q.weight"):
        hf_names("blk.0.attn_q.weight")


def test_reference_export_loads_in_transformers(tmp_path, files, tiny):
    """transformers loads every exported tensor (no missing or unexpected key) and gives finite logits."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    out = export_reference(files["mixed"], tmp_path / "ref")
    config = json.loads((out / "config.json").read_text())
    assert config["compress_ratios"] == TINY["ratios"] and config["num_hash_layers"] == 3
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert {k: v for k, v in info.items() if v} == {}
    state = model.state_dict()
    reader = GGUFReader(files["mixed"])
    by_name = {t.name: t for t in reader.tensors}
    # values arrive unchanged: no transposes, experts split per expert and merged back by transformers
    assert np.array_equal(state["lm_head.weight"].numpy(), values(by_name["output.weight"]))
    experts = values(by_name["blk.5.ffn_gate_exps.weight"])  # Q4_K in the mixed file
    assert np.array_equal(state["model.layers.5.mlp.experts.gate_up_proj"][:, :256].numpy(), experts)
    tid2eid = state["model.layers.1.mlp.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and np.array_equal(tid2eid.numpy(), values(by_name["blk.1.ffn_gate_tid2eid.weight"]))
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 48, 512)
    assert torch.isfinite(logits).all()
    assert 0.2 < logits.std().item() < 5  # O(1) activations all the way through


def test_make_model_command(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main(["make-model", str(out), "--seed", "3", "--experts", "q4"]) == 0
    printed = capsys.readouterr().out
    assert "178 tensors" in printed and str(out) in printed and "experts q4" in printed
    assert filecmp.cmp(out, write_model(tmp_path / "api.gguf", experts="q4", seed=3), shallow=False)
    assert not Path(str(out) + ".part").exists()


def test_make_model_reports_an_unwritable_path(tmp_path, capsys):
    assert main(["make-model", str(tmp_path / "missing" / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "missing" in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(preset="huge"), "unknown preset 'huge'"),
    (dict(experts="q3"), "unknown experts 'q3'"),
    (dict(vocab="tiny"), "unknown vocab 'tiny'"),
    (dict(data="holes"), "unknown data 'holes'"),
    (dict(seed=-1), "non-negative"),
])
def test_write_model_rejects_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_model(tmp_path / "x.gguf", **kwargs)
    assert not list(tmp_path.iterdir())
