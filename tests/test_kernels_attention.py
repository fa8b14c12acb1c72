"""The decode-step attention kernels (kernels/decode/attention.py) against the model's formulas.

RoPE and the decode attention core at Flash shapes on the GPU, and the tiny model's decode step taking the latter
(gpu marker); the decode attention core's CUDA text run on the CPU by emulated_cuda.py at Flash shapes and small
odd ones, and on its first-use probes (slow marker); on the CPU, that its reference, `attend_step`, is the chunk
form's formulas composed as the decode step composed them, bit for bit.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.decode import attention
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.decode.attention import TOLERANCE, DecodeAttention
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.attention import DECODE_ATTENTION, attend, attend_step
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.rope import ROTATE, RoPE, Yarn, rotate
from ds4_mlx.model.weights import open_weights
from emulated_cuda import emulated_build
from kernel_checks import balanced, rendered, used_kinds

HEADS, DIM, N_ROT, WINDOW = FLASH.n_head, FLASH.head_dim, FLASH.n_rot, FLASH.sliding_window


def within(got: mx.array, want: mx.array) -> bool:
    return mx.max(mx.abs(got - want)).item() <= TOLERANCE * mx.max(mx.abs(want)).item()


def rope(n_rot: int, compressed: bool) -> RoPE:
    """Flash's RoPE of raw-window layers, or of compressed layers (YaRN)."""
    c = FLASH
    if not compressed:
        return RoPE(n_rot, c.rope_freq_base)
    return RoPE(n_rot, c.compress_rope_freq_base,
                Yarn(c.rope_scaling_factor, c.rope_orig_ctx, c.yarn_beta_fast, c.yarn_beta_slow))


def step_inputs(heads: int, d: int, n_rot: int, window: int, position: int, kind: str, ratio: int = 0,
                n_rows: int = 0, n_picked: int = 0, seed: int = 0) -> tuple:
    """attend_step's arguments: q_b's output at 3x unit rms, the window, and by kind no rows ("window"), a row buffer
    of which (position + 1) // ratio are visible ("rows"), or the indexer's ascending picks of it with every third
    not real ("picked")."""
    rows = picked = valid = None
    if kind != "window":
        rows = random_activations((n_rows, d), seed=seed + 3)
    if kind == "picked":
        chosen = np.sort(np.random.default_rng(seed).choice(n_rows, n_picked, replace=False))
        picked = mx.array(chosen, dtype=mx.int32)[None]
        valid = (mx.arange(n_picked) % 3 != 2)[None]
    return (random_activations((1, heads * d), seed=seed) * 3.0, mx.array([position], dtype=mx.int32),
            rope(n_rot, kind != "window").inv_freq, random_activations((window, d), seed=seed + 1), rows, picked,
            valid, random_activations((heads,), seed=seed + 2), ratio, FLASH.rms_eps)


FLASH_CASES = {
    "window-filling": (37, "window"),
    "window-far": (1_000_003, "window"),  # RoPE angles up to 1e6
    "ratio4-rows": (101, "rows", 4, 40),  # 25 of 40 rows visible, the window not full yet
    "ratio128-rows": (128 * 20 + 5, "rows", 128, 40),  # 20 of 40 visible
    "picked": (2403, "picked", 4, 600, 512),  # 512 of 600 rows, every third not real
}
ODD_CASES = {
    "first-token": (3, 64, 64, 5, 0, "window"),  # every dim rotated, one key
    "window-filling": (5, 128, 16, 9, 3, "window"),
    "rows": (3, 64, 64, 5, 13, "rows", 4, 7),  # 3 of 7 visible
    "no-rows-yet": (3, 64, 32, 5, 2, "rows", 4, 7),
    "all-rows": (1, 192, 64, 3, 40, "rows", 4, 7),  # visible count capped by the buffer
    "picked": (3, 64, 64, 5, 30, "picked", 4, 11, 3),
}


