"""The fused routed-expert kernels (kernels/decode/experts.py): gate + up + SwiGLU in one launch, down + slot sum in
another.

On the CPU the tests check what can be checked without a GPU: the two renderings of each definition, the IQ2_XXS
lookup tables and byte permutes against ggml's grid, the activation layouts, the launch plans, and that the CPU
keeps today's path (test_kernels_emulated.py runs the CUDA text on the CPU). The `gpu`-marked tests compare the
kernels with their references at Flash's shapes through MLX on the device, and check that the decode path uses
them.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import IQ2_XXS

from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.decode.experts import (BIAS, DEFAULT_SHARED_BYTES, GATE_UP_TOLERANCE, SHARED_BYTES,
                                     SIGNED_MAGNITUDES, TOLERANCE, UNITS, WORDS, Plan, down_plan, down_sum_kernel,
                                     gate_up_kernel, gate_up_plan, grid_nibbles, sign_nibbles)
from ds4_mlx.kernels.decode.fused_norm import probe_norm
from ds4_mlx.kernels.decode.matvec import gathered_reference
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.linear import ExpertBank
from ds4_mlx.model.moe import DOWN_SUM, GATE_UP, RoutedExperts, sum_slots, weighted_swiglu
from ds4_mlx.model.weights import open_weights
from kernel_checks import balanced, rendered

pytestmark = pytest.mark.usefixtures("kernels_unforced")
IQ2, Q2K = GGMLType.IQ2_XXS, GGMLType.Q2_K
KERNELS = ([make(t, word) for make in (gate_up_kernel, down_sum_kernel) for t in UNITS for word in WORDS]
           + [gate_up_kernel(t, word, 1e-6) for t in UNITS for word in WORDS])  # and with the input norm
NEW_HELPERS = ("ds4_byte_perm", "ds4_magic_byte")
CUDA_ONLY = ("__shared__", "threadIdx", "blockIdx", "__syncthreads", "__shfl_xor_sync", "__device__", "__constant__")
METAL_ONLY = ("threadgroup", "simdgroup", "thread_index_in_simdgroup", "device ", "metal::", "constant ")




def without_spellings(target, text: str) -> str:
    spellings = sorted((s for s in target.words.values() if s), key=len, reverse=True)
    return " ".join(re.sub("|".join(map(re.escape, spellings)), " ", text).split())


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_one_definition_renders_for_cuda_and_metal(kernel):
    cuda, metal = rendered(kernel, CUDA), rendered(kernel, METAL)
    for out in (cuda, metal):
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"] + out["header"])
        assert "STAGE_WORD" not in out["source"] and "/*" not in out["source"]  # every placeholder filled
        assert balanced(out["source"]) and balanced(out["header"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
    assert not any(word in cuda["source"] + cuda["header"] for word in METAL_ONLY)
    assert not any(word in metal["source"] + metal["header"] for word in CUDA_ONLY)
    assert without_spellings(CUDA, cuda["source"]) == without_spellings(METAL, metal["source"])


def test_kernel_names_differ_by_type_and_word():
    """MLX names a compiled kernel after its name and template values only: variants must not share a name."""
    assert len({kernel.name for kernel in KERNELS}) == len(KERNELS)


def test_new_helpers_are_defined_by_both_preludes():
    for target in (CUDA, METAL):
        for helper in NEW_HELPERS:
            assert re.search(rf"\b{helper}\(", target.prelude), (target.name, helper)


def byte_perm(lo: np.ndarray, hi: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """PTX prmt (what ds4_byte_perm runs on CUDA) for selector nibbles below 8, elementwise."""
    source = (lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32)))
    out = np.zeros_like(selector, dtype=np.uint32)
    for n in range(4):
        nibble = (selector >> np.uint32(4 * n)) & np.uint32(15)
        assert (nibble < 8).all()  # bit 3 would replicate a sign bit instead of selecting a byte
        byte = (source >> (np.uint64(8) * nibble.astype(np.uint64))) & np.uint64(255)
        out |= byte.astype(np.uint32) << np.uint32(8 * n)
    return out


def test_lookup_tables_and_byte_permutes_give_ggml_signed_grid():
    """Every grid index with every sign pattern: the kernel's two lookups, permutes and bias give ggml's signed
    grid values (grid value times the sign bit of ksigns_iq2xs, parity bit included)."""
    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid).reshape(256, 8)
    ksigns = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)
    entry, pattern = np.meshgrid(np.arange(256), np.arange(128), indexing="ij")
    sel = np.array(grid_nibbles(), np.uint32)[entry] | np.array(sign_nibbles(), np.uint32)[pattern]
    positive, negative = (np.full(sel.shape, w, np.uint32) for w in SIGNED_MAGNITUDES)
    words = [byte_perm(positive, negative, half) for half in (sel & np.uint32(0xFFFF), sel >> np.uint32(16))]
    got = np.stack([(words[j // 4] >> np.uint32(8 * (j % 4))) & np.uint32(255) for j in range(8)], -1)
    signs = np.where((ksigns[pattern][..., None] >> np.arange(8)) & 1, -1.0, 1.0)
    np.testing.assert_array_equal(got.astype(np.float64) - BIAS, grid[entry] * signs)


def x_chunks(ggml_type: GGMLType, n_in: int) -> np.ndarray:
    """The unit layout's float4 index [unit, chunk], from the kernel's own C expression."""
    unit = UNITS[ggml_type]
    chunks = unit.values // 4
    return np.array([[eval(unit.x_chunk, {"xu": u, "xc": c}) for c in range(chunks)]
                     for u in range(n_in // unit.values)])


@pytest.mark.parametrize("ggml_type", [IQ2, Q2K], ids=lambda t: t.name)
def test_activation_layout_holds_each_value_once_in_unit_order(ggml_type):
    n_in = 1024
    index = x_chunks(ggml_type, n_in)
    assert sorted(index.reshape(-1).tolist()) == list(range(n_in // 4))
    # value p of unit u is the activation the reference multiplies by that unit's p-th quant
    values = (4 * index[..., None] + np.arange(4)).reshape(index.shape[0], -1)
    unit = np.arange(index.shape[0])[:, None]
    p = np.arange(UNITS[ggml_type].values)[None, :]
    if ggml_type == IQ2:  # sub-blocks of 32 in order
        want = 32 * unit + p
    else:  # unit 4b + 2h + t, p = 16j + l -> value 256b + 128h + 32j + 16t + l
        want = 256 * (unit >> 2) + 128 * ((unit >> 1) & 1) + 32 * (p >> 4) + 16 * (unit & 1) + (p & 15)
    np.testing.assert_array_equal(values, want)


@pytest.mark.parametrize("ggml_type", [IQ2, Q2K], ids=lambda t: t.name)
def test_swizzled_activations_are_read_without_bank_conflicts(ggml_type):
    """Eight lanes (a quarter SIMD group, one 16-byte load each) reading chunk c of consecutive units hit eight
    different groups of four banks."""
    chunks = UNITS[ggml_type].values // 4
    for first in range(0, 32, 8):
        for c in range(chunks):
            units = np.arange(first, first + 8)
            slots = units * chunks + ((c + units) & (chunks - 1))
            assert len(set((slots % 8).tolist())) == 8


def test_launch_plans_at_flash_shapes():
    cuda, metal = DEFAULT_SHARED_BYTES, SHARED_BYTES["metal"]
    # gate/up: x 16 KB + tables 1.5 KB + 8 SIMD groups x (gate, up) rows of 1056 bytes; 512 threadgroups per token
    assert gate_up_plan(IQ2, 2048, 4096, 6, cuda) == Plan(simds=8, rows=4, shared_bytes=34816)
    assert gate_up_plan(IQ2, 2048, 4096, 6, metal) == Plan(simds=4, rows=4, shared_bytes=26368)
    # down: h 8 KB + 8 SIMD groups x 2 rows of 672 bytes; 256 threadgroups per token
    assert down_plan(Q2K, 4096, 2048, cuda) == down_plan(Q2K, 4096, 2048, metal) == Plan(8, 16, 18944)
    # tiny: one row per threadgroup, no more SIMD groups than (slot, row) jobs
    assert gate_up_plan(IQ2, 256, 256, 2, cuda) == Plan(2, 1, 4 * 256 + 1536 + 2 * 2 * 66)
    assert down_plan(Q2K, 256, 256, cuda) == Plan(1, 1, 4 * 256 + 84)
    assert gate_up_plan(IQ2, 2048, 1 << 16, 6, cuda) is None  # the activations alone exceed threadgroup memory


def test_the_cpu_uses_the_references_without_a_check(on_cpu):
    shape = (3, 256, 256)
    gate, up, down = (random_blocks(t, 3 * 256, 256, seed=s).reshape(3, -1) for t, s in ((IQ2, 1), (IQ2, 2), (Q2K, 3)))
    ids = mx.array([[2, 0], [1, 1]], dtype=mx.int32)
    x = random_activations((2, 256), seed=4)
    w = mx.array([[0.5, 1.0], [1.5, 0.25]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not GATE_UP.enabled(IQ2, shape, 2, 10.0) and not DOWN_SUM.enabled(Q2K, shape, 2)
        h = GATE_UP(x, ids, w, gate, up, IQ2, shape, 10.0)
        y = DOWN_SUM(h, ids, down, Q2K, shape)
    assert GATE_UP.fast_path.decisions() == {} and DOWN_SUM.fast_path.decisions() == {}
    flat = ids.reshape(-1)
    xs = mx.repeat(x, 2, axis=0)
    assert mx.array_equal(h, weighted_swiglu(gathered_reference(xs, gate, flat, IQ2, shape),
                                             gathered_reference(xs, up, flat, IQ2, shape), w, 10.0))
    assert mx.array_equal(y, sum_slots(gathered_reference(h, down, flat, Q2K, shape), 2))


@pytest.fixture(scope="module")
def q2_experts(tmp_path_factory) -> RoutedExperts:
    path = write_model(tmp_path_factory.mktemp("experts") / "tiny-q2.gguf", preset="tiny", experts="q2", seed=3)
    weights = open_weights(path)
    prefix = "blk.3.ffn_"
    return RoutedExperts(gate=ExpertBank(weights, prefix + "gate_exps.weight"),
                         up=ExpertBank(weights, prefix + "up_exps.weight"),
                         down=ExpertBank(weights, prefix + "down_exps.weight"), clamp=10.0)


def test_gathered_experts_on_the_cpu_are_todays_formula(q2_experts, on_cpu):
    ids = mx.array([[1, 5], [5, 5], [0, 7]], dtype=mx.int32)
    x = random_activations((3, 256), seed=7)
    w = mx.array(np.random.default_rng(8).uniform(0.1, 1.5, (3, 2)).astype(np.float32))
    e = q2_experts
    assert e.gate.raw is not None and e.down.raw is not None
    flat = ids.reshape(-1).astype(mx.uint32)
    xs = mx.repeat(x, 2, axis=0)
    h = weighted_swiglu(e.gate(xs, flat), e.up(xs, flat), w, e.clamp)
    assert mx.array_equal(e._gathered(x, ids, w), sum_slots(e.down(h, flat), 2))


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)

FLASH_GATE = (2048, 4096)
FLASH_DOWN = (4096, 2048)
ROUTINGS = {
    "one_token_distinct": [[7, 0, 3, 5, 1, 6]],
    "one_token_repeated": [[3, 3, 1, 1, 3, 0]],
    "two_tokens": [[7, 0, 3, 5, 1, 6], [2, 2, 4, 0, 6, 2]],
}


def gate_up_case(ggml_type, n_out, n_in, routing, experts=8, seed=0) -> tuple:
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (experts, n_out, n_in)
    gate, up = (random_blocks(ggml_type, experts * n_out, n_in, seed=seed + s).reshape(experts, -1) for s in (1, 2))
    w = mx.array(np.random.default_rng(seed).uniform(0.1, 1.5, ids.shape).astype(np.float32))
    return random_activations((ids.shape[0], n_in), seed=seed + 3), ids, w, gate, up, ggml_type, shape, 10.0


def down_case(ggml_type, n_out, n_in, routing, experts=8, seed=0) -> tuple:
    ids = mx.array(np.array(routing, dtype=np.int32))
    shape = (experts, n_out, n_in)
    blocks = random_blocks(ggml_type, experts * n_out, n_in, seed=seed + 4).reshape(experts, -1)
    return random_activations((ids.size, n_in), seed=seed + 5), ids, blocks, ggml_type, shape


def relative_error(got: mx.array, want: mx.array) -> float:
    assert got.shape == want.shape and mx.all(mx.isfinite(got)).item()
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_flash_gate_up_kernel_equals_the_reference(on_gpu, routing):
    args = gate_up_case(IQ2, *FLASH_GATE, ROUTINGS[routing])
    assert relative_error(GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)) <= GATE_UP_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_flash_down_sum_kernel_equals_the_reference(on_gpu, routing):
    args = down_case(Q2K, *FLASH_DOWN, ROUTINGS[routing])
    assert relative_error(DOWN_SUM.fast_path.fast(*args), DOWN_SUM.fast_path.reference(*args)) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", [IQ2, Q2K], ids=lambda t: t.name)
@pytest.mark.parametrize("size", [(256, 256), (64, 512), (96, 1024), (512, 2048)], ids=str)
def test_both_types_and_staging_words_equal_the_reference(on_gpu, ggml_type, size):
    """Q2_K gate/up and IQ2_XXS down as well, rows staged in 2-, 4- and 16-byte words, k = 3 and 4."""
    routing = [[2, 0, 2, 1], [3, 3, 0, 1]] if size[1] <= 512 else [[1, 2, 0]]
    args = gate_up_case(ggml_type, *size, routing, experts=4)
    assert relative_error(GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)) <= GATE_UP_TOLERANCE
    args = down_case(ggml_type, *size, routing, experts=4)
    assert relative_error(DOWN_SUM.fast_path.fast(*args), DOWN_SUM.fast_path.reference(*args)) <= TOLERANCE


@pytest.mark.gpu
def test_first_use_checks_pass_on_the_gpu(on_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GATE_UP.enabled(IQ2, (256, *FLASH_GATE), 6, 10.0)
        assert DOWN_SUM.enabled(Q2K, (256, *FLASH_DOWN), 6)


@pytest.mark.gpu
def test_kernels_run_inside_a_compiled_function(on_gpu):
    x, ids, w, gate, up, _, shape, clamp = gate_up_case(IQ2, *FLASH_GATE, ROUTINGS["one_token_distinct"])
    h, _, down, _, down_shape = down_case(Q2K, *FLASH_DOWN, ROUTINGS["one_token_distinct"])

    def experts(x, ids, w):
        hidden = GATE_UP.fast_path.fast(x, ids, w, gate, up, IQ2, shape, clamp)
        return hidden, DOWN_SUM.fast_path.fast(hidden, ids, down, Q2K, down_shape)

    got_h, got_y = mx.compile(experts)(x, ids, w)
    want_h = GATE_UP.fast_path.reference(x, ids, w, gate, up, IQ2, shape, clamp)
    assert relative_error(got_h, want_h) <= GATE_UP_TOLERANCE
    assert relative_error(got_y, DOWN_SUM.fast_path.reference(got_h, ids, down, Q2K, down_shape)) <= TOLERANCE


@pytest.mark.gpu
def test_gathered_experts_take_the_fused_kernels_on_the_gpu(on_gpu, q2_experts):
    """RoutedExperts._gathered of a q2 file: two launches on the GPU, equal to the reference mode's path."""
    from ds4_mlx.kernels.machinery import registry

    ids = mx.array([[1, 5], [5, 5], [0, 7]], dtype=mx.int32)
    x = random_activations((3, 256), seed=7)
    w = mx.array(np.random.default_rng(8).uniform(0.1, 1.5, (3, 2)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = q2_experts._gathered(x, ids, w)
    assert all(d.fast for d in GATE_UP.fast_path.decisions().values()) and GATE_UP.fast_path.decisions()
    assert all(d.fast for d in DOWN_SUM.fast_path.decisions().values()) and DOWN_SUM.fast_path.decisions()
    with registry.forced_mode("reference"):
        want = q2_experts._gathered(x, ids, w)
    assert relative_error(got, want) <= GATE_UP_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_flash_gate_up_kernel_with_the_input_norm_equals_the_reference(on_gpu, routing):
    """ffn_norm folded into the gate/up kernel at Flash's shapes: rms_norm then today's reference, rows off unit rms;
    its first-use check passes."""
    x, *rest = gate_up_case(IQ2, *FLASH_GATE, ROUTINGS[routing])
    norm = probe_norm(FLASH_GATE[1], 1e-6, seed=9)
    args = (x * mx.linspace(3.0, 11.0, x.shape[0])[:, None], *rest, norm)
    assert relative_error(GATE_UP.fast_path.fast(*args), GATE_UP.fast_path.reference(*args)) <= GATE_UP_TOLERANCE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GATE_UP.enabled(IQ2, (256, *FLASH_GATE), 6, 10.0, norm)


@pytest.mark.gpu
def test_tiny_q2_decode_folds_ffn_norm_on_the_gpu(on_gpu, tmp_path, monkeypatch):
    """A tiny q2 model's decode step: the MoE's readers fold ffn_norm (the normed gate/up kernel used), one RMSNorm
    node fewer per layer than with the norm applied first, equal to the reference path within 1e-4."""
    from ds4_mlx.kernels.machinery import registry
    from ds4_mlx.model.graph import decode_step_ops
    from ds4_mlx.model.model import Model
    from ds4_mlx.model.moe import MoE

    weights = open_weights(write_model(tmp_path / "tiny-q2.gguf", preset="tiny", experts="q2", seed=3))
    tokens = np.random.default_rng(13).integers(0, weights.config.n_vocab, 26).astype(np.int32)

    def decode(m: Model) -> tuple[np.ndarray, dict]:
        cache = m.new_cache(64)
        m.prefill(mx.array(tokens[:20]), cache)
        counts = decode_step_ops(m, cache)
        return np.stack([np.array(m.decode(int(t), cache)[1]) for t in tokens[20:]]), counts

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model(weights, simulate_quant=False)
        fast, folded = decode(model)
    eps = float(model.config.rms_eps)
    normed = [d.fast for (_, key), d in GATE_UP.fast_path.decisions().items() if key[-1] == eps and len(key) == 6]
    assert normed and all(normed)
    x = mx.zeros((1, model.config.n_embd))
    layers = sum(block.moe.folds(x, (block.ffn_norm, block.eps)) for block in model.blocks)
    assert layers == len(model.blocks)

    with monkeypatch.context() as patch:
        patch.setattr(MoE, "folds", lambda self, x, norm: False)  # ffn_norm as its own op, as before
        _, separate = decode(Model(weights, simulate_quant=False))
    assert separate["by_primitive"].get("RMSNorm", 0) - folded["by_primitive"].get("RMSNorm", 0) == layers
    assert separate["kernels"] - folded["kernels"] == layers

    with registry.forced_mode("reference"):
        want, _ = decode(Model(weights, simulate_quant=False))
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()
