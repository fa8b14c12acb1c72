"""`ds4-mlx inspect`: the report for valid files and one error line, without a traceback, for bad ones."""

from __future__ import annotations

import re

import pytest

from ds4_mlx.cli import main
from ds4_mlx.commands.inspect import format_bytes
from ds4_mlx.model.config import FLASH, memory_estimate

from gguf_build import TINY, model_spec, mtp_spec, write


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_tiny_report(tmp_path, capsys):
    path = write(model_spec(TINY, ["q2"] * 4 + ["q4"] * 2), tmp_path / "tiny.gguf")
    rc, out, err = _inspect(capsys, path, "--ctx", "4096")
    assert rc == 0 and err == ""
    assert "GGUF v3, 178 tensors" in out
    assert "variant test model (6 layers, n_embd 256, 4 heads, 8 experts, vocab 512, mixed experts)" in out
    assert re.search(r"layers 0-3 +gate/up IQ2_XXS +down Q2_K", out)
    assert re.search(r"layers 4-5 +gate/up Q4_K +down Q4_K", out)
    assert "ratio 0 on 2 layers, ratio 4 on 2 layers, ratio 128 on 2 layers" in out
    assert re.search(r"^  IQ2_XXS +\d", out, re.M) and re.search(r"^  I32 +12.00 KiB$", out, re.M)
    assert "memory at ctx 4096\n" in out


def test_flash_report_totals(tmp_path, capsys):
    rc, out, _ = _inspect(capsys, write(model_spec(FLASH, "q2"), tmp_path / "flash.gguf"))
    assert rc == 0
    assert "variant q2" in out and "1328 tensors" in out
    assert re.search(r"layers 0-42 +gate/up IQ2_XXS +down Q2_K", out)
    state = memory_estimate(FLASH, 32768)
    assert re.search(rf"compressed rows +{re.escape(format_bytes(state.compressed))}$", out, re.M)
    assert re.search(r"weights +80.76 GiB$", out, re.M)
    total = re.search(r"total +(\S+) GiB$", out, re.M)
    assert total and float(total.group(1)) == pytest.approx(80.76 + state.total / 2**30, abs=0.01)


def test_mtp_is_validated_and_counted(tmp_path, capsys):
    main_path = write(model_spec(TINY), tmp_path / "tiny.gguf")
    mtp_path = write(mtp_spec(TINY), tmp_path / "mtp.gguf")
    rc, out, _ = _inspect(capsys, main_path, "--mtp", mtp_path)
    assert rc == 0 and "32 tensors" in out and "mtp q4" in out and "mtp raw ring" in out
    bad = mtp_spec(TINY)
    bad.drop("mtp.0.exp_probs_b.bias")
    rc, out, err = _inspect(capsys, main_path, "--mtp", write(bad, tmp_path / "bad-mtp.gguf"))
    assert rc == 1 and out == "" and "tensor mtp.0.exp_probs_b.bias is missing" in err


@pytest.mark.parametrize(("content", "message"), [
    (b"not a model at all", "is not a GGUF file: it starts with b'not '"),
    (b"GGUF\x02\x00\x00\x00" + b"\x00" * 16, "GGUF version 2, expected version 3"),
    (None, "no model file at"),
])
def test_bad_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    rc, out, err = _inspect(capsys, path)
    assert rc == 1 and out == ""
    assert err.startswith("ds4-mlx inspect: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_layout_error_is_one_line(tmp_path, capsys):
    spec = model_spec(TINY)
    spec.tensor("blk.2.attn_kv.weight").shape = (256, 64)
    rc, out, err = _inspect(capsys, write(spec, tmp_path / "bad.gguf"))
    assert rc == 1 and err.count("\n") == 1
    assert "tensor blk.2.attn_kv.weight has shape [256, 64], expected [256, 128]" in err


def test_ctx_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path / "x.gguf"), "--ctx", "0"])
    assert e.value.code == 2
    assert "must be a positive number of tokens" in capsys.readouterr().err


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * 2**20, int(80.76 * 2**30))] == [
        "512 B", "2.00 KiB", "3.00 MiB", "80.76 GiB"]
