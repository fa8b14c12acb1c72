"""The chunk attention kernels (kernels/prefill/chunk_attention.py, CHUNK_ATTENTION: SIMT and tensor cores) against
their reference, `attend_block`.

At Flash shapes on the GPU, and a tiny model's prefill taking them (gpu marker); their CUDA text run on the CPU by
emulated_cuda.py at small odd shapes covering each kind of key set, windows that cross the chunk's start, queries
that see nothing but the sink, picks with slots that are not real, and one Flash-shaped block (slow marker); on the
CPU, that `attend_block` is the formulas the chunk path composed before it, bit for bit.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.prefill import chunk_attention
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.decode.attention import TOLERANCE
from ds4_mlx.kernels.prefill.chunk_attention import ChunkAttention, ChunkShape
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.attention import CHUNK_ATTENTION, attend, attend_block
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.rope import RoPE
from ds4_mlx.model.weights import open_weights
from emulated_cuda import emulated_build
from kernel_checks import assert_renders_cleanly, rendered, used_kinds

HEADS, DIM, WINDOW, PICKS = FLASH.n_head, FLASH.head_dim, FLASH.sliding_window, FLASH.indexer_top_k


def within(got: mx.array, want: mx.array) -> bool:
    return mx.max(mx.abs(got - want)).item() <= TOLERANCE * mx.max(mx.abs(want)).item()


def block_inputs(heads: int, d: int, window: int, b: int, first: int, raw_first: int, kind: str, ratio: int = 0,
                 n_rows: int = 0, picks: int = 0, none_real: tuple[int, ...] = (), seed: int = 0) -> tuple:
    """attend_block's arguments: b queries at positions first.., the raw rows from position raw_first to the
    block's last, and by kind no rows, n_rows compressed rows, or each query's own ascending picks among n_rows
    (about a third not real; none for the queries in `none_real`)."""
    rows = picked = valid = None
    if kind != "window":
        rows = random_activations((n_rows, d), seed=seed + 2)
    if kind == "picked":
        rng = np.random.default_rng(seed)
        picked = mx.array(np.stack([np.sort(rng.choice(n_rows, picks, replace=False)) for _ in range(b)]),
                          dtype=mx.int32)
        real = rng.random((b, picks)) < 0.67
        real[list(none_real)] = False
        valid = mx.array(real)
    raw = random_activations((first + b - raw_first, d), seed=seed + 1)
    return (random_activations((b, heads, d), seed=seed), raw, raw_first, first, window, rows, ratio, picked, valid,
            random_activations((heads,), seed=seed + 3))


ODD_CASES = {
    "window-crosses-start": (3, 64, 5, 7, 9, 5, "window"),  # the first query's window: 4 rows before the chunk
    "first-chunk": (5, 96, 6, 9, 0, 0, "window"),  # queries at the start see fewer than a window
    "few-rows-before": (17, 32, 8, 4, 3, 0, "window"),  # two head groups, the second with one head
    "many-heads": (40, 128, 8, 6, 10, 3, "rows", 4, 3),  # 2 or 3 tensor-core head groups, the last part empty
    "rows-none-visible-yet": (3, 64, 4, 6, 1, 0, "rows", 4, 1),  # visible 0, 0, 1, 1, 1, 1
    "rows-capped-by-buffer": (2, 128, 3, 5, 20, 18, "rows", 3, 4),  # 7 visible by position, 4 in the buffer
    "rows-growing": (3, 64, 16, 30, 40, 25, "rows", 16, 4),  # visible 2 to 4 within the block
    "picked": (5, 64, 6, 5, 30, 25, "picked", 4, 20, 7, (1,)),
    "picked-two-rounds": (2, 32, 3, 3, 50, 48, "picked", 4, 400, 300, (2,)),  # picks > threads: two compactions
    "sink-only": (3, 64, 0, 4, 12, 12, "picked", 4, 9, 5, (0, 3)),  # no window: queries 0 and 3 see no key
}
FLASH_CASE = (HEADS, DIM, WINDOW, 2, 5000, 5000 - WINDOW + 1, "picked", 4, 1250, PICKS, ())


def test_block_reference_is_the_former_chunk_formulas(on_cpu):
    """`attend_block` is `attend` over the raw rows the chunk path sliced for a block (mask p - window < position
    <= p), then the visible compressed rows or the gathered picks: what Attention.__call__ built before, bit for bit
    (the CPU's outputs do not change)."""
    for kind, extra in (("window", ()), ("rows", (4, 10)), ("picked", (4, 20, 7, (1,)))):
        args = block_inputs(3, 64, 5, 7, 30, 26, kind, *extra)
        q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks = args
        p = mx.arange(26, 37, dtype=mx.int32)[4:11]  # the chunk's positions, sliced to the block
        lo, hi = max(0, first - window + 1 - raw_first), first + 7 - raw_first
        key_pos = mx.arange(raw_first + lo, raw_first + hi, dtype=mx.int32)[None, :]
        keys, masks = [raw[lo:hi]], [(key_pos <= p[:, None]) & (key_pos > p[:, None] - window)]
        if kind == "rows":
            keys.append(rows)
            masks.append(mx.arange(rows.shape[0])[None, :] < ((p + 1) // ratio)[:, None])
        elif kind == "picked":
            keys.append(rows[picked])
            masks.append(valid)
        assert mx.array_equal(attend_block(*args), attend(q, keys, masks, sinks, 1.0 / math.sqrt(64)))


def test_sink_only_queries_get_zeros(on_cpu):
    """A query that sees no key gets exp(-inf) terms that vanish beside the sink: zeros, as the kernel writes."""
    got = np.array(attend_block(*block_inputs(*ODD_CASES["sink-only"])))
    assert (got[[0, 3]] == 0).all() and (np.abs(got[[1, 2]]).max(axis=-1) > 0).all()


@pytest.mark.parametrize("kind", chunk_attention.CHUNK_KEY_SETS)
def test_chunk_attention_renders_for_cuda_and_metal(kind):
    """Each kind's text, placeholders filled, every neutral word spelled and every helper defined by both
    preludes or the kernel's header (the tensor-core kernels: CUDA's, with their dynamic threadgroup memory
    declared); the kernels' names differ (MLX names compiled kernels after them)."""
    for target in (CUDA, METAL):
        assert_renders_cleanly(rendered(chunk_attention.CHUNK_KERNELS[kind], target), ("EXTRA_KEYS", "KEY_ROW"))
    for m_tiles in (1, 2):
        kernel = chunk_attention.TENSOR_KERNELS[kind, m_tiles]
        assert_renders_cleanly(rendered(kernel, CUDA), ("EXTRA_KEYS", "KEY_ROW"))
        assert "extern __shared__ __align__(16) float ds4_shared[];" in CUDA.header(kernel)
        assert kernel.shared_memory == chunk_attention.tensor_shared_bytes(m_tiles) <= 227 * 1024
    names = [k.name for k in [*chunk_attention.CHUNK_KERNELS.values(), *chunk_attention.TENSOR_KERNELS.values()]]
    assert len(set(names)) == len(names)


def test_tensor_kernel_memory_fits_the_h200():
    """The queries' and two rounds of keys' half planes and the probabilities: 205 KB at 32 heads, 169 KB at 16
    (one threadgroup an SM either way; the H200 gives a threadgroup up to 227 KB)."""
    assert chunk_attention.tensor_shared_bytes(2) == 205_312 and chunk_attention.tensor_shared_bytes(1) == 169_344


def test_cpu_uses_the_reference(on_cpu, kernels_unforced):
    args = block_inputs(*ODD_CASES["picked"])
    assert mx.array_equal(CHUNK_ATTENTION(*args), attend_block(*args))
    assert not CHUNK_ATTENTION.used(5, 64, 6, 4, 7)
    for path in (CHUNK_ATTENTION.simt_path, CHUNK_ATTENTION.tensor_path):
        assert all(backend != "cpu" for backend, _ in path.decisions())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    (HEADS, DIM, WINDOW, 128, 0, 0, "window"),  # a first chunk
    (HEADS, DIM, WINDOW, 128, 3000, 3000 - WINDOW + 1, "rows", 4, 782),  # all visible rows of a ratio-4 layer
    (HEADS, DIM, WINDOW, 128, 20_000, 20_000 - WINDOW + 1, "rows", 128, 157),
    (HEADS, DIM, WINDOW, 128, 8000, 8000 - WINDOW + 1, "picked", 4, 2032, PICKS, (5, 77)),
], ids=["window", "ratio4-rows", "ratio128-rows", "picked"])
def test_chunk_attention_kernel_is_used_and_equals_reference(on_gpu, kernels_unforced, case, monkeypatch):
    """Flash's shapes, a block of 128 queries of each kind of layer: the tensor-core kernel on CUDA (at both head
    counts a threadgroup can serve), the SIMT one everywhere."""
    args = block_inputs(*case)
    got = CHUNK_ATTENTION(*args)
    q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks = args
    key = CHUNK_ATTENTION.key(q, window, rows, ratio, picked)
    expected = CHUNK_ATTENTION.tensor_path if registry.current_backend() == "cuda" else CHUNK_ATTENTION.simt_path
    assert key.kind == case[6] and CHUNK_ATTENTION.path(key) is expected
    assert expected.decisions()[registry.current_backend(), key].fast
    want = attend_block(*args)
    assert within(got, want) and within(ChunkAttention._kernel(*args), want)
    if registry.current_backend() == "cuda":
        for heads in (16, 32):
            monkeypatch.setattr(chunk_attention, "TENSOR_HEADS", heads)
            assert within(ChunkAttention._tensor_kernel(*args), want)


@pytest.mark.gpu
def test_tiny_model_prefill_runs_the_kernel(on_gpu, kernels_unforced, tmp_path):
    """The tiny model's prefill (two chunks: the first leaves ratio-4 layers at most top k rows, the second
    passes it) takes the kernel for every kind of key set, and its logits equal the reference path's within
    float32 reassociation (activation simulation off)."""
    weights = open_weights(write_model(tmp_path / "tiny-q4.gguf", preset="tiny", experts="q4"))
    tokens = mx.array(np.random.default_rng(15).integers(0, weights.config.n_vocab, 100).astype(np.int32))

    def logits(model: Model) -> np.ndarray:
        cache = model.new_cache(128)
        first = model(tokens[:30], cache, all_logits=True)
        return np.concatenate([np.array(first), np.array(model(tokens[30:], cache, all_logits=True))])

    fast = logits(Model(weights, simulate_quant=False))
    path = CHUNK_ATTENTION.tensor_path if registry.current_backend() == "cuda" else CHUNK_ATTENTION.simt_path
    assert used_kinds(path, weights.config) == {"window", "rows", "picked"}
    with registry.forced_mode("reference"):
        want = logits(Model(weights, simulate_quant=False))
    assert np.abs(fast - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ODD_CASES.values()) + [FLASH_CASE], ids=list(ODD_CASES) + ["flash-picked"])
