"""`ds4-mlx bench`: the frontier walk on a tiny model (CSV, JSON, plot, op counts, progress lines, the --mtp
figures), the flags it refuses before loading, and the synthetic Flash layout against the loader's layout rules."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
from argparse import Namespace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from rich.console import Console

from ds4_mlx.cli import main
from ds4_mlx.commands.bench import (CSV_COLUMNS, MTP_COLUMNS, Loaded, Walk, chunk_lengths, live_kv_bytes, mtp_table,
                                   plan, prompt_ids, read_prompt, report, run_walk, speculative_probe, verify_call)
from ds4_mlx.engine import Engine
from ds4_mlx.errors import Ds4Error, LayoutError
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.mtp import MTP
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.model.weights import model_layout


@pytest.fixture(scope="module")
def model_path(demo_model, tmp_path_factory):
    link = tmp_path_factory.mktemp("bench") / "tiny.gguf"  # the report names the file
    link.symlink_to(demo_model)
    return link


@pytest.fixture(scope="module")
def walked(model_path, tmp_path_factory):
    """One bench run with every output: (JSON result, stderr, CSV rows, PNG bytes, the CSV header)."""
    out_dir = tmp_path_factory.mktemp("bench-out")
    prompt = out_dir / "prompt.txt"
    prompt.write_text("one two three four five six seven eight nine ten")
    stdout, stderr = io.StringIO(), io.StringIO()
    args = ["bench", "-m", str(model_path), "--ctx-start", "16", "--ctx-max", "48", "--step-incr", "16",
            "--gen-tokens", "3", "--repeats", "2", "--prompt-file", str(prompt), "--ops", "--json",
            "--csv", str(out_dir / "walk.csv")]
    if _has_matplotlib():
        args += ["--plot", str(out_dir / "walk.png")]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(args) == 0
    with open(out_dir / "walk.csv", newline="") as f:
        header = next(csv.reader(f))
    with open(out_dir / "walk.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    png = (out_dir / "walk.png").read_bytes() if _has_matplotlib() else None
    return json.loads(stdout.getvalue()), stderr.getvalue(), rows, png, header


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_csv_has_ds4_bench_columns_first_and_one_row_per_frontier(walked):
    result, _, rows, _, header = walked
    assert header == list(CSV_COLUMNS)
    assert header[:6] == ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes"]
    assert [int(r["ctx_tokens"]) for r in rows] == [16, 32, 48]
    assert [int(r["prefill_tokens"]) for r in rows] == [16, 16, 16]  # incremental: only the new interval
    assert all(int(r["gen_tokens"]) == 3 for r in rows)
    for r in rows:
        for key in ("prefill_tps", "gen_tps"):
            assert 0 < float(r[f"{key}_min"]) <= float(r[key]) <= float(r[f"{key}_max"])
        assert int(r["peak_memory_bytes"]) >= result["weights_bytes"]
    kv = [int(r["kvcache_bytes"]) for r in rows]
    assert kv[0] < kv[1] < kv[2]  # the sliding window (16 rows) is full from 16 on: the compressed rows grow
    assert rows == [{k: str(v) for k, v in row.items()} for row in result["frontiers"]]


def test_json_reports_load_speed_and_host_memory(walked):
    result, *_ = walked
    assert result["ctx"] == 48 + 3 and result["repeats"] == 2
    assert result["load_seconds"] > 0 and result["load_bytes"] > 5_000_000
    assert result["load_gb_per_second"] == pytest.approx(result["load_bytes"] / 1e9 / result["load_seconds"], rel=0.05)
    stats = result["load_stats"]
    assert stats["evaluations"] >= 1 and stats["chunks"] >= 1
    assert stats["pinned_bytes"] == 0  # the CPU: every tensor through the mapped file
    assert result["decode"] == "fed ahead"
    phases = result["load_phases"]
    assert list(phases) == ["open", "weights", "tokenizer", "engine"] and phases["weights"] > 0
    assert sum(phases.values()) <= result["load_seconds"]
    assert result["host"]["peak_rss_bytes"] >= result["host"]["peak_anon_bytes_sampled"] > 0


def test_read_back_decodes_as_sampled_decoding_does(model_path, capsys):
    assert main(["bench", "-m", str(model_path), "--ctx-start", "16", "--ctx-max", "16", "--gen-tokens", "3",
                 "--read-back", "--json", "-q"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decode"] == "read back" and result["frontiers"][0]["gen_tps"] > 0


def test_ops_counts_one_decode_step(walked):
    result, *_ = walked
    ops = result["decode_ops"]
    assert len(ops["per_layer"]) == 6
    assert ops["total"] == sum(ops["per_layer"]) + ops["outside_layers"]
    assert sum(ops["by_primitive"].values()) == ops["total"]
    assert 0 < ops["kernels"] < ops["total"]
    assert all(n > 0 for n in ops["per_layer"])


def test_progress_is_one_line_per_frontier_when_piped(walked):
    _, stderr, *_ = walked
    lines = [line for line in stderr.splitlines() if ", ctx " in line]
    assert [line.split(",")[0] for line in lines] == ["ds4-mlx bench: run 1/2"] * 3 + ["ds4-mlx bench: run 2/2"] * 3
    assert "ctx 48: prefill 16 tokens at " in lines[2] and "decode 3 tokens at " in lines[2]
    assert stderr.startswith("ds4-mlx bench: loaded ")


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib (the plot extra) is not installed")
def test_plot_is_a_png(walked):
    *_, png, _ = walked
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_plot_without_matplotlib_fails_before_loading(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "-m", "/nonexistent.gguf", "--plot", "x.png"]) == 1
    assert capsys.readouterr().err == ("ds4-mlx bench: error: --plot needs matplotlib, which is not installed: "
                                       "pip install 'ds4-mlx[plot]'\n")


def recording(model_path: Path, method: str) -> tuple[Engine, Loaded, list[int], list[int]]:
    """A 40-token session of the tiny model ready to walk, its built-in 32-token prompt, and the lengths of the
    token lists its `method` ("prefill" or "_feed") is given from now on."""
    engine = Engine.load(model_path, 40)
    fed: list[int] = []
    inner = getattr(engine.session, method)
    setattr(engine.session, method, lambda tokens, **kw: fed.append(len(tokens)) or inner(tokens, **kw))
    loaded = Loaded("tiny", engine.session, engine.tokenizer, 1.0, 1, {})
    return engine, loaded, prompt_ids(engine.tokenizer, read_prompt(None), 32), fed


def test_walk_continues_from_the_prompt_after_each_probe(model_path):
    engine, loaded, prompt, fed = recording(model_path, "prefill")
    results, counts = run_walk(loaded, Walk((16, 32), gen_tokens=4, repeats=1), prompt)
    # the warm-up runs the first interval's shape twice, then the walk its two intervals (decode steps feed 1 token)
    assert [n for n in fed if n > 1] == [16, 16, 16, 16]
    assert loaded.warmup_seconds > 0
    assert engine.session.tokens == prompt  # the probes' tokens were rolled back
    fresh = Engine.load(model_path, 40).session
    fresh.prefill(prompt[:16])
    fresh.prefill(prompt[16:])
    np.testing.assert_allclose(np.asarray(engine.session.logits), np.asarray(fresh.logits), rtol=1e-5, atol=1e-5)
    assert counts is None and [r.prefill_tokens for r in results] == [16, 16]
    tight = Engine.load(model_path, 5)  # the warm-up fits a context of one frontier plus its probe
    results, _ = run_walk(Loaded("tiny", tight.session, tight.tokenizer, 1.0, 1, {}), Walk((4,), 1, 1), prompt[:4])
    assert tight.session.tokens == prompt[:4] and results[0].gen_tps[0] > 0


def test_warm_up_feeds_every_chunk_length_the_walk_will(model_path):
    assert chunk_lengths([512, 2048, 8192, 32768], 2048) == [512, 1536, 2048]
    assert chunk_lengths([8, 20, 32], 8) == [8, 4] and chunk_lengths([6], 8) == [6]
    engine, loaded, prompt, fed = recording(model_path, "_feed")
    run_walk(loaded, Walk((8, 20, 32), gen_tokens=1, repeats=1, prefill_chunk=8), prompt)
    # warm-up: the first shape twice, then the 4-token remainder the later intervals end with; then the walk
    assert [n for n in fed if n > 1] == [8, 8, 4] + [8, 8, 4, 8, 4]


def test_walk_prefills_in_the_chunks_asked_for(model_path):
    engine, loaded, prompt, fed = recording(model_path, "_feed")
    run_walk(loaded, Walk((10, 32), gen_tokens=0, repeats=1, prefill_chunk=4), prompt)
    assert engine.session.chunk_size == 4
    assert max(fed) == 4 and sum(n for n in fed if n > 1) >= 32  # the walk's 32 tokens in chunks of at most 4


def _args(**kw) -> Namespace:
    base = dict(ctx_start=2048, ctx_max=32768, step_incr=None, step_mul=None, gen_tokens=128, repeats=1,
                layers=None, synthetic=None, demo=False, ctx=None, ops_for=None, mtp=None, mtp_draft=1,
                mtp_margin=3.0, prefill_chunk=None, read_back=False, parallel=1)
    return Namespace(**(base | kw))


def test_frontiers_step_by_increment_or_factor():
    walk = plan(_args())
    assert walk.frontiers == tuple(range(2048, 32769, 2048)) and walk.ctx == 32768 + 128
    assert plan(_args(step_mul=2.0, ctx_max=20000)).frontiers == (2048, 4096, 8192, 16384)
    assert plan(_args(ctx_start=100, ctx_max=350, step_incr=100, gen_tokens=0)).frontiers == (100, 200, 300)
    assert plan(_args(ctx_start=3, ctx_max=5, step_mul=1.1)).frontiers == (3, 4, 5)  # at least one token a step
    mtp = plan(_args(ctx_max=2048, gen_tokens=2, mtp=Path("m.gguf"), mtp_draft=4, mtp_margin=0.5))
    assert (mtp.mtp_draft, mtp.mtp_margin, mtp.ctx) == (4, 0.5, 2048 + 4)  # room for the 4-token verify call
    assert plan(_args(ctx_max=2048, mtp_draft=1)).mtp_draft == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ctx-start", "0"], "argument --ctx-start: expected an integer >= 1, got '0'"),
        (["--ctx-start", "64", "--ctx-max", "32"], "--ctx-max 32 is below --ctx-start 64"),
        (["--ctx-max", "100"], "--ctx-max 100 is below --ctx-start 2048"),
        (["--step-incr", "0"], "argument --step-incr: expected an integer >= 1, got '0'"),
        (["--step-mul", "1"], "--step-mul must be > 1, got 1.0"),
        (["--gen-tokens", "-1"], "argument --gen-tokens: expected an integer >= 0, got '-1'"),
        (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        (["--prefill-chunk", "0"], "argument --prefill-chunk: expected an integer >= 1, got '0'"),
        (["--layers", "4"], "--layers needs --synthetic"),
        (["--synthetic", "q2", "--demo"], "--synthetic and --demo both choose the model; give one"),
        (["--ctx-max", "4096", "-c", "4000"], "--ctx 4000 is too small for the walk: the last frontier 4096 + "
                                              "--gen-tokens 128 need 4224"),
        (["--synthetic", "q2", "--layers", "44"], "--layers must be between 1 and 43, got 44"),
    ],
)
def test_bench_rejects_bad_flag_values_before_loading_with_status_2(flags, message, capsys):
    """A flag value the walk cannot take is a usage mistake: one line, exit status 2, before the model is opened."""
    try:
        code = main(["bench", "-m", "/nonexistent.gguf", *flags])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds4-mlx bench: error: {message}") and err.count("\n") == 1


def test_bench_stops_before_loading_when_the_prompt_file_is_missing(capsys):
    assert main(["bench", "-m", "/nonexistent.gguf", "--prompt-file", "/nonexistent.txt"]) == 1
    assert capsys.readouterr().err == ("ds4-mlx bench: error: cannot read --prompt-file /nonexistent.txt: No such "
                                       "file or directory\n")


def test_prompt_is_the_text_repeated(model_path):
    tokenizer = Engine.load(model_path, 16).tokenizer
    ids = tokenizer.encode("abc def", specials=False)
    assert prompt_ids(tokenizer, "abc def", 3 * len(ids) + 1) == ids * 3 + ids[:1]
    assert len(prompt_ids(tokenizer, read_prompt(None), 5000)) == 5000


def test_live_kv_bytes_follow_the_layout():
    class Stub:
        config = flash_config(4)  # ratios 0, 0, 4, 128

    c = Stub.config
    window = 4 * min(1000, c.sliding_window) * c.head_dim * 4
    assert live_kv_bytes(Stub, 1000) == window + 4 * (250 * (c.head_dim + c.indexer_head_dim) + 7 * c.head_dim)


def test_synthetic_layout_is_the_published_one():
    """Every tensor the loader requires, with its shape and a type it accepts; nothing else."""
    weights = synthetic_weights(flash_config(FLASH.n_layer))
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
    assert synthetic_weights(flash_config(2), "q4").expert_types[1] == (GGMLType.Q4_K, GGMLType.Q4_K)


def test_reduced_layouts_keep_the_published_schedule():
    config = flash_config(4)
    assert config.compress_ratios == (0, 0, 4, 128) and config.n_hash_layer == 3
    assert flash_config(2).n_hash_layer == 2
    for bad in (0, 44):
        with pytest.raises(Ds4Error, match=f"--layers must be between 1 and 43, got {bad}"):
            flash_config(bad)


def test_a_large_synthetic_tensor_repeats_its_drawn_rows(monkeypatch):
    from ds4_mlx.model import factory, synthetic

    weights = synthetic_weights(flash_config(1))
    info = weights.info("output.weight")  # Q8_0 (129280, 4096): 4352 bytes a row
    row = info.nbytes // 129280
    monkeypatch.setattr(factory, "REPEAT_AFTER", 1 << 20)
    data = synthetic._draw(weights.file._specs["output.weight"], 0)
    assert data.size == info.nbytes
    drawn = 1024 * row  # the factory yields 1024 rows of 4096 values at a time: one yield passes 1 MB
    last = (129280 - 1) % 1024 * row  # where the last row's bytes were drawn
    assert (data[drawn:2 * drawn] == data[:drawn]).all() and (data[-row:] == data[last:last + row]).all()
    assert not (data[row:2 * row] == data[:row]).all()  # the drawn rows differ from one another
    w = weights.array("output.weight")
    assert abs(mx.std(w[:1000]).item() - mx.std(w[-1000:]).item()) < 0.05 * mx.std(w[:1000]).item()


def test_synthetic_tensors_are_valid_blocks_shared_between_layers():
    weights = synthetic_weights(flash_config(6))
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


@pytest.mark.parametrize("kind", ["q2", "q4"])
def test_full_layouts_are_refused_on_a_small_device_before_building(kind, capsys):
    from ds4_mlx.model.linear import loaded_nbytes

    assert main(["bench", "--synthetic", kind, "--ctx-max", "2048", "--memory-limit", "24G"]) == 1
    need = loaded_nbytes(synthetic_weights(flash_config(43), kind))
    assert capsys.readouterr().err == (
        f"ds4-mlx bench: error: the model needs {need / 1024**3:.1f} GiB for its weights but this device can "
        "hold 24.0 GiB; no context size fits\n"
    )
    assert need / 1024**3 > (140 if kind == "q4" else 80)


def test_load_paths_move_the_bytes_exactly(tmp_path, capsys):
    """bench/load_paths.py (the staging paths compared on the GPU machine) checks every chunk it moves."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("load_paths", Path(__file__).parents[1] / "bench" / "load_paths.py")
    load_paths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_paths)
    data = tmp_path / "data.bin"
    data.write_bytes(np.random.default_rng(0).integers(0, 256, 34 << 20, dtype=np.uint8).tobytes())
    # 32 MiB chunks: the threaded copy splits chunks of 16 MiB and more
    assert load_paths.main([str(data), "--gb", "1", "--chunk-mb", "32", "--threads", "2", "--json"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["path"], r["threads"]) for r in runs] == [("array", 1), ("load", 1), ("load", 2)]
    assert all(r["gb"] == 34 * 2**20 / 1e9 and r["gb_per_second"] > 0 for r in runs)
    view = load_paths.NpyView(np.arange(100, dtype=np.uint8))
    view.seek(-10, 2)
    buffer = bytearray(10)
    assert view.readinto(buffer) == 10 and list(buffer) == list(range(90, 100))


