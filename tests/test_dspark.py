"""The DSpark support file and drafter (model/dspark_file.py, model/dspark.py), and speculative decoding with it.

No published framework ships the drafter (transformers 5.23.0 has no DSpark code: its package holds no "dspark"),
so the forward pass is held against an independent float32 NumPy reference written here from the description of
the reference model in ../shared/spec/dspark.md §2 (the stages, the context rows, the heads), over the file's
weights dequantized by the GGUF reader.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.model.dspark import DSpark, open_drafter
from ds4_mlx.model.dspark_file import (aliases, dspark_metadata, dspark_tensors, open_dspark_weights, published_spec,
                                       support_kind, write_dspark_model)
from ds4_mlx.model.factory import V, preset_config, tensor_data, write_gguf, write_model, write_mtp_model
from ds4_mlx.model.gguf import GGUFFile
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import MTPWeights, open_weights

CTX = 256
PUBLISHED_BYTES = 5_989_114_272
"""`DeepSeek-V4-Flash-DSpark-support-0731.gguf`'s size (the C engine's model catalog)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    return (write_model(root / "tiny.gguf", preset="tiny", seed=5), write_dspark_model(root / "dspark.gguf", seed=5),
            write_mtp_model(root / "mtp.gguf", seed=5))


@pytest.fixture(scope="module")
def weights(paths):
    return open_weights(paths[0])


@pytest.fixture(scope="module")
def model(weights):
    return Model(weights)


@pytest.fixture(scope="module")
def drafter(paths, model):
    return DSpark.load(paths[1], model)


def _write(path, metadata, tensors):
    with open(path, "wb") as f:
        write_gguf(f, metadata, tensors, lambda spec: tensor_data(spec, seed=0))
    return path


# --------------------------------------------------------------------------------------------------------------
# The file


def test_flash_size_file_is_the_published_one_byte_for_byte_in_size():
    config = preset_config("flash")
    spec = published_spec(config)
    tensors = dspark_tensors(config, spec)
    assert len(tensors) == 81 and [t.name for t in tensors] == sorted(t.name for t in tensors)
    assert Counter(t.ggml_type.name for t in tensors) == {"F32": 34, "Q8_0": 31, "F16": 7, "IQ2_XXS": 6, "Q2_K": 3}
    assert write_gguf(io.BytesIO(), dspark_metadata(spec), tensors, None) == PUBLISHED_BYTES
    by_name = {t.name: t for t in tensors}
    assert by_name["mtp.0.main_proj.weight"].ne == (12288, 4096)
    assert by_name["mtp.2.markov_head.markov_w1.weight"].ne == (256, 129280)
    assert by_name["mtp.2.confidence_head.proj.weight"].ne == (4352, 1)
    assert by_name["mtp.1.ffn_gate_inp.weight"].ggml_type.name == "Q8_0"
    assert by_name["mtp.1.ffn_gate_exps.weight"].ne == (4096, 2048, 256)
    assert spec.target_layers == (40, 41, 42) and spec.noise_token == 128799


def test_tiny_file_loads_with_its_metadata(paths, weights):
    dspark = open_dspark_weights(paths[1], weights.config)
    metadata = dspark.file.metadata
    assert list(metadata) == ["general.architecture", "general.name", "general.alignment", "dspark.block_size",
                              "dspark.markov_rank", "dspark.noise_token_id", "dspark.target_layer_ids",
                              "dspark.stage_count", "dspark.n_layers"]
    assert dspark.file.metadata_types["dspark.target_layer_ids"] == "array[u32]"
    assert dspark.spec.target_layers == (3, 4, 5) and dspark.spec.block_size == 5 and dspark.spec.markov_rank == 256
    assert dspark.file.tensors["mtp.0.main_proj.weight"].shape == (3 * 256, 256)


