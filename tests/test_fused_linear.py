"""FusedLinear (model/linear.py): a decode step's projections of one input, one matrix per storage form.

On the CPU: what each layer fuses at load (q_a and kv as affine; with the float16 form forced on, as where its
kernel passed its check, the compressors' kv and gate and the indexer's proj too), products equal to the members'
own bit for bit, memory as predicted, and nothing fused in the reference mode; with an input norm, products equal
to the members' of the normed input bit for bit. On the GPU (`pytest -m gpu`): the fused launches used at Flash's
shapes, equal to the members' products within the kernels' tolerances, and the decode step's input norms folded
into its matvec launches.
"""

from __future__ import annotations

import gc
import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.decode.affine_matvec import AFFINE_MATVEC, launch_plan
from ds4_mlx.kernels.decode.affine_matvec import TOLERANCE as AFFINE_TOLERANCE
from ds4_mlx.kernels.decode.fused_norm import apply
from ds4_mlx.kernels.decode.half import HALF_MATVEC
from ds4_mlx.kernels.decode.half import TOLERANCE as HALF_TOLERANCE
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model import linear
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.graph import decode_step_ops
from ds4_mlx.model.gguf import GGMLType, TensorInfo
from ds4_mlx.model.linear import FUSED_TOKENS, FusedLinear, Linear, _fusable_form
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

pytestmark = pytest.mark.usefixtures("kernels_unforced")


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    return open_weights(write_model(tmp_path_factory.mktemp("fused") / "tiny-q4.gguf", preset="tiny", experts="q4"))


def force_half_form(monkeypatch) -> None:
    """The float16 form (and its fusion) as where the half matvec passed its check; the CPU runs its reference."""
    monkeypatch.setattr(linear, "matvec_enabled", lambda shape: registry.mode() == "fast")


def expected_launches(ratio: int, half: bool) -> int:
    """q_a and kv in one affine launch; the compressors' F16 matrices (and the indexer's proj) in one float16 launch
    where that form is held, else one product each (kv, gate per compressor, and proj)."""
    if ratio == 0:
        return 1
    if half:
        return 2
    return 1 + (2 if ratio == 128 else 5)


def held_after_load(weights, fuse: bool, monkeypatch) -> tuple[Model, int]:
    """A model, and the bytes MLX holds for it once loaded, with or without the fusion."""
    with monkeypatch.context() as patch:
        if not fuse:
            patch.setattr(linear, "_concatenate", lambda parts, offsets: None)
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        model = Model(weights)
        gc.collect()
        mx.clear_cache()
        return model, mx.get_active_memory() - before


@pytest.mark.parametrize("half", [False, True], ids=["float32-f16", "float16-f16"])
def test_layers_fuse_their_decode_projections_at_load(tiny_weights, monkeypatch, on_cpu, half):
    if half:
        force_half_form(monkeypatch)
    separate, separate_bytes = held_after_load(tiny_weights, False, monkeypatch)
    assert all(b.attention.project.launches == len(b.attention.project.members) for b in separate.blocks)
    del separate
    model, fused_bytes = held_after_load(tiny_weights, True, monkeypatch)
    assert model.nbytes == linear.loaded_nbytes(tiny_weights)
    q_a = model.blocks[0].attention.q_a
    assert fused_bytes < separate_bytes + q_a.nbytes  # members keep views: no second copy (allocator rounding only)
    for layer, block in enumerate(model.blocks):
        attention = block.attention
        members = attention.input_projections()
        assert attention.project.members == members
        assert attention.project.launches == expected_launches(model.config.compress_ratio(layer), half)
        assert members[0] is attention.q_a and members[1] is attention.kv


@pytest.mark.parametrize("half", [False, True], ids=["float32-f16", "float16-f16"])
@pytest.mark.parametrize("tokens", [1, 5, FUSED_TOKENS + 1])
def test_fused_products_equal_the_members_own(tiny_weights, monkeypatch, on_cpu, half, tokens):
    if half:
        force_half_form(monkeypatch)
    model = Model(tiny_weights)
    x = random_activations((tokens, model.config.n_embd), seed=tokens)
    for block in model.blocks:
        project = block.attention.project
        got = project(x)
        assert len(got) == len(project.members)
        for y, member in zip(got, project.members):
            assert mx.array_equal(y, member(x))  # the same dot products, bit for bit on the CPU