@pytest.mark.slow
def test_one_flash_layer_runs():
    """A single full-size layer (3.5 GB of weights) through a short walk; minutes on a laptop CPU."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["bench", "--synthetic", "q2", "--layers", "1", "--ctx-start", "8", "--ctx-max", "8",
                     "--gen-tokens", "1", "--json", "-q"]) == 0
    result = json.loads(stdout.getvalue())
    assert result["frontiers"][0]["prefill_tps"] > 0 and result["frontiers"][0]["gen_tps"] > 0
    assert result["weights_bytes"] > 3 * 1024**3


def _arrays(obj, seen=None) -> list[mx.array]:
    """Every array an object of the model holds, in attribute order."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        return [obj]
    if id(obj) in seen or not (isinstance(obj, (list, tuple, dict)) or type(obj).__module__.startswith("ds4_mlx")):
        return []
    seen.add(id(obj))
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else vars(obj).values()
    return [a for v in values for a in _arrays(v, seen)]


def test_synthetic_layers_copy_their_twins_on_the_device(monkeypatch):
    """Layers of a synthetic layout share their random draws; the loader copies the first layer's resident arrays
    instead of moving the same bytes again. The model must be the one a plain read of every tensor makes, each
    layer with its own arrays."""
    from ds4_mlx.model.factory import preset_config
    from ds4_mlx.model.model import Model
    from ds4_mlx.model.synthetic import SyntheticFile

    config = preset_config("tiny")
    copied = Model(synthetic_weights(config))
    monkeypatch.setattr(SyntheticFile, "twin", lambda self, name: None)
    read = Model(synthetic_weights(config))
    assert copied.load_stats.resident_bytes == read.load_stats.resident_bytes
    pairs = list(zip(_arrays(copied.blocks), _arrays(read.blocks), strict=True))
    assert len(pairs) > 20
    for x, y in pairs:
        assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
    first, second = _arrays(copied.blocks[1]), _arrays(copied.blocks[2])
    assert first and all(x is not y for x in first for y in second)


