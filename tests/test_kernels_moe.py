"""The MoE sublayer's decode launches (model/moe.py): the shared expert in two, its gate and up read as one matrix
(FusedLinear.joined) and its SwiGLU folded into down's launch (SwigluMatvec, kernels/decode/affine_matvec.py), and a
hash layer's router in one (HashRoute, kernels/decode/router.py).

On the CPU: the model's results unchanged bit for bit (the references are its formulas), the launch counts as a
CUDA backend would build them, the kernels' renderings and (`slow`) their CUDA text run by the g++ emulation
(emulated_cuda.py) at Flash's shapes and small odd ones. On the GPU (`pytest -m gpu`): the kernels used at Flash's
shapes and equal to their references, and decode of the tiny model equal to the reference path.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.decode import affine_matvec, router
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.decode.affine_matvec import (AFFINE_MATVEC, KERNEL, TOLERANCE, launch_plan, norm_kernel,
    swiglu_kernel)
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.decode.fused_norm import apply, probe_norm
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.formats.quants import dequantize
from ds4_mlx.kernels.decode.router import TOLERANCE as ROUTE_TOLERANCE
from ds4_mlx.kernels.decode.router import hash_route_kernel
from ds4_mlx.model.gguf import GGMLType
from ds4_mlx.model.graph import VIEWS, graph_nodes
from ds4_mlx.model import linear
from ds4_mlx.model.linear import FUSED_TOKENS, Linear
from ds4_mlx.model.moe import HASH_ROUTE, SHARED_DOWN, WEIGHT_SUM_FLOOR, Router, SharedExpert, softplus, swiglu, weigh
from emulated_cuda import emulated_build
from kernel_checks import balanced, rendered, tiny_decode_fast_and_reference
from test_fused_linear import Blocks

pytestmark = pytest.mark.usefixtures("kernels_unforced")

CLAMP = 10.0
FLASH_EMBD, FLASH_SHARED_FF, FLASH_EXPERTS, FLASH_USED, FLASH_VOCAB = 4096, 2048, 256, 6, 129280


def shared_expert(n_embd: int, n_ff: int, ggml_type: GGMLType = GGMLType.Q8_0) -> SharedExpert:
    """A layer's shared expert of random blocks, read as the model reads its file (affine where the CPU has it)."""
    source = Blocks()
    for seed, (name, shape) in enumerate([("gate", (n_ff, n_embd)), ("up", (n_ff, n_embd)), ("down", (n_embd, n_ff))]):
        source.add(f"blk.0.ffn_{name}_shexp.weight", ggml_type, shape, seed=seed + 80)
    gate, up, down = (Linear(source, f"blk.0.ffn_{name}_shexp.weight") for name in ("gate", "up", "down"))
    mx.eval([[a.wq, a.scales, a.biases] for a in (gate._affine, up._affine, down._affine) if a is not None])
    return SharedExpert(gate, up, down, CLAMP)


def unfused(shared: SharedExpert, x: mx.array, norm) -> mx.array:
    """The shared expert as the model computed it before: each projection, the SwiGLU, then down."""
    return shared.down(swiglu(shared.gate(x, norm=norm), shared.up(x, norm=norm), shared.clamp))


def flash_table(seed: int = 90) -> mx.array:
    """A tid2eid table of Flash's shape: each token's six distinct experts (a random offset and stride mod 256)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, FLASH_EXPERTS, (FLASH_VOCAB, 1))
    stride = 2 * rng.integers(0, FLASH_EXPERTS // 2, (FLASH_VOCAB, 1)) + 1  # odd: six distinct ids
    return mx.array(((start + stride * np.arange(FLASH_USED)) % FLASH_EXPERTS).astype(np.int32))


def hash_inputs(tokens: list[int], n_expert: int, seed: int) -> tuple[mx.array, mx.array]:
    """Gate logits (T, E) of scale 3, the last token's above 20 (where softplus is linear), and the token ids."""
    logits = random_activations((len(tokens), n_expert), seed=seed) * 3.0
    logits = mx.concatenate([logits[:-1], 21.0 + mx.abs(logits[-1:])])
    return logits, mx.array(tokens, dtype=mx.int32)


