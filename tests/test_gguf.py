"""The GGUF v3 reader: values and offsets agree with gguf-py's writer and reader; every malformed file is a GGUFError
that says what is wrong."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from ds4_mlx.errors import GGUFError, ModelFileMissing
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType, GGUFFile, TensorInfo

from gguf_build import F32, STR, U32, Spec, Tensor, ValueType, header_bytes, model_spec, write


def _write_with_gguf_py(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A file with every scalar type, numeric/string/bool arrays and three tensors, written by gguf-py."""
    w = gguf.GGUFWriter(str(path), "deepseek4")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("v.u8", 200)
    w.add_int8("v.i8", -100)
    w.add_uint16("v.u16", 60000)
    w.add_int16("v.i16", -30000)
    w.add_uint32("v.u32", 4_000_000_000)
    w.add_int32("v.i32", -2_000_000_000)
    w.add_float32("v.f32", 9.99999997e-07)
    w.add_bool("v.bool", True)
    w.add_string("v.str", "｜DSML｜ héllo")
    w.add_uint64("v.u64", 2**40 + 3)
    w.add_int64("v.i64", -(2**40))
    w.add_float64("v.f64", 1e-300)
    w.add_array("v.ints", [0, 0, 4, 128])
    w.add_array("v.floats", [10.0, 2.5])
    w.add_array("v.strings", ["a", "", "Ġthe", "<｜User｜>"])
    w.add_array("v.bools", [True, False, True])
    rng = np.random.default_rng(0)
    data = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.weight": rng.standard_normal((2, 64)).astype(np.float16),
        "c.weight": rng.integers(0, 2**31, (4, 6)).astype(np.int32),
    }
    for name, arr in data.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


def test_reads_what_gguf_py_writes(tmp_path):
    path = tmp_path / "values.gguf"
    data = _write_with_gguf_py(path)
    with GGUFFile.open(path) as f:
        md, types = f.metadata, f.metadata_types
        assert f.version == 3
        assert md["general.architecture"] == "deepseek4"
        expected = {
            "v.u8": (200, "u8"), "v.i8": (-100, "i8"), "v.u16": (60000, "u16"), "v.i16": (-30000, "i16"),
            "v.u32": (4_000_000_000, "u32"), "v.i32": (-2_000_000_000, "i32"), "v.bool": (True, "bool"),
            "v.str": ("｜DSML｜ héllo", "string"), "v.u64": (2**40 + 3, "u64"), "v.i64": (-(2**40), "i64"),
            "v.f64": (1e-300, "f64"),
        }
        for key, (value, type_name) in expected.items():
            assert md[key] == value and types[key] == type_name, key
        assert md["v.f32"] == np.float32(9.99999997e-07) and types["v.f32"] == "f32"
        assert types["v.ints"] == "array[i32]" and md["v.ints"].tolist() == [0, 0, 4, 128]
        assert types["v.floats"] == "array[f32]" and md["v.floats"].tolist() == [10.0, 2.5]
        assert types["v.strings"] == "array[string]" and md["v.strings"] == ["a", "", "Ġthe", "<｜User｜>"]
        assert types["v.bools"] == "array[bool]" and md["v.bools"].tolist() == [True, False, True]

        ref = gguf.GGUFReader(path)
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.shape == tuple(int(d) for d in t.shape)  # ne order, ne0 first
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            assert info.ggml_type == int(t.tensor_type)
        for name, arr in data.items():
            raw = f.tensor_bytes(name)
            assert raw.dtype == np.uint8 and not raw.flags.owndata
            np.testing.assert_array_equal(raw.view(arr.dtype).reshape(arr.shape), arr)