def test_step_reference_is_the_chunk_formulas(on_cpu):
    """`attend_step` is the query's rms_norm and RoPE, `attend` over the window, rows or picks with the step's
    masks, and the inverse RoPE: the operations the decode step made before the kernel, bit for bit."""
    for kind, extra in (("window", ()), ("rows", (4, 40)), ("picked", (4, 60, 16))):
        q, position, inv_freq, window, rows, picked, valid, sinks, ratio, eps = step_inputs(
            4, 128, 64, 16, 101, kind, *extra)
        r = rope(64, kind != "window")
        p = position[0]
        heads = r(rms_norm(q.reshape(1, 4, 128), None, eps), position)
        keys, masks = [window], [(mx.arange(16) >= 16 - 1 - p)[None]]
        if kind == "rows":
            keys.append(rows)
            masks.append((mx.arange(40) < (p + 1) // ratio)[None])
        elif kind == "picked":
            keys.append(rows[picked])
            masks.append(valid)
        want = r(attend(heads, keys, masks, sinks, 1.0 / math.sqrt(128)), position, inverse=True)
        got = attend_step(q, position, inv_freq, window, rows, picked, valid, sinks, ratio, eps)
        assert mx.array_equal(got, want)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("kind", attention.KEY_SETS)
def test_decode_attention_renders_for_cuda_and_metal(kind, split):
    """Each kind's text, whole heads or split, placeholders filled, with every neutral word spelled and every helper
    defined by both preludes (ds4_cos and ds4_sin among them); the kernels' names differ (MLX names compiled
    kernels after them)."""
    kernel = (attention.SPLIT_KERNELS if split else attention.ATTEND_KERNELS)[kind]
    for target in (CUDA, METAL):
        out = rendered(kernel, target)
        placeholders = "|EXTRA_KEYS|KEY_ROW|HEAD_SHARE|SHARES_MERGED"
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + placeholders + r")\b", out["source"])
        assert balanced(out["source"])
        for helper in {"ds4_cos", "ds4_sin", *re.findall(r"\bds4_\w+(?=\()", out["source"])}:
            assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
    names = {k.name for k in (*attention.ATTEND_KERNELS.values(), *attention.SPLIT_KERNELS.values())}
    assert len(names) == 2 * len(attention.KEY_SETS)


def test_cpu_uses_the_reference(on_cpu, kernels_unforced):
    args = step_inputs(4, 128, 64, 16, 101, "picked", 4, 60, 16)
    assert mx.array_equal(DECODE_ATTENTION(*args), attend_step(*args))
    assert all(backend != "cpu" for backend, _ in DECODE_ATTENTION.fast_path.decisions())


@pytest.mark.slow
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 512), (3, 128), (5, 2, 96)])
def test_emulated_rope_equals_reference(on_cpu, shape, inverse, monkeypatch, tmp_path):
    """The RoPE kernel's CUDA text run on the CPU (its INVERSE template constant is a bool, as MLX takes it)."""
    monkeypatch.setattr(attention, "build", emulated_build(tmp_path))
    r = RoPE(64, 160000.0)
    x = random_activations(shape, seed=1)
    cos, sin = r.cos_sin(mx.array([1048575, 3, 9, 0, 77][: shape[0]], dtype=mx.int32))
    assert within(attention.Rope._kernel(x, cos, sin, 64, inverse), rotate(x, cos, sin, 64, inverse))


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 512), (1, 512), (3, 128)])
def test_rope_kernel_is_used_and_equals_reference(on_gpu, kernels_unforced, shape, inverse):
    r = RoPE(64, 160000.0)
    x = random_activations(shape, seed=1)
    cos, sin = r.cos_sin(mx.array([1048575, 3, 9][: shape[0]], dtype=mx.int32))
    got = ROTATE(x, cos, sin, 64, inverse)
    assert ROTATE.fast_path.decisions()[registry.current_backend(), (shape[-1], 64, inverse)].fast
    assert within(got, rotate(x, cos, sin, 64, inverse))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FLASH_CASES.values(), ids=FLASH_CASES.keys())
def test_decode_attention_kernel_is_used_and_equals_reference(on_gpu, kernels_unforced, case):
    """Flash's shapes: window only (filling, and at angles up to 1e6), every visible row of ratio-4 and ratio-128
    buffers, the indexer's picks (some not real)."""
    position, kind, *extra = case
    args = step_inputs(HEADS, DIM, N_ROT, WINDOW, position, kind, *extra)
    got = DECODE_ATTENTION(*args)
    q, position, inv_freq, window, rows, picked, valid, sinks, ratio, eps = args
    key = DECODE_ATTENTION.key(inv_freq, window, rows, picked, sinks, ratio)
    assert key.kind == kind and DECODE_ATTENTION.fast_path.decisions()[registry.current_backend(), key].fast
    assert within(got, attend_step(*args))


@pytest.mark.gpu
def test_tiny_model_decode_runs_the_kernel(on_gpu, kernels_unforced, tmp_path):
    """The tiny model's decode step takes the kernel on its layers of each kind (window only, ratio 128, ratio 4)
    and its logits equal the reference path's within float32 reassociation (activation simulation off)."""
    weights = open_weights(write_model(tmp_path / "tiny-q4.gguf", preset="tiny", experts="q4"))
    tokens = np.random.default_rng(14).integers(0, weights.config.n_vocab, 60).astype(np.int32)

    def logits(model: Model) -> np.ndarray:
        cache = model.new_cache(128)
        model.prefill(mx.array(tokens[:50]), cache)
        return np.stack([np.array(model.decode(int(t), cache)[1]) for t in tokens[50:]])

    fast = logits(Model(weights, simulate_quant=False))
    assert used_kinds(DECODE_ATTENTION.fast_path, weights.config) == {"window", "rows", "picked"}
    with registry.forced_mode("reference"):
        want = logits(Model(weights, simulate_quant=False))
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("case", [(HEADS, DIM, N_ROT, WINDOW, *c) for c in FLASH_CASES.values()]
                         + list(ODD_CASES.values()), ids=[f"flash-{k}" for k in FLASH_CASES] + list(ODD_CASES))