class Gate:
    """A router gate of a float32 matrix (the hash kernel reads only its output)."""

    def __init__(self, weight: mx.array):
        self.weight = weight

    def __call__(self, x: mx.array, norm=None) -> mx.array:
        return apply(x, norm) @ self.weight.T


# ---------------------------------------------------------------------------------------------------------------
# On the CPU


@pytest.mark.parametrize("tokens", [1, 3, FUSED_TOKENS + 1])
def test_the_shared_expert_is_unchanged_bit_for_bit(on_cpu, tokens, monkeypatch):
    """Gate and up joined at load, down after the SwiGLU: on the CPU the products of before (three matrices of
    their own), bit for bit, with and without the input norm; a decode call's gate and up are one product."""
    shared = shared_expert(512, 256)
    assert shared.gate_up.launches == 1
    with monkeypatch.context() as patch:
        patch.setattr(linear, "_concatenate", lambda parts, offsets: None)
        separate = shared_expert(512, 256)
    assert separate.gate_up.launches == 2
    x = 7.0 * random_activations((tokens, 512), seed=tokens)
    norm = probe_norm(512, 1e-6, seed=3)
    for n in (None, norm):
        assert mx.array_equal(shared(x, n), unfused(separate, x, n))
        assert mx.array_equal(separate(x, n), unfused(separate, x, n))
    joined = shared.gate_up.joined(x, norm)
    if tokens > FUSED_TOKENS:
        assert joined is None
    else:
        normed = apply(x, norm)
        assert mx.array_equal(joined, mx.concatenate([shared.gate(normed), shared.up(normed)], axis=-1))
    with registry.forced_mode("reference"):
        assert shared.gate_up.joined(x, norm) is None
        assert mx.array_equal(shared(x, norm), unfused(shared, x, norm))
    assert SHARED_DOWN.fast_path.decisions() == {} and AFFINE_MATVEC.decisions() == {}


def test_the_hash_router_is_unchanged_bit_for_bit(on_cpu):
    n_embd, n_vocab = 64, 40
    table = mx.array(np.random.default_rng(4).integers(0, 16, (n_vocab, 4)).astype(np.int32))
    gate = Gate(random_activations((16, n_embd), seed=5))
    hashed = Router(gate=gate, bias=None, tid2eid=table, n_used=4, scale=1.5)
    x, tokens = random_activations((3, n_embd), seed=6), mx.array([39, 0, 7], dtype=mx.int32)
    ids, weights = hashed(x, tokens)
    want_ids, want_weights = weigh(mx.sqrt(softplus(gate(x))), table[tokens], 1.5)
    assert mx.array_equal(ids, want_ids) and mx.array_equal(weights, want_weights)
    assert HASH_ROUTE.fast_path.decisions() == {}


def non_views(arrays: list[mx.array]) -> Counter:
    return Counter(name for name in graph_nodes(arrays).values() if name not in VIEWS)


def test_launches_planned_for_cuda(on_cpu):
    """As a CUDA backend builds them: the shared expert's two launches (gate and up with ffn_norm folded, down with
    the SwiGLU folded), and a hash router's one after its gate (here a plain matmul)."""
    shared = shared_expert(512, 256)
    x, norm = random_activations((1, 512), seed=7), probe_norm(512, 1e-6, seed=8)
    table = mx.array(np.random.default_rng(9).integers(0, 16, (40, 4)).astype(np.int32))
    hashed = Router(gate=Gate(random_activations((16, 512), seed=10)), bias=None, tid2eid=table, n_used=4, scale=1.5)
    mx.eval(x, norm[0])
    with registry.planning("cuda"):
        assert shared.folds(x, norm)
        assert non_views([shared(x, norm)]) == {"CustomKernel": 2}
        assert non_views(list(hashed(x, mx.array([3], dtype=mx.int32)))) == {"Matmul": 1, "CustomKernel": 1}