@pytest.mark.parametrize("alignment", [64, 256])
def test_honours_general_alignment(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    data = _write_with_gguf_py(path, alignment)
    with GGUFFile.open(path) as f:
        assert f.alignment == alignment and f.data_offset % alignment == 0
        assert all(t.offset % alignment == 0 for t in f.tensors.values())
        np.testing.assert_array_equal(f.tensor_bytes("c.weight").view(np.int32).reshape(4, 6), data["c.weight"])


def test_tensor_info_and_block_table():
    assert {t: BLOCK_SIZES[t] for t in GGMLType} == {
        GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q8_0: (32, 34), GGMLType.Q2_K: (256, 84),
        GGMLType.Q4_K: (256, 144), GGMLType.IQ2_XXS: (256, 66), GGMLType.I32: (1, 4), GGMLType.MXFP4: (32, 17)}
    info = TensorInfo("blk.0.ffn_gate_exps.weight", (4096, 2048, 256), GGMLType.IQ2_XXS, 0, 0)
    assert info.type_name == "IQ2_XXS" and info.row_bytes == 1056 and info.n_elements == 4096 * 2048 * 256


def test_string_array_of_vocabulary_size(tmp_path):
    tokens = [f"tok{i}" if i % 7 else "" for i in range(129280)]
    spec = Spec(metadata={"tokenizer.ggml.tokens": ((ValueType.ARRAY, STR), tokens)})
    with GGUFFile.open(write(spec, tmp_path / "vocab.gguf")) as f:
        assert f.metadata["tokenizer.ggml.tokens"] == tokens and f.tensors == {}


def _small_spec() -> Spec:
    return Spec(
        metadata={
            "general.architecture": (STR, "deepseek4"),
            "x.count": (U32, 7),
            "x.eps": (F32, 1e-6),
            "x.ratios": ((ValueType.ARRAY, U32), [0, 0, 4, 128]),
            "x.words": ((ValueType.ARRAY, STR), ["one", "two"]),
        },
        tensors=[Tensor("a.weight", (64, 2), GGMLType.F16), Tensor("b.weight", (32, 3), GGMLType.Q8_0),
                 Tensor("c.weight", (5,), GGMLType.F32)],
    )


def test_truncated_anywhere_is_a_gguf_error(tmp_path):
    """Cut a small file at every byte: each prefix fails with a GGUFError (never an IndexError or struct.error)."""
    full = write(_small_spec(), tmp_path / "full.gguf").read_bytes()
    with GGUFFile.open(tmp_path / "full.gguf") as f:
        assert len(f.tensors) == 3
    cut = tmp_path / "cut.gguf"
    for n in range(len(full)):
        cut.write_bytes(full[:n])
        with pytest.raises(GGUFError) as e:
            GGUFFile.open(cut)
        message = str(e.value)
        assert any(s in message for s in ("truncated", "too short", "past the end", "more than")), (n, message)


def test_truncated_model_directory_and_data(tmp_path):
    """The same on a full tiny layout, at sampled offsets through metadata, directory and tensor data."""
    full = write(model_spec(), tmp_path / "tiny.gguf").read_bytes()
    head, _ = header_bytes(model_spec())
    cut = tmp_path / "cut.gguf"
    for n in list(range(0, len(head), 97)) + [len(head) + 1, len(full) // 2, len(full) - 1]:
        cut.write_bytes(full[:n])
        with pytest.raises(GGUFError):
            GGUFFile.open(cut)


def test_data_past_end_names_tensor_end_and_size(tmp_path):
    path = write(_small_spec(), tmp_path / "short.gguf")
    with GGUFFile.open(path) as f:
        last = f.tensors["c.weight"]
    size = last.offset + last.nbytes - 4
    with open(path, "r+b") as fh:
        fh.truncate(size)
    with pytest.raises(GGUFError, match=rf"'c.weight' ends at byte {last.offset + last.nbytes}.*\({size} bytes\)"):
        GGUFFile.open(path)


def test_bad_magic_says_what_it_found(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b'{"a": 1}' + b"\0" * 100)
    with pytest.raises(GGUFError, match=r"not a GGUF file: it starts with b'd\\x00\\x00\\x00'.*expected b'GGUF'"):
        GGUFFile.open(path)


@pytest.mark.parametrize(("version", "hint"), [(2, "version 2,"), (1, "version 1,"), (3 << 24, "big-endian")])
def test_wrong_version(tmp_path, version, hint):
    spec = _small_spec()
    spec.version = version
    with pytest.raises(GGUFError, match=hint) as e:
        GGUFFile.open(write(spec, tmp_path / "v.gguf"))
    assert "expected version 3" in str(e.value)


def test_tiny_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="0 bytes long, too short"):
        GGUFFile.open(tmp_path / "empty.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGUF\x03\0")
    with pytest.raises(GGUFError, match="truncated in the header"):
        GGUFFile.open(tmp_path / "magic.gguf")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ModelFileMissing, match="no model file at"):
        GGUFFile.open(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFFile.open(tmp_path)


def _patched(spec: Spec, tmp_path: Path, at: int, fmt: str, value: int) -> Path:
    raw = bytearray(write(spec, tmp_path / "p.gguf").read_bytes())
    struct.pack_into(fmt, raw, at, value)
    (tmp_path / "p.gguf").write_bytes(bytes(raw))
    return tmp_path / "p.gguf"


@pytest.mark.parametrize(("at", "what"), [(8, "tensors"), (16, "metadata entries")])
def test_absurd_counts(tmp_path, at, what):
    path = _patched(_small_spec(), tmp_path, at, "<Q", 2**60)
    with pytest.raises(GGUFError, match=f"header claims {2**60} {what}"):
        GGUFFile.open(path)


def test_string_length_past_end(tmp_path):
    path = _patched(_small_spec(), tmp_path, 24, "<Q", 2**50)  # length of the first key
    with pytest.raises(GGUFError, match=f"metadata key #0 has length {2**50}, which runs past the end"):
        GGUFFile.open(path)


def test_string_array_entry_past_end(tmp_path):
    spec = Spec(metadata={"x.words": ((ValueType.ARRAY, STR), ["one", "two"])})
    # key (8 + 7), type (4), element type (4), count (8), then the first string's length
    path = _patched(spec, tmp_path, 24 + 15 + 4 + 4 + 8, "<Q", 10**9)
    with pytest.raises(GGUFError, match=r"'x.words'\[0\] has length 1000000000, which runs past the end"):
        GGUFFile.open(path)


def test_array_count_past_end(tmp_path):
    spec = Spec(metadata={"x.ratios": ((ValueType.ARRAY, U32), [1, 2])})
    path = _patched(spec, tmp_path, 24 + 16 + 4 + 4, "<Q", 10**12)
    with pytest.raises(GGUFError, match="'x.ratios' has 1000000000000 elements, which run past the end"):
        GGUFFile.open(path)


def test_unknown_value_type(tmp_path):
    spec = Spec(metadata={"x.count": (U32, 7)})
    path = _patched(spec, tmp_path, 24 + 15, "<I", 13)
    with pytest.raises(GGUFError, match="'x.count' has unknown value type 13"):
        GGUFFile.open(path)


def test_misaligned_offset(tmp_path):
    spec = _small_spec()
    spec.tensors[1].offset = 16 * 17
    with pytest.raises(GGUFError, match="'b.weight' has data offset 272, which is not a multiple of the alignment 32"):
        GGUFFile.open(write(spec, tmp_path / "m.gguf"))


def test_bad_alignment_value(tmp_path):
    spec = _small_spec()
    spec.metadata["general.alignment"] = (U32, 24)
    with pytest.raises(GGUFError, match="general.alignment is 24"):
        GGUFFile.open(write(spec, tmp_path / "a.gguf"))


def test_unknown_tensor_type_names_the_tensor(tmp_path):
    spec = _small_spec()
    raw = bytearray(write(spec, tmp_path / "t.gguf").read_bytes())
    name = b"a.weight"
    type_at = raw.index(name) + len(name) + 4 + 16  # n_dims, two ne
    struct.pack_into("<I", raw, type_at, 30)
    (tmp_path / "t.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match=r"tensor 'a.weight' has ggml type BF16 \(30\), expected one of F32, F16"):
        GGUFFile.open(tmp_path / "t.gguf")


def test_bad_dimensions(tmp_path):
    for shape, message in [((32, 0), "empty dimension"), ((48, 2), "rows of 48 elements, not a multiple of the "
                                                                  "Q8_0 block size 32")]:
        spec = _small_spec()
        spec.tensors[1] = Tensor("b.weight", (32, 3), GGMLType.Q8_0)
        raw = bytearray(write(spec, tmp_path / "d.gguf").read_bytes())
        struct.pack_into("<QQ", raw, raw.index(b"b.weight") + 8 + 4, *shape)
        (tmp_path / "d.gguf").write_bytes(bytes(raw))
        with pytest.raises(GGUFError, match=f"'b.weight' has .*{message}"):
            GGUFFile.open(tmp_path / "d.gguf")
    raw = bytearray(write(_small_spec(), tmp_path / "n.gguf").read_bytes())
    struct.pack_into("<I", raw, raw.index(b"a.weight") + 8, 9)
    (tmp_path / "n.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match="'a.weight' has 9 dimensions, expected 1..8"):
        GGUFFile.open(tmp_path / "n.gguf")


def test_duplicates(tmp_path):
    spec = _small_spec()
    spec.tensors.append(Tensor("a.weight", (64, 2), GGMLType.F16))
    with pytest.raises(GGUFError, match="tensor 'a.weight' appears twice"):
        GGUFFile.open(write(spec, tmp_path / "dup.gguf"))
    raw = write(_small_spec(), tmp_path / "k.gguf").read_bytes().replace(b"x.count", b"x.words")
    (tmp_path / "k.gguf").write_bytes(raw)
    with pytest.raises(GGUFError, match="metadata key 'x.words' appears twice"):
        GGUFFile.open(tmp_path / "k.gguf")


def test_close_with_live_views(tmp_path):
    f = GGUFFile.open(write(_small_spec(), tmp_path / "c.gguf"))
    view = f.tensor_bytes("c.weight")
    f.close()
    assert view.nbytes == 20  # the view keeps the mapping alive
    with pytest.raises(ValueError, match="closed"):
        f.tensor_bytes("c.weight")
