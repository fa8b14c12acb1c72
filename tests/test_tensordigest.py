"""The digests of every tensor's bytes behind the model identity: computed once per file, cached under
the cache directory, used again only while the file is the same, and never in the way when the cache cannot be
written or is damaged."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ds4_mlx.cache import tensordigest
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.gguf import GGUFFile
from ds4_mlx.cache.tensordigest import compute_digests, tensor_digests


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "m.gguf", preset="tiny")


def digests_of(path: Path, cache: Path) -> dict[str, bytes]:
    with GGUFFile.open(path) as f:
        return tensor_digests(f, cache)


def test_every_byte_of_every_tensor_is_hashed(model):
    with GGUFFile.open(model) as f:
        digests = compute_digests(f)
        assert set(digests) == set(f.tensors)
        for name in ("blk.0.attn_norm.weight", "token_embd.weight", "blk.1.ffn_down_exps.weight"):
            assert digests[name] == hashlib.sha256(f.tensor_bytes(name).tobytes()).digest()


def test_a_second_start_reads_the_cache(model, tmp_path, monkeypatch):
    first = digests_of(model, tmp_path)
    (entry,) = tmp_path.glob("*.json")
    assert json.loads(entry.read_text())["path"] == str(model.resolve())

    def not_again(file):
        raise AssertionError("hashed again although the cache holds")

    monkeypatch.setattr(tensordigest, "compute_digests", not_again)
    assert digests_of(model, tmp_path) == first


def test_a_changed_file_is_hashed_again_even_with_its_old_mtime(model, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    cache = tmp_path / "digests"
    before = digests_of(copy, cache)
    st = os.stat(copy)
    with GGUFFile.open(copy) as f:
        offset = f.tensors["blk.0.attn_norm.weight"].offset + 600  # past the bytes the old fingerprint sampled
    with open(copy, "r+b") as out:
        out.seek(offset)
        out.write(b"\x12\x34\x56\x78")
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the ctime tells
    after = digests_of(copy, cache)
    assert after["blk.0.attn_norm.weight"] != before["blk.0.attn_norm.weight"]
    assert {n for n in after if after[n] != before[n]} == {"blk.0.attn_norm.weight"}
    assert digests_of(copy, cache) == after  # and the new digests are what is cached now


def test_an_unwritable_or_damaged_cache_only_costs_the_hashing(model, tmp_path):
    expected = digests_of(model, tmp_path / "good")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert digests_of(model, blocker / "digests") == expected  # cannot be created: computed, nothing raised
    (entry,) = (tmp_path / "good").glob("*.json")
    good = json.loads(entry.read_text())
    wrong = {**good, "tensors": {**good["tensors"], "blk.0.attn_norm.weight": "00" * 32}, "scheme": "older"}
    for damage in ("{", "[]", json.dumps({**good, "tensors": {"x": "zz"}}), json.dumps(wrong)):
        entry.write_text(damage)
        assert digests_of(model, tmp_path / "good") == expected


def test_the_default_cache_dir_follows_xdg_and_the_override(monkeypatch, tmp_path):
    monkeypatch.delenv("DS4_MLX_DIGEST_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tensordigest.digest_dir() == tmp_path / "ds4-mlx" / "digests"
    monkeypatch.setenv("DS4_MLX_DIGEST_DIR", str(tmp_path / "elsewhere"))
    assert tensordigest.digest_dir() == tmp_path / "elsewhere"