def test_ops_for_a_gpu_backend_counts_kernel_launches_on_the_cpu(model_path, walked, capsys):
    assert main(["bench", "-m", str(model_path), "--ctx-start", "16", "--ctx-max", "16", "--ops-for", "cuda",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    ops, on_cpu = planned["decode_ops"], walked[0]["decode_ops"]
    assert planned["planned_for"] == "cuda" and len(ops["kernels_per_layer"]) == 6
    assert ops["by_primitive"]["CustomKernel"] > 0 and "CustomKernel" not in on_cpu["by_primitive"]
    assert sum(ops["last_layer"].values()) == ops["per_layer"][-1]
    assert ops["kernels"] < on_cpu["kernels"]  # each kernel stands for the several ops of its reference


# --------------------------------------------------------------------------------------------------------------
# --mtp: what speculative greedy decoding costs at each frontier

MTP_DRAFT = 3


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """A tiny model and its MTP draft file, written by `ds4-mlx make-model --mtp`."""
    root = tmp_path_factory.mktemp("bench-mtp")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["make-model", str(root / "tiny.gguf"), "--preset", "tiny", "--mtp", str(root / "mtp.gguf")]) == 0
    return root / "tiny.gguf", root / "mtp.gguf"


@pytest.fixture(scope="module")
def mtp_walked(mtp_pair, tmp_path_factory):
    """One --mtp bench run (two timed calls per figure): (JSON result, stderr, CSV header, CSV rows)."""
    csv_path = tmp_path_factory.mktemp("bench-mtp-out") / "walk.csv"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setattr("ds4_mlx.commands.bench.MTP_CALLS", 2)
        assert main(["bench", "-m", str(mtp_pair[0]), "--mtp", str(mtp_pair[1]), "--mtp-draft", str(MTP_DRAFT),
                     "--mtp-margin", "0", "--ctx-start", "16", "--ctx-max", "16", "--gen-tokens", "4", "--json",
                     "--csv", str(csv_path)]) == 0
    with open(csv_path, newline="") as f:
        header = next(csv.reader(f))
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return json.loads(stdout.getvalue()), stderr.getvalue(), header, rows


def test_mtp_figures_in_json_and_csv(mtp_walked):
    result, stderr, header, rows = mtp_walked
    assert result["ctx"] == 16 + 4
    mtp = result["mtp"]
    assert (mtp["drafter"], mtp["draft"], mtp["margin"], mtp["calls"]) == ("MTP", MTP_DRAFT, 0, 2)
    assert mtp["weights_bytes"] > 0
    (f,) = result["frontiers"]
    for key in ("decode_step_ms", "verify_1_ms", "verify_n_ms", "draft_ms", "spec_tps", "gen_tps", "prefill_tps"):
        assert f[key] > 0, key
    assert f["spec_tps_min"] == f["spec_tps"] == f["spec_tps_max"]  # one walk
    assert (f["verify_tokens"], f["draft_tokens"]) == (MTP_DRAFT, MTP_DRAFT - 1)
    assert 0 <= f["mtp_acceptance"] <= 1
    assert header == [*CSV_COLUMNS, *MTP_COLUMNS]  # ds4-bench's columns first, unchanged
    assert rows == [{k: str(v) for k, v in row.items()} for row in result["frontiers"]]
    (line,) = [line for line in stderr.splitlines() if ", ctx " in line]
    assert ", decode 4 tokens at " in line and ", speculative " in line and "MTP guesses accepted " in line


@pytest.fixture
def mtp_engine(mtp_pair):
    return Engine.load(mtp_pair[0], 40, mtp=mtp_pair[1], mtp_draft=MTP_DRAFT, quiet=True)


def test_verify_call_gives_logits_for_every_token_of_the_block(mtp_engine):
    session = mtp_engine.session
    prompt = prompt_ids(mtp_engine.tokenizer, read_prompt(None), 12)
    session.prefill(prompt[:8])
    at = session.snapshot()
    logits = verify_call(session, prompt[8:8 + MTP_DRAFT])
    assert logits.shape == (MTP_DRAFT, mtp_engine.model.config.n_vocab)
    session.restore(at)
    for i, token in enumerate(prompt[8:8 + MTP_DRAFT]):  # row i: the logits after the block's token i
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(session.decode(token)), atol=1e-4)