def test_emulated_decode_attention_equals_reference(on_cpu, case, monkeypatch, tmp_path):
    """The kernel's CUDA text run on the CPU as the wrapper launches it, at Flash's shapes and small odd ones:
    several heads of widths 64 to 512, 16 rotated dims to all of them, windows of 3 to 128 rows at their first
    token, filling and full, compressed rows none, some and all visible, picks with some not real."""
    monkeypatch.setattr(attention, "build", emulated_build(tmp_path))
    args = step_inputs(*case)
    got = DecodeAttention._kernel(*args)
    want = attend_step(*args)
    assert got.shape == want.shape and np.isfinite(np.array(got)).all()  # every output was written
    assert within(got, want)


SPLIT_CASES = {
    "flash-picked": ((HEADS, DIM, N_ROT, WINDOW, *FLASH_CASES["picked"]), 4),
    "flash-ratio4-rows": ((HEADS, DIM, N_ROT, WINDOW, *FLASH_CASES["ratio4-rows"]), 8),
    "flash-window-filling": ((HEADS, DIM, N_ROT, WINDOW, *FLASH_CASES["window-filling"]), 2),
    "first-token": (ODD_CASES["first-token"], 4),  # one key: every share but one empty
    "picked": (ODD_CASES["picked"], 3),
    "all-rows": (ODD_CASES["all-rows"], 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("case,splits", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_emulated_split_decode_attention_equals_reference(on_cpu, case, splits, monkeypatch, tmp_path):
    """A head's keys shared by several threadgroups (SPLIT_HEAD), the last one of each head merging the shares:
    the reference's output at Flash's shapes and odd ones, empty shares included, each launch given the counters
    of its head count."""
    monkeypatch.setattr(attention, "build", emulated_build(tmp_path))
    args = step_inputs(*case)
    counters = []
    monkeypatch.setattr(DecodeAttention, "counter", staticmethod(lambda heads, row=0: counters.append(heads) or
                                                                  mx.zeros((max(heads, 16),), dtype=mx.uint32)))
    got = DecodeAttention._kernel(*args, splits=splits)
    want = attend_step(*args)
    assert counters == [case[0]] and got.shape == want.shape and np.isfinite(np.array(got)).all()
    assert within(got, want)


@pytest.mark.slow
def test_emulated_probe_passes(on_cpu, monkeypatch, tmp_path):
    """The first-use probe's inputs, as the GPU will check them, at Flash's three kinds of layer."""
    monkeypatch.setattr(attention, "build", emulated_build(tmp_path))
    for key in (attention.StepShape("window", HEADS, DIM, N_ROT, WINDOW, 0, 0, 0),
                attention.StepShape("rows", HEADS, DIM, N_ROT, WINDOW, 128, 130, 0),  # a 16k-token context
                attention.StepShape("picked", HEADS, DIM, N_ROT, WINDOW, 0, 0, 512)):
        args = DecodeAttention._probe(key)
        assert within(DecodeAttention._kernel(*args), attend_step(*args[:-1]))  # the last: the step's row


def test_split_heads_only_for_the_picked_rows_on_cuda():
    """The plan bench/attention_plans.py measured: four threadgroups a head over the window and the indexer's picks
    on CUDA, one elsewhere (the window alone, a ratio-128 layer's rows) and everywhere on Metal."""
    with registry.planning("cuda"):
        assert [attention.splits_for(kind, HEADS) for kind in ("window", "rows", "picked")] == [1, 1, 4]
    with registry.planning("metal"):
        assert {attention.splits_for(kind, HEADS) for kind in ("window", "rows", "picked")} == {1}


def test_a_steps_rows_count_their_split_heads_apart(tmp_path, monkeypatch):
    """The split kernel's last-threadgroup counters are the launch's own: the rows of a step over several rows are
    independent launches, which MLX's CUDA graphs (and cudagraph.py's) run at once, so each row has its own (with
    one shared, the H100 gave rows off by up to 1.4 of their largest logit, changing from run to run)."""
    path = write_model(tmp_path / "tiny.gguf", preset="tiny", experts="q2", vocab="small")
    seen: list[tuple[int, int]] = []
    real = DecodeAttention.counter
    monkeypatch.setattr(DecodeAttention, "counter",
                        staticmethod(lambda heads, row=0: seen.append((heads, row)) or real(heads, row)))
    with registry.planning("cuda"):
        model = Model(open_weights(path))
        caches = [model.new_cache(256) for _ in range(3)]
        tokens, positions = mx.array([5, 6, 7], dtype=mx.int32), mx.array([40, 41, 42], dtype=mx.int32)
        model.step_rows(tokens, positions, [c.layers for c in caches], (1, 1, 1))
    picked_layers = sum(1 for b in model.blocks if b.attention.indexer is not None)
    assert picked_layers and sorted(set(seen)) == [(model.config.n_head, row) for row in range(3)]
    assert len(seen) == 3 * picked_layers
    assert real(model.config.n_head, 0) is not real(model.config.n_head, 1)
