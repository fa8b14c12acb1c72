"""`ds4-mlx inspect`: the report for valid files and one error line, without a traceback, for bad ones."""

from __future__ import annotations

import re

import pytest

from ds4_mlx.cli import main
from ds4_mlx.commands.inspect import format_bytes
from ds4_mlx.model.config import FLASH, memory_estimate
from ds4_mlx.model.linear import loaded_forms, loaded_nbytes
from ds4_mlx.model.weights import open_weights

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
    assert "memory at ctx 4096, weights as loaded on the cpu backend\n" in out


@pytest.fixture(scope="module")
def flash_path(tmp_path_factory):
    return write(model_spec(FLASH, "q2"), tmp_path_factory.mktemp("flash") / "flash.gguf")


def test_flash_report_totals(flash_path, capsys, on_cpu):
    rc, out, _ = _inspect(capsys, flash_path)
    assert rc == 0
    assert "variant q2" in out and "1328 tensors" in out
    assert re.search(r"layers 0-42 +gate/up IQ2_XXS +down Q2_K", out)
    state = memory_estimate(FLASH, 32768)
    assert re.search(rf"compressed rows +{re.escape(format_bytes(state.compressed))}$", out, re.M)
    loaded = loaded_nbytes(open_weights(flash_path))
    assert re.search(rf"^  weights +{re.escape(format_bytes(loaded))}  \(80.76 GiB in the file\)$", out, re.M)
    total = re.search(r"total +(\S+) GiB$", out, re.M)
    assert total and float(total.group(1)) == pytest.approx((loaded + state.total) / 2**30, abs=0.01)


def test_weights_breakdown_explains_the_difference_from_the_file(flash_path, capsys, on_cpu):
    """Each form's line gives its bytes as loaded; they add up to the weights line, and what they say they hold in
    the file adds up to the file's tensor bytes (affine: the file's bytes + 8 bytes per 32 values)."""
    weights = open_weights(flash_path)
    forms = loaded_forms(weights)
    _, out, _ = _inspect(capsys, flash_path)
    held = dict(re.findall(r"^    (affine|float16|float32|raw) +(\S+ \S+)  ", out, re.M))
    assert held == {form: format_bytes(b) for form, (a, b) in forms.items() if a}
    assert sum(a for a, _ in forms.values()) == weights.nbytes
    assert sum(b for _, b in forms.values()) == loaded_nbytes(weights) > weights.nbytes
    stored, converted = forms["affine"]
    assert f"the file's {format_bytes(stored)} + a float32 scale and bias per 32 values" in out
    q8_values = stored // 34 * 32  # only Q8_0 tensors take the affine form in a q2 file: 34 bytes per 32 values
    assert converted == q8_values + q8_values // 32 * 8


def test_run_checks_memory_with_the_figure_inspect_shows(flash_path, capsys, on_cpu):
    """`run`'s memory check counts the weights exactly as `inspect` does (82.9 GiB, not the file's 80.76)."""
    loaded = loaded_nbytes(open_weights(flash_path))
    assert main(["run", "-m", str(flash_path), "--memory-limit", "64G", "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"the model needs {loaded / 2**30:.1f} GiB for its weights" in err
    _, out, _ = _inspect(capsys, flash_path)
    shown = re.search(r"^  weights +(\S+) GiB  ", out, re.M).group(1)
    assert f"{float(shown):.1f}" == f"{loaded / 2**30:.1f}" and shown != "80.76"


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
    assert "argument -c/--ctx: expected a number of tokens from 1 to 1048576, got '0'" in capsys.readouterr().err


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * 2**20, int(80.76 * 2**30))] == [
        "512 B", "2.00 KiB", "3.00 MiB", "80.76 GiB"]


def test_the_file_is_taken_positionally_or_with_m(tmp_path, capsys, monkeypatch):
    """`inspect FILE`, `inspect -m FILE` (as every other command takes it) and, with neither, ./ds4flash.gguf."""
    path = write(model_spec(TINY), tmp_path / "tiny.gguf")
    rc, positional, _ = _inspect(capsys, path)
    assert rc == 0 and "GGUF v3" in positional
    rc, out, err = _inspect(capsys, "-m", path)
    assert rc == 0 and err == "" and out == positional
    rc, out, err = _inspect(capsys, path, "-m", path)
    assert rc == 0 and out == positional
    rc, out, err = _inspect(capsys, path, "-m", tmp_path / "other.gguf")
    assert rc == 2 and out == "" and err.startswith("ds4-mlx inspect: error: two files given") and err.count("\n") == 1
    monkeypatch.chdir(tmp_path)
    rc, out, err = _inspect(capsys)
    assert rc == 1 and "no model file at ds4flash.gguf" in err


def test_a_main_model_given_as_mtp_is_named_as_such(tmp_path, capsys):
    main_path = write(model_spec(TINY), tmp_path / "tiny.gguf")
    rc, out, err = _inspect(capsys, main_path, "--mtp", main_path)
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "unsupported --mtp file tiny.gguf: expected legacy MTP tensors" in err


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`ds4-mlx inspect FILE | head -1`: the reader goes away before the report is written; no traceback, and the
    exit status a shell gives a process ended by SIGPIPE."""
    import subprocess
    import sys

    path = write(model_spec(TINY), tmp_path / "tiny.gguf")
    proc = subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "inspect", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # nobody reads: the first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""