@pytest.mark.parametrize("half", [False, True], ids=["float32-f16", "float16-f16"])
@pytest.mark.parametrize("tokens", [1, FUSED_TOKENS + 1, 16])
def test_products_of_a_normed_input_equal_the_members_of_the_norm(tiny_weights, monkeypatch, on_cpu, half, tokens):
    """With `norm`, FusedLinear and Linear give the products of rms_norm(x, *norm) bit for bit on the CPU (the
    kernels' references norm first): decode and chunk results do not change where no kernel runs."""
    if half:
        force_half_form(monkeypatch)
    model = Model(tiny_weights)
    x = 7.0 * random_activations((tokens, model.config.n_embd), seed=tokens)
    for block in model.blocks:
        norm = (block.attn_norm, block.eps)
        normed = mx.fast.rms_norm(x, *norm)
        project = block.attention.project
        for y, member in zip(project(x, norm=norm), project.members):
            assert mx.array_equal(y, member(normed))
            assert mx.array_equal(member(x, norm=norm), member(normed))
    norm = (model.output_norm, model.config.rms_eps)
    assert mx.array_equal(model.output(x, norm=norm), model.output(mx.fast.rms_norm(x, *norm)))


def test_the_reference_mode_fuses_nothing(tiny_weights, monkeypatch, on_cpu):
    force_half_form(monkeypatch)
    with registry.forced_mode("reference"):
        model = Model(tiny_weights)
    assert all(b.attention.project.launches == len(b.attention.project.members) for b in model.blocks)
    fast = Model(tiny_weights)
    x = random_activations((1, fast.config.n_embd), seed=3)
    with registry.forced_mode("reference"):  # fused at load, then the reference mode: each member's reference
        for block in fast.blocks:
            project = block.attention.project
            for y, member in zip(project(x), project.members):
                assert mx.array_equal(y, x @ member.weight.T)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)


class Blocks:
    """Raw tensors in memory, read the way Linear reads a file's (a TensorSource)."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[TensorInfo, mx.array]] = {}

    def add(self, name: str, ggml_type: GGMLType, shape: tuple[int, int], seed: int) -> Blocks:
        n_out, n_in = shape
        if ggml_type == GGMLType.F16:
            rng = np.random.default_rng(seed)
            values = rng.standard_normal(shape) * np.exp2(rng.uniform(-16, -2, shape))
            raw = mx.array(values.astype(np.float16).view(np.uint8))
        else:
            raw = random_blocks(ggml_type, n_out, n_in, seed=seed)
        self.tensors[name] = (TensorInfo(name, (n_in, n_out), ggml_type, 0, raw.nbytes), raw)
        return self

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name][0]

    def read(self, name: str, convert) -> list[mx.array]:
        return list(convert(self.tensors[name][1]))


FLASH_RATIO4 = [("blk.2.attn_q_a.weight", GGMLType.Q8_0, (1024, 4096)),
                ("blk.2.attn_kv.weight", GGMLType.Q8_0, (512, 4096)),
                ("blk.2.attn_compressor_kv.weight", GGMLType.F16, (1024, 4096)),
                ("blk.2.attn_compressor_gate.weight", GGMLType.F16, (1024, 4096)),
                ("blk.2.indexer_compressor_kv.weight", GGMLType.F16, (256, 4096)),
                ("blk.2.indexer_compressor_gate.weight", GGMLType.F16, (256, 4096)),
                ("blk.2.indexer.proj.weight", GGMLType.F16, (64, 4096))]
"""A ratio-4 layer's input projections at Flash's shapes, in Attention.input_projections order."""


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_flash_layer_projections_take_two_launches_on_the_gpu(on_gpu, tokens):
    source = Blocks()
    for seed, (name, ggml_type, shape) in enumerate(FLASH_RATIO4):
        source.add(name, ggml_type, shape, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        members = [Linear(source, name) for name, _, _ in FLASH_RATIO4]
        assert all(m._affine is not None for m in members[:2]) and all(m._half is not None for m in members[2:])
        project = FusedLinear(members)
        assert project.launches == 2
        x = random_activations((tokens, 4096), seed=tokens)
        got = project(x)
        compiled = mx.compile(lambda a: project(a))(x)
    backend = registry.current_backend()
    assert HALF_MATVEC.decisions()[backend, (2624, 4096)].fast
    plan = launch_plan(1536, 4096, 8, tokens)
    assert AFFINE_MATVEC.decisions()[backend, (8, 4096, tokens, *plan)].fast
    for fused in (got, compiled):
        for y, member, (_, ggml_type, _) in zip(fused, members, FLASH_RATIO4):
            want = x @ member.weight.T
            bound = AFFINE_TOLERANCE if ggml_type == GGMLType.Q8_0 else HALF_TOLERANCE
            assert y.shape == want.shape
            assert (mx.abs(y - want).max() / mx.abs(want).max()).item() <= bound


@pytest.mark.gpu
def test_tiny_model_layers_fuse_on_the_gpu(on_gpu, tiny_weights):
    """Every layer's decode projections in one affine launch and, with compressors, one float16 launch; decode
    equal to the reference path within float32 reassociation (activation simulation off)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model(tiny_weights, simulate_quant=False)
    for layer, block in enumerate(model.blocks):
        assert block.attention.project.launches == expected_launches(model.config.compress_ratio(layer), True)
    tokens = np.random.default_rng(12).integers(0, tiny_weights.config.n_vocab, 26).astype(np.int32)

    def logits(m: Model) -> np.ndarray:
        cache = m.new_cache(64)
        m.prefill(mx.array(tokens[:20]), cache)
        return np.stack([np.array(m.decode(int(t), cache)[1]) for t in tokens[20:]])

    fast = logits(model)
    with registry.forced_mode("reference"):
        want = logits(Model(tiny_weights, simulate_quant=False))
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()


