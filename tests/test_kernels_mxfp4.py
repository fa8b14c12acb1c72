"""MXFP4 expert banks repacked to MLX's mxfp4 form: exact dequantization for every scale byte and code, gathered
and grouped products within float32 reassociation of the reference (dequantize, then matmul), memory equal to the
file's bytes, and the tiny MXFP4 model giving the reference path's logits on the fast path.

REASSOCIATION (1e-5 of the largest output magnitude) is the bound of the other quantized matmuls: the products
read the same float32 weights as the reference, so only the summation order differs (~1e-7 per add over a few
hundred terms, with margin).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.cli import main
from ds4_mlx.kernels.decode import experts, matvec
from ds4_mlx.kernels.decode.fused_norm import probe_norm
from ds4_mlx.kernels.decode.matvec import TOLERANCE as MATVEC_TOLERANCE
from ds4_mlx.kernels.decode.mxfp4_matvec import MXFP4_MATVEC
from ds4_mlx.kernels.decode.matvec import gathered_reference
from ds4_mlx.kernels.formats.mxfp4 import MXFP4_GATHER, mx_nbytes, to_mx
from ds4_mlx.kernels.formats.quants import E2M1, dequantize, tensor_nbytes
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.prefill.grouped import MX_GROUPED, mx_grouped, sort_by_expert
from ds4_mlx.model import linear
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.graph import VIEWS, graph_nodes, ops_after_kernels
from ds4_mlx.model.linear import ExpertBank
from ds4_mlx.model.model import Model
from ds4_mlx.model.moe import DOWN_SUM, GATE_UP, RoutedExperts
from ds4_mlx.model.weights import open_weights
from emulated_cuda import emulated_build
from test_emulated_model import emulating  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("kernels_unforced")
T = GGMLType.MXFP4
REASSOCIATION = 1e-5
FLASH_GATE, FLASH_DOWN = (256, 2048, 4096), (256, 4096, 2048)


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def every_scale_and_code() -> np.ndarray:
    """256 x 2 blocks: each scale byte twice, once with codes 0..15 in values 0..15 and again in values 16..31 (so
    every code sits in both nibbles), the other half of each block a shuffled run of all codes."""
    rng = np.random.default_rng(41)
    blocks = np.zeros((512, 17), dtype=np.uint8)
    blocks[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 2)
    low = np.tile(np.arange(16, dtype=np.uint8), (512, 1))
    high = np.stack([rng.permutation(16).astype(np.uint8) for _ in range(512)])
    low[1::2], high[1::2] = high[1::2], low[1::2].copy()
    blocks[:, 1:] = low | (high << 4)
    return blocks


def test_repacking_keeps_every_value_for_every_scale_and_code(on_cpu):
    """Bit-exact with the reference (itself bit-exact with gguf's dequantizer): scale bytes 0 (2^-127, subnormal)
    to 255 (infinity, NaN for code 0), all 16 codes in both nibbles. Zeros may differ in sign (MLX decodes code 8
    as -0, ggml as +0) and assert_array_equal counts -0 == +0 and NaN == NaN, as no sum or product tells them
    apart."""
    raw = mx.array(every_scale_and_code())
    want = np.array(dequantize(raw.reshape(-1), T, (512, 32)))
    got = np.array(to_mx(raw, (512, 32)).dequantize())
    assert np.isnan(want).any() and np.isinf(want).any() and (want[0:2] != 0).sum() == 56  # extremes reached
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("position", [0, 1, 15, 16, 17, 31])
def test_each_value_lands_where_the_gguf_block_puts_it(on_cpu, position):
    """Value j of a block is the low nibble of code byte j (j < 16), else the high nibble of byte j - 16; MLX's
    packing reads value 2i and 2i + 1 from byte i. One code 7 (6.0) at `position` and zeros elsewhere."""
    block = np.zeros(17, dtype=np.uint8)
    block[0] = 127
    block[1 + position % 16] = 7 << (4 * (position // 16))
    got = np.array(to_mx(mx.array(block), (1, 32)).dequantize())[0]
    assert got[position] == E2M1[7] == 6.0 and np.count_nonzero(got) == 1


def test_layout_and_size_equal_the_file():
    """The form holds the file's 17 bytes per 32 values: no bigger than the raw blocks."""
    shape = (4, 3, 512)
    weight = to_mx(random_blocks(T, 12, 512), shape)
    assert weight.shape == shape
    assert weight.wq.dtype == mx.uint32 and weight.wq.shape == (4, 3, 64)
    assert weight.scales.dtype == mx.uint8 and weight.scales.shape == (4, 3, 16)
    assert weight.nbytes == mx_nbytes(shape) == tensor_nbytes(T, shape)


@pytest.mark.parametrize("pairs", [1, 7, 32])
def test_gathered_experts_equal_the_reference(on_cpu, pairs):
    shape = (5, 48, 256)
    raw = random_blocks(T, 5 * 48, 256, seed=42)
    ids = mx.array(np.random.default_rng(43).integers(0, 5, pairs).astype(np.uint32))
    x = random_activations((pairs, 256), seed=44)
    want = gathered_reference(x, raw, ids, T, shape)
    assert relative_error(to_mx(raw, shape).gather_matmul(x, ids), want) <= REASSOCIATION


def test_grouped_pairs_sorted_by_expert_equal_the_reference(on_cpu):
    """The prefill path over sorted pairs: on the CPU gather_qmm told that the ids are sorted, no scratch (the
    scratch fast path is for GPUs only)."""
    shape = (6, 64, 256)
    raw = random_blocks(T, 6 * 64, 256, seed=45)
    ids = mx.array(np.random.default_rng(46).integers(0, 6, (30, 2)).astype(np.int32))
    _, sorted_ids = sort_by_expert(ids)
    x = random_activations((60, 256), seed=47)
    assert not MX_GROUPED[mx.float32].enabled(T)
    got = mx_grouped(to_mx(raw, shape), x, sorted_ids)
    assert relative_error(got, gathered_reference(x, raw, sorted_ids, T, shape)) <= REASSOCIATION


def test_the_first_use_check_passes_on_the_cpu(on_cpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MXFP4_GATHER.enabled(T) and linear.uses_mx(T, FLASH_GATE)
        assert not MXFP4_MATVEC.enabled(*FLASH_GATE[1:])  # no custom kernels on the CPU
    assert not linear.uses_mx(GGMLType.Q4_K, FLASH_GATE)
    with registry.forced_mode("reference"):
        assert not linear.uses_mx(T, FLASH_GATE)


def test_gpu_backends_keep_the_banks_raw_for_the_kernels():
    """Where the raw-block kernels are taken (planned here for CUDA and Metal: every fast path written for them
    counts as passed), a bank stays as stored and the fused expert kernels read it."""
    for backend in ("cuda", "metal"):
        with registry.planning(backend):
            assert not linear.uses_mx(T, FLASH_GATE)
            assert GATE_UP.enabled(T, FLASH_GATE, 6, 10.0) and DOWN_SUM.enabled(T, FLASH_DOWN, 6)


# ---------------------------------------------------------------------------------------------------------------
# The tiny MXFP4 model (make-model --experts mxfp4)


@pytest.fixture(scope="module")
def mxfp4_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("mxfp4") / "tiny-mxfp4.gguf", preset="tiny", experts="mxfp4", seed=2)


@pytest.fixture(scope="module")
def mxfp4_weights(mxfp4_path):
    return open_weights(mxfp4_path)


def test_the_banks_are_held_in_the_files_bytes(on_cpu, mxfp4_weights):
    """loaded_forms counts every MXFP4 bank as the mxfp4 form at the file's size, and the model holds that."""
    forms = linear.loaded_forms(mxfp4_weights)
    banks = [info for info in mxfp4_weights.file.tensors.values() if info.ggml_type == T]
    assert len(banks) == 3 * mxfp4_weights.config.n_layer
    assert forms["mxfp4"] == (sum(b.nbytes for b in banks),) * 2 and forms["raw"] == (0, 0)
    fast = Model(mxfp4_weights)
    assert fast.nbytes == linear.loaded_nbytes(mxfp4_weights)
    experts = fast.blocks[0].moe.experts
    assert experts.down._mx is not None and experts.down.raw is None
    assert experts.down.nbytes == mxfp4_weights.info("blk.0.ffn_down_exps.weight").nbytes
    with registry.forced_mode("reference"):
        assert linear.loaded_forms(mxfp4_weights)["mxfp4"] == (0, 0)
        assert Model(mxfp4_weights).blocks[0].moe.experts.down._mx is None


def test_inspect_names_the_form(on_cpu, mxfp4_path, capsys):
    assert main(["inspect", str(mxfp4_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^    mxfp4 +\S+ \S+  MXFP4 experts in MLX's mxfp4 form", out, re.M)


def logits_prefill(model: Model, tokens: np.ndarray) -> np.ndarray:
    return np.array(model(mx.array(tokens), model.new_cache(64), all_logits=True))


def logits_decode(model: Model, tokens: np.ndarray) -> np.ndarray:
    cache = model.new_cache(64)
    return np.concatenate([np.array(model(mx.array(t[None]), cache, all_logits=True)) for t in tokens])


@pytest.mark.parametrize("run", [logits_prefill, logits_decode], ids=["prefill", "decode"])
def test_the_fast_path_gives_the_reference_logits(on_cpu, mxfp4_weights, run):
    """A 40-token chunk takes the grouped path (more pairs than moe.GATHER_LIMIT), decode the gathered one. Measured
    here: ~1e-6 of the largest logit, float32 reassociation through the layers; the fast model in the reference
    mode reproduces the reference model bit for bit, as its banks dequantize to the reference values."""
    tokens = np.random.default_rng(48).integers(0, mxfp4_weights.config.n_vocab, 40 if run is logits_prefill else 10)
    tokens = tokens.astype(np.int32)
    fast = Model(mxfp4_weights, simulate_quant=False)
    got = run(fast, tokens)
    with registry.forced_mode("reference"):
        want = run(Model(mxfp4_weights, simulate_quant=False), tokens)
        np.testing.assert_array_equal(run(fast, tokens), want)
    assert np.isfinite(got).all()
    assert relative_error(mx.array(got), mx.array(want)) <= REASSOCIATION


def test_grouped_banks_equal_one_product_per_pair(on_cpu, mxfp4_weights):
    """RoutedExperts' prefill path (three grouped products) against its decode path (one gathered product per
    pair), both over the mxfp4 form, and against the reference path."""
    experts = mxfp4_experts(mxfp4_weights)
    n_expert, _, n_embd = experts.gate.shape
    rng = np.random.default_rng(49)
    ids = mx.array(np.stack([rng.choice(n_expert, 2, replace=False) for _ in range(40)]).astype(np.int32))
    x = random_activations((40, n_embd), seed=50)
    w = mx.array(rng.uniform(0.1, 1.5, (40, 2)).astype(np.float32))
    grouped, gathered = experts._grouped(x, ids, w), experts._gathered(x, ids, w)
    with registry.forced_mode("reference"):
        reference = experts._gathered(x, ids, w)
    assert relative_error(grouped, gathered) <= REASSOCIATION
    assert relative_error(grouped, reference) <= REASSOCIATION


def mxfp4_experts(weights, layer: int = 2) -> RoutedExperts:
    prefix = f"blk.{layer}.ffn_"
    return RoutedExperts(*(ExpertBank(weights, prefix + f"{p}_exps.weight") for p in ("gate", "up", "down")),
                         clamp=10.0)


def test_a_decode_step_planned_for_cuda_is_two_kernel_launches(on_cpu, mxfp4_weights):
    """As CUDA builds it: raw banks, gate + up + SwiGLU in one launch and down + slot sum in another, no MLX op on
    their values (what the decode graphs replay: model/graph.py's ops_after_kernels)."""
    x = random_activations((1, mxfp4_weights.config.n_embd), seed=52)
    ids = mx.array([[0, 3]], dtype=mx.int32)
    w = mx.array([[0.7, 0.4]])
    mx.eval(x, ids, w)
    with registry.planning("cuda"):
        experts = mxfp4_experts(mxfp4_weights)
        assert experts.gate.raw is not None and experts.down.raw is not None
        y = experts._gathered(x, ids, w)
        names = Counter(name for name in graph_nodes([y]).values() if name not in VIEWS)
        assert names == {"CustomKernel": 2} and not ops_after_kernels([y])


def test_raw_banks_repacked_per_chunk_equal_the_reference(on_cpu, mxfp4_weights, monkeypatch):
    """The GPUs' prefill over raw banks (each bank repacked for the chunk, dequantized into the scratch, grouped
    GEMM), run here with the CPU admitted to the scratch path and the banks kept raw as a GPU keeps them."""
    monkeypatch.setattr(linear, "uses_mx", lambda ggml_type, shape: False)
    monkeypatch.setattr(MX_GROUPED[mx.float32], "backends", ("cpu",))
    repacked = []
    monkeypatch.setattr(linear, "mx_grouped",
                        lambda weight, *args: repacked.append(weight) or mx_grouped(weight, *args))
    experts = mxfp4_experts(mxfp4_weights)
    assert experts.gate.raw is not None
    n_expert, _, n_embd = experts.gate.shape
    rng = np.random.default_rng(53)
    ids = mx.array(np.stack([rng.choice(n_expert, 2, replace=False) for _ in range(40)]).astype(np.int32))
    x = random_activations((40, n_embd), seed=54)
    w = mx.array(rng.uniform(0.1, 1.5, (40, 2)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MX_GROUPED[mx.float32].enabled(T)
    got = experts._grouped(x, ids, w)
    assert len(repacked) == 3  # gate, up and down each repacked from their raw blocks
    with registry.forced_mode("reference"):
        want = experts._gathered(x, ids, w)
    assert relative_error(got, want) <= REASSOCIATION


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


@pytest.mark.gpu
def test_first_use_checks_pass_on_the_gpu(on_gpu):
    """At Flash's shapes and k = 6: the raw kernels (so the banks stay raw), the scratch prefill, and the mxfp4
    form's gather_qmm a GPU falls back to."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MXFP4_MATVEC.enabled(*FLASH_GATE[1:]) and MXFP4_MATVEC.enabled(*FLASH_DOWN[1:])
        assert GATE_UP.enabled(T, FLASH_GATE, 6, 10.0) and DOWN_SUM.enabled(T, FLASH_DOWN, 6)
        assert all(MX_GROUPED[dtype].enabled(T) for dtype in (mx.float32, mx.bfloat16))
        assert MXFP4_GATHER.enabled(T) and not linear.uses_mx(T, FLASH_GATE)


@pytest.mark.gpu
@pytest.mark.parametrize("run", [logits_prefill, logits_decode], ids=["prefill", "decode"])
def test_the_fast_path_gives_the_reference_logits_on_the_gpu(on_gpu, mxfp4_weights, run):
    tokens = np.random.default_rng(51).integers(0, mxfp4_weights.config.n_vocab, 40).astype(np.int32)
    got = run(Model(mxfp4_weights, simulate_quant=False), tokens)
    with registry.forced_mode("reference"):
        want = run(Model(mxfp4_weights, simulate_quant=False), tokens)
    assert relative_error(mx.array(got), mx.array(want)) <= REASSOCIATION


# ---------------------------------------------------------------------------------------------------------------
# The raw-block kernels' CUDA text, run on the CPU (emulated_cuda.py; slow: it compiles with g++)


@pytest.mark.slow
@pytest.mark.parametrize("size", [(40, 512), (24, 2048), (20, 4096), (8, 64)], ids=str)
def test_emulated_matvec_equals_the_reference(size, tmp_path, monkeypatch):
    """Rows staged by 16-byte loads (2048 and 4096 values: 1088 and 2176 bytes) and by 2-byte loads (512, 64), row
    counts that leave threadgroups partly idle, several experts and slots; as MXFP4_MATVEC launches it."""
    monkeypatch.setattr(matvec, "build", emulated_build(tmp_path))
    monkeypatch.setattr(matvec, "current_backend", lambda: "cuda")
    n_out, n_in = size
    shape = (3, n_out, n_in)
    blocks = random_blocks(T, 3 * n_out, n_in, seed=n_in).reshape(3, -1)
    ids = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    x = random_activations((4, n_in), seed=n_out)
    got = MXFP4_MATVEC.fast_path.fast(x, blocks, ids, shape)
    want = gathered_reference(x, blocks, ids, T, shape)
    assert np.isfinite(np.array(got)).all()  # every output row was written
    assert relative_error(got, want) <= MATVEC_TOLERANCE


FUSED_CASES = {  # (OUT, IN) and the (T, k) routing
    "two_tokens": ((64, 512), [[0, 2, 2, 1], [3, 3, 0, 1]]),
    "three_tokens": ((96, 1024), [[1, 2], [0, 0], [3, 1]]),
    "flash_width": ((256, 4096), [[3, 0, 1, 2, 2, 1]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_emulated_fused_expert_kernels_equal_their_references(case, normed, tmp_path, monkeypatch):
    """GateUpSwiglu (plain, and norming x as it stages it) and DownSum over MXFP4 banks, as their FastPaths launch
    them, against their references (the model's weighted SwiGLU and slot sum of gathered reference products), within
    the bounds experts.py states for them."""
    monkeypatch.setattr(experts, "build", emulated_build(tmp_path))
    monkeypatch.setattr(experts, "current_backend", lambda: "cuda")
    (n_out, n_in), routing = FUSED_CASES[case]
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (4, n_out, n_in)
    gate, up, down = (random_blocks(T, 4 * n_out, n_in, seed=s).reshape(4, -1) for s in (1, 2, 3))
    norm = probe_norm(n_in, 1e-6, seed=n_in) if normed else None
    x = random_activations((ids.shape[0], n_in), seed=4) * (4.0 if normed else 1.0)
    w = mx.array(np.random.default_rng(5).uniform(0.1, 1.5, ids.shape).astype(np.float32))
    args = (x, ids, w, gate, up, T, shape, 10.0, norm)
    got, want = GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)
    assert np.isfinite(np.array(got)).all()
    assert relative_error(got, want) <= experts.GATE_UP_TOLERANCE
    h = random_activations((ids.size, n_in), seed=6)
    got = DOWN_SUM.fast_path.fast(h, ids, down, T, shape)
    want = DOWN_SUM.fast_path.reference(h, ids, down, T, shape)
    assert np.isfinite(np.array(got)).all()
    assert relative_error(got, want) <= experts.TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("emulating", ["cuda"], indirect=True)
def test_tiny_mxfp4_model_through_the_emulated_cuda_kernels_equals_the_reference(emulating, mxfp4_weights):
    """The GPU route end to end, as test_emulated_model.py runs the q4 model: banks held raw, an 18-token chunk's
    experts repacked and multiplied by the grouped GEMM kernels, decode steps through the fused MXFP4 expert
    kernels; every check made at the tiny shapes (a fallback is an error). Within 1e-4 of the largest logit, the
    bound of that test: float32 reassociation in every kernel, through all layers."""
    tokens = np.random.default_rng(55).integers(0, mxfp4_weights.config.n_vocab, 20).astype(np.int32)
    model = Model(mxfp4_weights, simulate_quant=False)
    assert model.blocks[0].moe.experts.gate.raw is not None

    def logits(decode: bool) -> np.ndarray:
        cache = model.new_cache(64)
        model.prefill(mx.array(tokens[:18]), cache)
        if decode:
            return np.stack([np.array(model.decode(int(t), cache)[1]).reshape(-1) for t in tokens[18:]])
        return np.stack([np.array(model(mx.array(tokens[i:i + 1]), cache)).reshape(-1) for i in range(18, 20)])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = logits(decode=True)
    for fast_path in (GATE_UP.fast_path, DOWN_SUM.fast_path):  # the MXFP4 kernels were checked and taken
        assert any(backend == "cuda" and key[0] == T and decision.fast
                   for (backend, key), decision in fast_path.decisions().items())
    assert MX_GROUPED[mx.float32].decisions()[("cuda", T)].fast
    with registry.forced_mode("reference"):
        want = logits(decode=False)
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()
