"""The streaming loader (model/stream.py): tensors converted in batches and chunks give the same resident arrays as
converting them whole, every tensor is read once, the reader thread's guesses are used, and the host memory a
load adds stays near the model's loaded size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Loader, Model
from ds4_mlx.model.stream import TensorStream, to_device
from ds4_mlx.model.weights import open_weights

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("stream") / "tiny.gguf", preset="tiny", experts="mixed")


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 30])
def test_chunked_and_batched_loads_equal_the_whole_tensors(tiny_path, chunk_bytes):
    """4 KiB chunks split every matrix into many row ranges written in place; 1 GiB batches everything."""
    with open_weights(tiny_path) as weights:
        load = Loader(weights, chunk_bytes=chunk_bytes)
        q8 = load.linear("blk.1.attn_q_b.weight")  # Q8_0: affine
        head = load.linear("token_embd.weight")  # F16: dense
        q2 = load.experts("blk.0.ffn_down_exps.weight")  # Q2_K: raw blocks
        q4 = load.experts("blk.5.ffn_gate_exps.weight")  # Q4_K ("mixed": last third q4): affine
        tid2eid = load.dense("blk.0.ffn_gate_tid2eid.weight")  # I32
        norm = load.dense("blk.2.attn_norm.weight")  # F32
        stats = load.finish()
        ids = mx.arange(q2.n_expert)
        for got, name in ((q8.weight, "blk.1.attn_q_b.weight"), (head.weight, "token_embd.weight"),
                          (q2.experts(ids), "blk.0.ffn_down_exps.weight"),
                          (q4.experts(ids), "blk.5.ffn_gate_exps.weight"), (tid2eid, "blk.0.ffn_gate_tid2eid.weight"),
                          (norm, "blk.2.attn_norm.weight")):
            want = weights.array(name)
            assert got.shape == want.shape and got.dtype == want.dtype, name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        names = ("blk.1.attn_q_b.weight", "token_embd.weight", "blk.0.ffn_down_exps.weight",
                 "blk.5.ffn_gate_exps.weight", "blk.0.ffn_gate_tid2eid.weight", "blk.2.attn_norm.weight")
        assert stats.file_bytes == sum(weights.info(n).nbytes for n in names)
        assert stats.resident_bytes == load.nbytes > 0
        if chunk_bytes == 4096:
            assert stats.chunks > 50 and stats.evaluations > 50
        else:
            assert stats.evaluations == 1  # one batch: one evaluation for all six tensors


def test_weights_are_a_tensor_source_without_streaming(tiny_path):
    from ds4_mlx.model.linear import ExpertBank, Linear

    with open_weights(tiny_path) as weights:
        for name in ("blk.1.attn_kv.weight", "output.weight"):
            np.testing.assert_array_equal(np.asarray(Linear(weights, name).weight), np.asarray(weights.array(name)))
        bank = ExpertBank(weights, "blk.0.ffn_gate_exps.weight")
        np.testing.assert_array_equal(np.asarray(bank.experts(mx.arange(bank.n_expert))),
                                      np.asarray(weights.array("blk.0.ffn_gate_exps.weight")))


def test_a_model_load_reads_every_tensor_once_mostly_prefetched(tiny_path):
    with open_weights(tiny_path) as weights:
        model = Model(weights)
    stats = model.load_stats
    assert stats.file_bytes == weights.nbytes
    assert stats.resident_bytes == model.nbytes
    assert stats.prefetched > 0.8 * stats.chunks  # the reader guessed most tensors (each layer repeats the last)
    assert stats.seconds >= stats.device_seconds > 0


def test_progress_reports_bytes_as_they_become_resident(tiny_path):
    seen = []
    with open_weights(tiny_path) as weights:
        Model(weights, progress=lambda done, total: seen.append((done, total)))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (weights.nbytes, weights.nbytes)


def test_to_device_leaves_unified_memory_arrays_alone(on_cpu):
    a = mx.arange(4)
    assert to_device([a])[0] is a


def test_a_wrong_guess_is_dropped_and_the_tensor_copied_again(tiny_path):
    with open_weights(tiny_path) as weights:
        stream = TensorStream(weights, chunk_bytes=1 << 30)
        first = "blk.0.attn_norm.weight"
        stream.read(first, lambda rows: (rows,))  # no layer seen yet: guesses the next tensor in the file
        guess = stream._ahead[0][0]
        other = next(n for n in weights.file.tensors if n not in (first, guess) and "norm" in n)
        (raw,) = stream.read(other, lambda rows: (rows,))
        stats = stream.finish()
        np.testing.assert_array_equal(np.asarray(raw).reshape(-1), weights.tensor_bytes(other))
    assert stats.prefetched == 0 and stats.chunks == 2


_MEASURE = """
import json, sys
import mlx.core as mx
from ds4_mlx import hostmem
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

mx.set_default_device(mx.cpu)  # the CPU bound (a GPU backend's driver adds its own host memory at first use)
weights = open_weights(sys.argv[1])
for name in weights.file.tensors:  # map every page of the file now, so that file pages do not grow during the load
    int(weights.tensor_bytes(name)[::4096].sum())
before = hostmem.status()
assert hostmem.reset_peak()
model = Model(weights)
after = hostmem.status()
file_pages = before["RssFile"] + before["RssShmem"]
print(json.dumps({"added_peak": after["VmHWM"] - file_pages - before["RssAnon"], "model": model.nbytes,
                  "added_now": after["RssAnon"] - before["RssAnon"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_loading_small_adds_at_most_1_2x_the_model_in_anonymous_memory(tmp_path):
    """Peak anonymous memory a load adds, measured exactly in a fresh process: the whole file is mapped first, so
    its pages (RssFile/RssShmem) are in the peak RSS (VmHWM, reset just before the load) from the start and stay;
    VmHWM less those file pages less the anonymous memory before the load is then the load's anonymous peak, or
    more if the kernel dropped file pages meanwhile (never less: the bound errs towards failing)."""
    path = write_model(tmp_path / "small.gguf", preset="small")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    figures = json.loads(out.stdout)
    assert figures["model"] > 250e6  # small: ~280 MB loaded
    assert figures["added_peak"] <= 1.2 * figures["model"], figures
    assert figures["added_now"] <= 1.2 * figures["model"], figures