def test_mtp_walk_leaves_the_session_on_the_prompt(mtp_engine, mtp_pair, monkeypatch, capsys):
    monkeypatch.setattr("ds4_mlx.commands.bench.MTP_CALLS", 1)
    session = mtp_engine.session
    prompt = prompt_ids(mtp_engine.tokenizer, read_prompt(None), 16)
    host = {"peak_rss_bytes": 1, "peak_anon_bytes_sampled": 1, "available_before_bytes": None,
            "min_available_bytes": None}
    loaded = Loaded("tiny", session, mtp_engine.tokenizer, 1.0, 1, host)
    walk = Walk((8, 16), 2, 2, mtp_draft=2, mtp_margin=0.0)
    results, _ = run_walk(loaded, walk, prompt)
    assert session.tokens == prompt and session.mtp is not None  # every probe and timed call was rolled back
    fresh = Engine.load(mtp_pair[0], 40, mtp=mtp_pair[1], mtp_draft=2, quiet=True).session
    fresh.prefill(prompt[:8])
    fresh.prefill(prompt[8:])
    np.testing.assert_allclose(np.asarray(session.mtp_cache.hidden), np.asarray(fresh.mtp_cache.hidden), atol=1e-5)
    for r in results:
        figures = r.mtp
        assert len(figures.step_s) == len(figures.verify_n_s) == len(figures.spec_tps) == 2  # one call, two walks
        assert r.row()["verify_tokens"] == 2 and 0 <= r.row()["mtp_acceptance"] <= 1
    report(loaded, walk, results, None, as_json=False)
    text = capsys.readouterr().out
    assert "MTP t/s" in text and "one MTP draft of 1 guess (" in text
    console = Console(file=io.StringIO(), width=200)
    console.print(mtp_table(results, walk))
    table = console.file.getvalue()
    assert "verify 2 ms" in table and len([x for x in table.splitlines() if "│" in x]) == 2  # one row a frontier
    with pytest.raises(ValueError, match="no MTP draft block"):
        run_walk(Loaded("tiny", Engine.load(mtp_pair[0], 40).session, mtp_engine.tokenizer, 1.0, 1, {}), walk, prompt)