@pytest.mark.parametrize("alias", [0, 1])
def test_metadata_keys_under_every_alias(tmp_path, weights, alias):
    spec = published_spec(weights.config)
    renamed = [(aliases(key.split(".", 1)[1])[alias], *rest) if key.startswith("dspark.") and
               key.split(".", 1)[1] in ("block_size", "markov_rank", "noise_token_id", "target_layer_ids")
               else (key, *rest) for key, *rest in dspark_metadata(spec)]
    path = _write(tmp_path / "alias.gguf", renamed, dspark_tensors(weights.config, spec))
    assert open_dspark_weights(path, weights.config).spec == spec


def _bad(tmp_path, config, change: dict | None = None, drop: str | None = None, spec=None):
    spec = spec or published_spec(config)
    metadata = [(key, vtype, (change or {}).get(key, value), element)
                for key, vtype, value, element in dspark_metadata(spec) if key != drop]
    return _write(tmp_path / "bad.gguf", metadata, dspark_tensors(config, spec))


@pytest.mark.parametrize("change, message", [
    ({"dspark.block_size": 0}, "block size 0"),
    ({"dspark.block_size": 17}, "block size 17"),
    ({"dspark.markov_rank": 0}, "Markov rank 0"),
    ({"dspark.noise_token_id": 512}, r"noise token 512 is outside the main model's vocabulary \[0, 512\)"),
    ({"dspark.target_layer_ids": [3, 5, 4]}, r"target layers \[3, 5, 4\]"),
    ({"dspark.target_layer_ids": [4, 5, 6]}, r"target layers \[4, 5, 6\]"),
])
def test_bad_metadata_is_one_clear_error(tmp_path, weights, change, message):
    with pytest.raises(LayoutError, match=message):
        open_dspark_weights(_bad(tmp_path, weights.config, change), weights.config)


def test_bad_files_are_layout_errors(tmp_path, paths, weights):
    config = weights.config
    with pytest.raises(LayoutError, match="has no noise_token_id"):
        open_dspark_weights(_bad(tmp_path, config, drop="dspark.noise_token_id"), config)
    spec = published_spec(config)
    with pytest.raises(LayoutError, match="mtp.0.main_proj.weight has shape"):  # 2 target layers for 3 in the file
        open_dspark_weights(_bad(tmp_path, config, {"dspark.target_layer_ids": [4, 5]}), config)
    four = replace(spec, n_stages=4)
    with pytest.raises(LayoutError, match="has 4 stages"):
        open_dspark_weights(_write(tmp_path / "four.gguf", dspark_metadata(four), dspark_tensors(config, four)), config)
    no_sink = [t for t in dspark_tensors(config, spec) if t.name != "mtp.1.attn_sinks.weight"]
    with pytest.raises(LayoutError, match="tensor mtp.1.attn_sinks.weight is missing"):
        open_dspark_weights(_write(tmp_path / "sink.gguf", dspark_metadata(spec), no_sink), config)
    with pytest.raises(LayoutError, match=r"target layers \[5, 6, 7\]: expected strictly increasing ids"):
        open_dspark_weights(write_dspark_model(tmp_path / "small.gguf", main_preset="small", vocab="small"), config)
    with pytest.raises(LayoutError, match="is not a DSpark support file"):
        open_dspark_weights(paths[2], config)


def test_mtp_file_kind_comes_from_its_tensors(paths, weights):
    assert support_kind(paths[1]) == "dspark" and support_kind(paths[2]) == "mtp"
    assert isinstance(open_drafter(paths[2], weights.config), MTPWeights)
    assert open_drafter(paths[1], weights.config).spec.n_stages == 3
    with pytest.raises(LayoutError, match="unsupported --mtp file tiny.gguf"):
        open_drafter(paths[0], weights.config)


def test_make_model_writes_the_dspark_file(tmp_path, capsys):
    from ds4_mlx.cli import main

    assert main(["make-model", str(tmp_path / "m.gguf"), "--dspark", str(tmp_path / "d.gguf"), "--seed", "5"]) == 0
    assert "DSpark support file for preset tiny" in capsys.readouterr().out
    with GGUFFile.open(tmp_path / "d.gguf") as f:
        assert len(f.tensors) == 81 and f.metadata["general.architecture"] == "deepseek4-dspark"