@pytest.mark.parametrize("kernel", [swiglu_kernel(CLAMP), hash_route_kernel(WEIGHT_SUM_FLOOR, 1.5)],
                         ids=lambda k: k.name)
def test_the_kernels_render_for_cuda_and_metal(kernel):
    for target in (CUDA, METAL):
        out = rendered(kernel, target)
        assert out["input_names"] == list(kernel.inputs) and out["output_names"] == list(kernel.outputs)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", out["source"] + out["header"])
        for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"] + kernel.header)):
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
        assert balanced(out["source"]) and balanced(out["header"])
        assert not re.search(r"^[%@]", out["source"], re.M) and "X_ROW" not in out["source"]


def test_the_swiglu_variant_leaves_the_other_texts_as_they_were():
    for kernel in (KERNEL, norm_kernel(1e-6)):
        assert "swiglu" not in kernel.source and "X_ROW" not in kernel.source
        assert not re.search(r"^%", kernel.source, re.M)
        assert "TOKENS * IN);" in kernel.source and "xv[(t * IN + u * UNIT_VALUES) / 4 + j]" in kernel.source
    source = swiglu_kernel(CLAMP).source
    assert "TOKENS * (2 * IN));" in source and "ds4_swiglu4(xj[t], xv[(t * (2 * IN) + IN + u" in source
    assert "CLAMP = 10.0f;" in swiglu_kernel(CLAMP).header
    assert swiglu_kernel(CLAMP) is swiglu_kernel(CLAMP) and swiglu_kernel(CLAMP).name != swiglu_kernel(7.0).name


# ---------------------------------------------------------------------------------------------------------------
# The CUDA text on the CPU (slow: g++)