def test_speculative_probe_decodes_greedily_and_counts_guesses(mtp_engine, monkeypatch):
    """With an MTP block that guesses the greedy continuation, every guess is accepted, and the probe feeds the
    tokens plain greedy decoding feeds, several per model call."""
    session, eos = mtp_engine.session, mtp_engine.tokenizer.eos_id
    no_eos = mx.where(mx.arange(mtp_engine.model.config.n_vocab) == eos, -mx.inf, 0.0)

    def greedy(logits: mx.array) -> int:
        return int(mx.argmax(logits + no_eos).item())

    prompt = prompt_ids(mtp_engine.tokenizer, read_prompt(None), 10)
    session.prefill(prompt)
    at = session.snapshot()
    token = greedy(session.logits)
    plain = [token]
    for _ in range(6):
        plain.append(greedy(session.decode(plain[-1])))
    session.restore(at)
    sequence = [*prompt, *plain]
    real = MTP.__call__

    def oracle(self, tokens, hidden, position, cache):
        _, streams = real(self, tokens, hidden, position, cache)
        target = position + tokens.size
        guess = sequence[target] if target < len(sequence) else 0
        cache.logits = mx.where(mx.arange(self.config.n_vocab) == guess, 100.0, -100.0)
        return cache.logits, streams

    monkeypatch.setattr(MTP, "__call__", oracle)
    session.reset()
    session.prefill(prompt)  # the block now follows the prompt with the oracle's guesses
    calls = []
    monkeypatch.setattr(session, "_verify", lambda block, real=session._verify: calls.append(block) or real(block))
    seconds, drafted, accepted = speculative_probe(session, token, 6, MTP_DRAFT, 0.0, greedy, eos)
    assert session.tokens == [*prompt, *plain[:6]]
    assert seconds > 0 and drafted == accepted == 6 and [len(block) for block in calls] == [3, 3]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--synthetic", "q2", "--mtp", "m.gguf", "--mtp-draft", "2"],
         "--mtp needs a model file: --synthetic has no MTP draft file (make-model --preset flash --mtp FILE writes "
         "a matching pair; see bench/README.md)"),
        (["--mtp", "m.gguf"], "--mtp needs --mtp-draft N (N >= 2): bench measures verify calls over N tokens"),
        (["--mtp-draft", "3"], "--mtp-draft 3 needs an MTP draft file: --mtp FILE"),
        (["--mtp", "m.gguf", "--mtp-draft", "2", "--ops-for", "cuda"],
         "--ops-for counts the plain decode step only: --mtp is unused there"),
        (["--mtp", "m.gguf", "--mtp-draft", "4", "--gen-tokens", "2", "--ctx-max", "64", "--ctx-start", "64",
          "-c", "67"], "--ctx 67 is too small for the walk: the last frontier 64 + --mtp-draft 4 need 68"),
    ],
)
def test_bench_refuses_mtp_flags_as_usage_errors(flags, message, capsys):
    assert main(["bench", "-m", "/nonexistent.gguf", *flags]) == 2
    assert capsys.readouterr().err == f"ds4-mlx bench: error: {message}\n"