def test_emulated_chunk_attention_equals_reference(on_cpu, case, monkeypatch, tmp_path):
    """The kernel's CUDA text run on the CPU as the wrapper launches it. The Flash case: 64 heads of 512, a full
    128-row window crossing the chunk's start, 512 picks of 1250 rows with about a third not real."""
    monkeypatch.setattr(chunk_attention, "build", emulated_build(tmp_path))
    args = block_inputs(*case)
    got = ChunkAttention._kernel(*args)
    want = attend_block(*args)
    assert got.shape == want.shape and np.isfinite(np.array(got)).all()  # every output was written
    assert within(got, want)
    if case[2] == 0:  # no window: the queries without a real pick see nothing but the sink
        assert (np.array(got)[list(case[-1])] == 0).all()


TENSOR_CASES = {f"{name}-{heads}": (case, heads) for name, case in ODD_CASES.items() for heads in (16, 32)
                if case[1] % 64 == 0}
"""The odd cases whose head width the tensor-core kernel tiles (a multiple of 64: its scores are drained every 64
dims), at each head count a threadgroup serves."""


@pytest.mark.slow
@pytest.mark.parametrize("case,heads", list(TENSOR_CASES.values()), ids=list(TENSOR_CASES))
def test_emulated_tensor_chunk_attention_equals_reference(on_cpu, case, heads, monkeypatch, tmp_path):
    """The tensor-core kernel's CUDA text, its half products emulated (tests/emulated_cuda.py)."""
    monkeypatch.setattr(chunk_attention, "build", emulated_build(tmp_path))
    monkeypatch.setattr(chunk_attention, "TENSOR_HEADS", heads)
    args = block_inputs(*case)
    got = ChunkAttention._tensor_kernel(*args)
    want = attend_block(*args)
    assert got.shape == want.shape and np.isfinite(np.array(got)).all()
    assert within(got, want)
    if case[2] == 0:
        assert (np.array(got)[list(case[-1])] == 0).all()