def unfolded(patch: pytest.MonkeyPatch) -> None:
    """The matvecs with their input norm as an op of its own before them, as the decode step had it: each normed
    input made once, whichever projections read it."""
    made: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}  # holds x, so that its id stays its own

    def norm_once(x: mx.array, norm: tuple[mx.array, float] | None) -> mx.array:
        if norm is None:
            return x
        key = (id(x), id(norm[0]))
        if key not in made:
            made[key] = (x, apply(x, norm))
        return made[key][1]

    affine, half = linear.affine_matvec, linear.half_matvec
    patch.setattr(linear, "apply", norm_once)
    patch.setattr(linear, "affine_matvec",
                  lambda x, w, ids=None, norm=None, **kw: affine(norm_once(x, norm), w, ids, **kw))
    patch.setattr(linear, "half_matvec", lambda x, w, norm=None: half(norm_once(x, norm), w))


@pytest.mark.gpu
def test_tiny_model_decode_folds_its_input_norms_on_the_gpu(on_gpu, tiny_weights, monkeypatch):
    """attn_norm, q_a_norm (where both q_b's take it: the tiny indexer's q_b, IN 64, has no matvec form) and
    output_norm leave the compiled decode graph, one RMSNorm node each, into checked normed matvec kernels; decode
    equal to the reference path within float32 reassociation (activation simulation off)."""
    tokens = np.random.default_rng(13).integers(0, tiny_weights.config.n_vocab, 26).astype(np.int32)

    def decode(m: Model, ops: bool = False) -> tuple[np.ndarray, dict | None]:
        cache = m.new_cache(64)
        m.prefill(mx.array(tokens[:20]), cache)
        counts = decode_step_ops(m, cache) if ops else None
        return np.stack([np.array(m.decode(int(t), cache)[1]) for t in tokens[20:]]), counts

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model(tiny_weights, simulate_quant=False)
        fast, folded = decode(model, ops=True)
    eps = float(model.config.rms_eps)
    backend = registry.current_backend()
    normed = {path: [(key, d.fast) for (b, key), d in path.decisions().items()
                     if b == backend and isinstance(key[-1], float) and key[-1] == eps]
              for path in (AFFINE_MATVEC, HALF_MATVEC)}
    assert all(fast_path for decisions in normed.values() for _, fast_path in decisions)
    affine_inputs = {key[1] for key, _ in normed[AFFINE_MATVEC]}
    assert {model.config.n_embd, model.config.q_lora_rank} <= affine_inputs  # q_a + kv and the LM head; q_b
    assert any(key[1] == model.config.n_embd for key, _ in normed[HALF_MATVEC])  # the compressors' kv and gate

    with monkeypatch.context() as patch:
        unfolded(patch)
        _, separate = decode(Model(tiny_weights, simulate_quant=False), ops=True)
    q_a_folded = sum(b.attention.indexer is None or _fusable_form(b.attention.indexer.q_b) is not None
                     for b in model.blocks)
    folds = len(model.blocks) + q_a_folded + 1
    rms = "RMSNorm"
    # at least one RMSNorm node per folded norm leaves the graph (the stand-in makes one per input array it sees,
    # and the step hands some projections views of the same normed input: more than one per norm there, 23 for 11
    # on the H200), and the launches drop by exactly those nodes: folding adds none
    removed = separate["by_primitive"].get(rms, 0) - folded["by_primitive"].get(rms, 0)
    assert removed >= folds and separate["kernels"] - folded["kernels"] == removed

    with registry.forced_mode("reference"):
        want, _ = decode(Model(tiny_weights, simulate_quant=False))
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()