def swiglu_reference(gate_up: mx.array, blocks: mx.array, ggml_type: GGMLType, shape: tuple[int, int]) -> np.ndarray:
    """The model's SwiGLU of the two halves, times the dequantized matrix, in numpy float32."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    return np.array(swiglu(gate, up, CLAMP)) @ np.array(dequantize(blocks, ggml_type, shape)).T


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "size", "tokens"), [
    (8, (FLASH_EMBD, FLASH_SHARED_FF), 1),  # Flash's shared down: 1024 threadgroups of 4 rows, 2 SIMD groups
    (8, (FLASH_EMBD, FLASH_SHARED_FF), 2),
    (8, (9, 512), 1),  # the last threadgroup one row deep
    (8, (7, 1024), 3),
    (8, (3, 768), 8),  # 48 loads a row for 96 threads: some idle in the only step
    (8, (17, 2048), 5),
    (4, (9, 512), 1),
    (4, (5, 1024), 2),
], ids=str)
def test_emulated_swiglu_matvec_equals_the_reference(bits, size, tokens, monkeypatch, tmp_path):
    """The SwiGLU variant through its wrapper (templates, grid, plan), gate and up values spread over about
    1.6 clamps (a fifth clamped), against its reference and the dequantized matrix."""
    monkeypatch.setattr(affine_matvec, "build", emulated_build(tmp_path))
    n_out, n_in = size
    ggml_type = GGMLType.Q8_0 if bits == 8 else GGMLType.Q4_K
    blocks = random_blocks(ggml_type, n_out, n_in, seed=n_in + tokens)
    weight = to_affine(blocks, ggml_type, size)
    gate_up = 0.8 * CLAMP * random_activations((tokens, 2 * n_in), seed=n_out)
    assert (mx.abs(gate_up) > CLAMP).any().item()
    plan = launch_plan(n_out, n_in, bits, tokens)
    got = np.array(SHARED_DOWN.fast_path.fast(gate_up, weight, CLAMP, plan))
    assert got.shape == (tokens, n_out) and np.isfinite(got).all()  # every output was written
    for want in (np.array(SHARED_DOWN.fast_path.reference(gate_up, weight, CLAMP, plan)),
                 swiglu_reference(gate_up, blocks, ggml_type, size)):
        assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 2])
def test_emulated_shared_expert_at_flash_shapes(tokens, monkeypatch, tmp_path):
    """A Flash shared expert (n_embd 4096, n_ff 2048, Q8_0) with ffn_norm, both kernels taken: two launches (the
    joined gate and up, 4096 x 4096, with the norm; down with the SwiGLU), against the CPU's reference path."""
    shared = shared_expert(FLASH_EMBD, FLASH_SHARED_FF)
    norm = probe_norm(FLASH_EMBD, 1e-6, seed=11)
    x = 7.0 * random_activations((tokens, FLASH_EMBD), seed=12)
    want = np.array(shared(x, norm))
    launched = []
    build = emulated_build(tmp_path)

    def counted(kernel, backend):
        launched.append(kernel.name)
        return build(kernel, backend)

    monkeypatch.setattr(affine_matvec, "build", counted)
    monkeypatch.setattr(AFFINE_MATVEC, "enabled", lambda key: True)
    monkeypatch.setattr(SHARED_DOWN.fast_path, "enabled", lambda key: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that raised would fall back with a warning
        got = np.array(shared(x, norm))
    assert [re.sub(r"_[0-9a-f]{8}$", "", name) for name in launched] == ["ds4_affine_matvec_norm",
                                                                         "ds4_affine_matvec_swiglu"]
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2 * TOLERANCE * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize(("n_expert", "k", "tokens"), [
    (FLASH_EXPERTS, FLASH_USED, [0, FLASH_VOCAB - 1, 5000]),
    (16, 4, [3, 1]),  # small.gguf's width (not a multiple of 32)
    (24, 32, [2]),  # every lane of the SIMD group
    (8, 1, [0, 5, 5]),
], ids=str)
def test_emulated_hash_route_equals_the_reference(n_expert, k, tokens, monkeypatch, tmp_path):
    """Through a hash layer's Router (Flash: the real table's shape), the kernel taken: ids copied exactly,
    weights within the 6-term sum's rounding."""
    monkeypatch.setattr(router, "build", emulated_build(tmp_path))
    if n_expert == FLASH_EXPERTS:
        table = flash_table()
    else:
        rng = np.random.default_rng(n_expert)
        table = mx.array(rng.integers(0, n_expert, (max(tokens) + 3, k)).astype(np.int32))
    logits, ids = hash_inputs(tokens, n_expert, seed=k)
    hashed = Router(gate=lambda x, norm=None: x, bias=None, tid2eid=table, n_used=k, scale=1.5)
    want_ids, want_weights = hashed(logits, ids)
    monkeypatch.setattr(HASH_ROUTE.fast_path, "enabled", lambda key: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_ids, got_weights = hashed(logits, ids)
    assert np.array_equal(np.array(got_ids), np.array(want_ids))
    got_weights, want_weights = np.array(got_weights), np.array(want_weights)
    assert np.isfinite(got_weights).all()
    assert np.abs(got_weights - want_weights).max() <= ROUTE_TOLERANCE * np.abs(want_weights).max()


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_swiglu_matvec_kernel_is_used_at_flash_shapes(on_gpu, tokens):
    shape = (FLASH_EMBD, FLASH_SHARED_FF)
    blocks = random_blocks(GGMLType.Q8_0, *shape, seed=13)
    weight = to_affine(blocks, GGMLType.Q8_0, shape)
    gate_up = 0.8 * CLAMP * random_activations((tokens, 2 * shape[1]), seed=14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = SHARED_DOWN(gate_up, weight, CLAMP)
        compiled = mx.compile(lambda a: SHARED_DOWN(a, weight, CLAMP))(gate_up)
    key = (8, shape[1], tokens, *launch_plan(*shape, 8, tokens), CLAMP)
    assert SHARED_DOWN.fast_path.decisions()[registry.current_backend(), key].fast
    gate, up = mx.split(gate_up, 2, axis=-1)
    want = weight.matmul(swiglu(gate, up, CLAMP))
    for y in (got, compiled):
        assert relative_error(y, want) <= TOLERANCE
    assert relative_error(got, mx.array(swiglu_reference(gate_up, blocks, GGMLType.Q8_0, shape))) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize(("size", "plan"), [((1, 512), (1, 1)), ((7, 256), (4, 1)), ((33, 768), (2, 3)),
                                            ((301, 2048), (4, 8))], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_swiglu_matvec_kernel_at_odd_sizes(on_gpu, size, plan, tokens, ggml_type):
    n_out, n_in = size
    if ggml_type == GGMLType.Q4_K:
        n_in = 256 * -(-n_in // 256)
    blocks = random_blocks(ggml_type, n_out, n_in, seed=15)
    weight = to_affine(blocks, ggml_type, (n_out, n_in))
    gate_up = 0.8 * CLAMP * random_activations((tokens, 2 * n_in), seed=16)
    got = SHARED_DOWN.fast_path.fast(gate_up, weight, CLAMP, plan)
    assert relative_error(got, mx.array(swiglu_reference(gate_up, blocks, ggml_type, (n_out, n_in)))) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_shared_expert_takes_two_launches_on_the_gpu(on_gpu, tokens):
    """Flash's shared expert with ffn_norm folded: the joined gate and up (4096 x 4096) and down with the SwiGLU,
    both checked and used; equal to the reference path (dequantized weights, float32 matmuls)."""
    norm = probe_norm(FLASH_EMBD, 1e-6, seed=17)
    x = 7.0 * random_activations((tokens, FLASH_EMBD), seed=18)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = shared_expert(FLASH_EMBD, FLASH_SHARED_FF)
        assert shared.gate_up.launches == 1 and shared.folds(x, norm)
        got = shared(x, norm)
        compiled = mx.compile(lambda a: shared(a, norm))(x)
    backend = registry.current_backend()
    plan = launch_plan(2 * FLASH_SHARED_FF, FLASH_EMBD, 8, tokens)
    assert AFFINE_MATVEC.decisions()[backend, (8, FLASH_EMBD, tokens, *plan, 1e-6)].fast
    down_key = (8, FLASH_SHARED_FF, tokens, *launch_plan(FLASH_EMBD, FLASH_SHARED_FF, 8, tokens), CLAMP)
    assert SHARED_DOWN.fast_path.decisions()[backend, down_key].fast
    with registry.forced_mode("reference"):
        want = shared(x, norm)
    for y in (got, compiled):
        assert relative_error(y, want) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [[0], [FLASH_VOCAB - 1, 0, 5000, 77, 129000, 3, 12345]], ids=len)
def test_hash_route_kernel_is_used_at_flash_shapes(on_gpu, tokens):
    table = flash_table()
    logits, ids = hash_inputs(tokens, FLASH_EXPERTS, seed=19)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_ids, got_weights = HASH_ROUTE(logits, table, ids, 1.5)
    assert HASH_ROUTE.fast_path.decisions()[registry.current_backend(), (FLASH_EXPERTS, FLASH_USED, 1.5)].fast
    want_ids, want_weights = HASH_ROUTE.fast_path.reference(logits, table, ids, 1.5)
    assert mx.array_equal(got_ids, want_ids) and mx.array_equal(got_ids, table[ids])
    assert mx.max(mx.abs(got_weights - want_weights)).item() <= ROUTE_TOLERANCE * mx.max(want_weights).item()


@pytest.mark.gpu
def test_tiny_decode_with_the_moe_kernels_equals_the_reference(on_gpu, tmp_path):
    """Decode steps of the tiny q4 model (three hash layers, a Q8_0 shared expert in every layer): the kernels
    checked and used, logits equal to the forced reference path within float32 reassociation."""
    fast, reference = tiny_decode_fast_and_reference(tmp_path, "q4")
    for path in (SHARED_DOWN.fast_path, HASH_ROUTE.fast_path):
        assert path.decisions() and all(d.fast for d in path.decisions().values())
    assert np.abs(fast - reference).max() <= 1e-4 * np.abs(reference).max()