def finishing_args(case: tuple, seed: int = 0) -> tuple:
    """A case's block_inputs with its queries as q_b's outputs (scaled by 37: the norm shows) and the RoPE of an
    eighth of the head width (Flash's 64 of 512) at base 10000, eps 1e-6: what the model hands CHUNK_ATTENTION."""
    q, *rest = block_inputs(*case, seed=seed)
    return (q * 37.0, *rest, RoPE(q.shape[-1] // 8, 10000.0).inv_freq, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["window-crosses-start", "many-heads", "rows-growing", "picked", "sink-only"])
def test_emulated_tensor_kernel_finishes_the_queries(on_cpu, name, monkeypatch, tmp_path):
    """With the RoPE's inv_freq, the tensor-core kernel norms and rotates each query in its launch and rotates the
    output back: equal to the model's composition (`finishing` of attend_block), and not to the unfinished core."""
    monkeypatch.setattr(chunk_attention, "build", emulated_build(tmp_path))
    args = finishing_args(ODD_CASES[name])
    got = ChunkAttention._tensor_kernel(*args)
    want = chunk_attention.finishing(attend_block)(*args)
    assert within(got, want)
    assert not within(got, attend_block(*args[:10]))


@pytest.mark.slow
def test_emulated_tensor_kernel_answers_a_query_whatever_its_chunk(on_cpu, monkeypatch, tmp_path):
    """A query's output from the tensor-core kernel is the same bits whether its block holds the other queries or
    not, and whatever raw rows come before its window (another chunking: the raw rows start elsewhere): its keys'
    scales are per row and its rounds start at its own first key, so chunked prefill moves it only where its inputs
    move."""
    monkeypatch.setattr(chunk_attention, "build", emulated_build(tmp_path))
    q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks, inv_freq, eps = finishing_args(
        ODD_CASES["picked"], seed=5)
    whole = np.array(ChunkAttention._tensor_kernel(q, raw, raw_first, first, window, rows, ratio, picked, valid,
                                                   sinks, inv_freq, eps))
    earlier = mx.concatenate([random_activations((7, q.shape[-1]), seed=9), raw])
    for lo, hi in ((0, 2), (2, q.shape[0])):
        part = ChunkAttention._tensor_kernel(q[lo:hi], earlier, raw_first - 7, first + lo, window, rows, ratio,
                                             picked[lo:hi], valid[lo:hi], sinks, inv_freq, eps)
        assert np.array_equal(np.array(part), whole[lo:hi])


@pytest.mark.gpu
def test_flash_queries_finished_in_the_tensor_kernel(on_gpu, kernels_unforced):
    """Flash's picked layer, q_b's outputs finished in the launch (the model's call on CUDA): the kernel's fast path
    takes the call and equals the reference."""
    args = finishing_args((HEADS, DIM, WINDOW, 128, 8000, 8000 - WINDOW + 1, "picked", 4, 2032, PICKS, (5,)))
    got = CHUNK_ATTENTION(*args)
    key = CHUNK_ATTENTION.key(args[0], args[4], args[5], args[6], args[7], args[10])
    assert key.n_rot == DIM // 8 and CHUNK_ATTENTION.path(key) is CHUNK_ATTENTION.tensor_path
    assert within(got, chunk_attention.finishing(attend_block)(*args))


@pytest.mark.slow
@pytest.mark.parametrize("key", [ChunkShape("window", 3, 64, 5, 0, 0), ChunkShape("rows", 17, 32, 6, 4, 0),
                                 ChunkShape("rows", 2, 64, 4, 16, 0), ChunkShape("picked", 5, 64, 6, 0, 9),
                                 ChunkShape("picked", 5, 64, 6, 0, 9, 8)],
                         ids=["window", "rows-ratio4", "rows-ratio16", "picked", "picked-finishing"])
def test_emulated_probe_passes(on_cpu, monkeypatch, tmp_path, key):
    """The first-use probe's inputs, as the GPU will check them (at small shapes: the Flash ones take minutes)."""
    monkeypatch.setattr(chunk_attention, "build", emulated_build(tmp_path))
    args = ChunkAttention._probe(key)
    assert ChunkAttention.key(args[0], args[4], args[5], args[6], args[7], *args[10:11]) == key
    want = chunk_attention.finishing(attend_block)(*args)
    assert within(chunk_attention.finishing(ChunkAttention._kernel)(*args), want)
    if key.head_dim % 64 == 0:
        assert within(ChunkAttention._tensor_kernel(*args), want)
