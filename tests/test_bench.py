"""`ds4-mlx bench` and bench/synthetic_flash.py: the measurement on a tiny model, the synthetic Flash layout against
the loader's layout rules, and the memory refusal that keeps the full layout off small machines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.cli import main
from ds4_mlx.errors import LayoutError
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.weights import model_layout

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


synthetic_flash = _load_script("synthetic_flash")


@pytest.fixture(scope="module")
def model_path(demo_model, tmp_path_factory):
    link = tmp_path_factory.mktemp("bench") / "tiny.gguf"  # the report names the file
    link.symlink_to(demo_model)
    return link


def bench_args(model_path, *extra: str) -> list[str]:
    return ["bench", "-m", str(model_path), "-c", "64", "--prompt-tokens", "24", "--gen-tokens", "3", "--repeats",
            "2", *extra]


def test_bench_json_gives_positive_figures(model_path, capsys):
    assert main(bench_args(model_path, "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny.gguf (6 layers, n_embd 256, 8 experts, vocab 129280)"
    assert (result["backend"], result["ctx"], result["prompt_tokens"], result["gen_tokens"], result["repeats"]) == (
        "cpu", 64, 24, 3, 2
    )
    assert result["prefill_tokens_per_second"] > 0 and result["decode_tokens_per_second"] > 0
    assert result["load_seconds"] > 0
    # The weights alone (raw blocks plus the float32 forms of the small matrices) are above 40 MB; peak >= active.
    assert 0.04 < result["active_memory_gib"] <= result["peak_memory_gib"]


def test_bench_prints_one_table(model_path, capsys):
    assert main(bench_args(model_path)) == 0
    table = capsys.readouterr().out
    for row in ("prefill (24 tokens)", "decode (3 tokens)", "peak memory", "median of 2, after a warm-up"):
        assert row in table
    assert table.count("tokens/s") == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt-tokens", "60", "--gen-tokens", "5"], "--prompt-tokens 60 + --gen-tokens 5 do not fit in --ctx 64; "
                                                         "use --ctx 65 or more"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
        (["--gen-tokens", "0"], "--gen-tokens must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ],
)
def test_bench_rejects_sizes_it_cannot_measure(flags, message, capsys):
    args = ["bench", "-m", "/nonexistent.gguf", "-c", "64", *flags]  # checked before the model is opened
    assert main(args) == 1
    assert capsys.readouterr().err == f"ds4-mlx bench: error: {message}\n"


def test_synthetic_layout_is_the_published_one():
    """Every tensor the loader requires, with its shape and a type it accepts; nothing else."""
    weights = synthetic_flash.synthetic_weights(synthetic_flash.flash_config(FLASH.n_layer))
    layout = model_layout(FLASH)
    for name, spec in layout.items():
        if spec.optional and not weights.has(name):
            continue
        info = weights.info(name)
        assert info.shape == spec.shape, name
        assert info.ggml_type in spec.types, name
    assert {n for n in layout if weights.has(n)} == set(weights.file.tensors)
    assert len(weights.file.tensors) == 1328
    assert 80 * 1024**3 < weights.nbytes < 82 * 1024**3  # the q2 file's ~81 GB of tensor data
    assert weights.expert_types[0] == (GGMLType.IQ2_XXS, GGMLType.Q2_K)


def test_reduced_layouts_keep_the_published_schedule():
    config = synthetic_flash.flash_config(4)
    assert config.compress_ratios == (0, 0, 4, 128) and config.n_hash_layer == 3
    assert synthetic_flash.flash_config(2).n_hash_layer == 2
    for bad in (0, 44):
        with pytest.raises(synthetic_flash.Ds4Error, match=f"--layers must be between 1 and 43, got {bad}"):
            synthetic_flash.flash_config(bad)


def test_synthetic_tensors_are_valid_blocks_shared_between_layers():
    weights = synthetic_flash.synthetic_weights(synthetic_flash.flash_config(6))
    kv = weights.tensor_bytes("blk.3.attn_kv.weight")
    assert kv.dtype == np.uint8 and kv.size == weights.info("blk.3.attn_kv.weight").nbytes
    assert weights.tensor_bytes("blk.5.attn_kv.weight") is kv
    ratio4 = weights.tensor_bytes("blk.2.attn_compressor_ape.weight")
    ratio128 = weights.tensor_bytes("blk.3.attn_compressor_ape.weight")
    assert ratio4.size != ratio128.size
    w = weights.array("blk.3.attn_kv.weight")  # Q8_0 (512, 4096) drawn as N(0, 1/4096) by the factory
    assert w.shape == (512, 4096)
    assert abs(mx.std(w).item() - 4096**-0.5) < 0.1 * 4096**-0.5
    with pytest.raises(LayoutError, match="tensor blk.7.attn_kv.weight is not in <synthetic DeepSeek V4 Flash"):
        weights.info("blk.7.attn_kv.weight")


def test_full_layout_is_refused_on_a_small_device(monkeypatch, capsys):
    from ds4_mlx.model.linear import loaded_nbytes

    monkeypatch.setattr("ds4_mlx.engine.device_memory_bytes", lambda: 24 * 1024**3)
    assert synthetic_flash.main([]) == 1
    need = loaded_nbytes(synthetic_flash.synthetic_weights(synthetic_flash.flash_config(43), "q2", 0))
    assert capsys.readouterr().err == (
        f"synthetic_flash: error: the model needs {need / 1024**3:.1f} GiB for its weights but this device has "
        "24.0 GiB; no context size fits\n"
    )


@pytest.mark.slow
def test_one_flash_layer_runs(capsys):
    """A single full-size layer (3.5 GB of weights) through the whole measurement; minutes on a laptop CPU."""
    assert synthetic_flash.main(["--layers", "1", "-c", "64", "--prompt-tokens", "4", "--gen-tokens", "1",
                                 "--repeats", "1", "--json", "-q"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prefill_tokens_per_second"] > 0 and result["decode_tokens_per_second"] > 0
    assert result["peak_memory_gib"] > 3