def test_help_states_the_prefill_chunks_the_session_takes(capsys):
    """`--prefill-chunk`'s help gives the session's own sizes (session.prefill_chunk_for), not an older one."""
    from ds4_mlx.model.model import DEFAULT_PREFILL_CHUNK
    from ds4_mlx.session import CUDA_DEEP_CHUNK, CUDA_PREFILL_CHUNK, DEEP_CONTEXT

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (f"{CUDA_PREFILL_CHUNK} on CUDA, {CUDA_DEEP_CHUNK} there for a context past {DEEP_CONTEXT}, ds4's "
            f"{DEFAULT_PREFILL_CHUNK} elsewhere") in text
    assert "shortened where device memory is short" in text


def test_parallel_decodes_streams_together_and_leaves_the_walk_as_it_was(model_path, tmp_path, capsys):
    """--parallel 3: each frontier's row adds the aggregate and per-stream t/s of three sessions decoding together
    (the columns after ds4-bench's), and the walk's own figures and sessions are those of a plain walk."""
    csv_path = tmp_path / "parallel.csv"
    assert main(["bench", "-m", str(model_path), "--ctx-start", "16", "--ctx-max", "32", "--step-incr", "16",
                 "--gen-tokens", "3", "--parallel", "3", "--json", "-q", "--csv", str(csv_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    for row in result["frontiers"]:
        assert row["parallel"] == 3 and row["parallel_tps"] > 0
        assert row["parallel_stream_tps"] == pytest.approx(row["parallel_tps"] / 3, abs=1e-3)
    with open(csv_path, newline="") as f:
        header = next(csv.reader(f))
    assert header[: len(CSV_COLUMNS)] == list(CSV_COLUMNS) and header[len(CSV_COLUMNS):][:3] == [
        "parallel", "parallel_tps", "parallel_stream_tps"]


def test_parallel_streams_feed_different_tokens_and_end_at_the_frontier(model_path):
    from ds4_mlx.commands.bench_parallel import measure

    engine = Engine.load(model_path, 128, parallel=3)
    sessions = [lane.session for lane in engine.lanes]
    sessions[0].prefill(list(range(5, 25)))
    at = sessions[0].snapshot()
    seconds = measure(sessions, at, [7, 8, 9], 4, never=engine.tokenizer.eos_id)
    assert seconds > 0
    assert all(s.tokens == list(range(5, 25)) for s in sessions)  # each left at the frontier
