"""The indexer kernels (kernels/sublayers/indexer.py) against `pick_rows` and `index_scores` in model/attention.py.

Inputs with integer values (`exact_inputs`) give scores that are exact whatever the summation order, so the picked
rows and their validity must be identical, ties at the top_k-th place included; float inputs check the scores to
SCORE_TOLERANCE. On the GPU through MLX (gpu marker), and on the CPU through the kernels' CUDA text compiled by
g++ (emulated_cuda.py, slow marker). The CPU tests pin what the kernels assume of the reference.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.sublayers.indexer import (
    SCORE_SIMDS,
    SCORE_TOLERANCE,
    SCORES_KERNEL,
    SELECT_KERNEL,
    SELECT_THREADS,
    TENSOR_SCORE_KEYS,
    TENSOR_SCORE_WARPS,
    TENSOR_SCORES_KERNEL,
    exact_inputs,
    indexer_scores,
    position_seeing,
    scores_template,
    select_template,
    tensor_scores_bytes,
    tensor_template,
)
from ds4_mlx.kernels.tensor_cores.halfsplit import reference_split_rows
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.kernels.sublayers.rows import RowQuant, steady_rows
from ds4_mlx.model.attention import INDEXER_PICK, index_scores, pick_finished_rows, pick_rows
from ds4_mlx.model.quant_sim import finish_rows
from ds4_mlx.model.rope import RoPE
from ds4_mlx.model.topk import mask_to_indices, top_k_mask
from emulated_cuda import emulated

HEADS, DIM, RATIO, TOP_K, N_ROT = 64, 128, 4, 512, 64
ROPE = RoPE(N_ROT, 10000.0)
QUANTS = [RowQuant.NONE, RowQuant.INDEXER_FP4]
SIZES = [(512, TOP_K), (2048, TOP_K), (2050, TOP_K), (8192, TOP_K), (300, 64)]
"""(rows, top_k): as many rows as top_k (all picked), 2k and 8k rows (8k and 32k tokens), 2050 (Flash's buffer at 8k
tokens: not a whole number of the score kernel's 4-row groups) and a small top_k."""


def seen_counts(n: int, top_k: int) -> list[int]:
    """Visible row counts around top_k and at the ends: none, below, at and above top_k, all but one, all."""
    return sorted({min(v, n) for v in (0, top_k - 1, top_k, top_k + 1, n - 1, n)})


def queries(n: int, top_k: int, seed: int, copies: int = 3):
    return exact_inputs(HEADS, DIM, n, [position_seeing(v, RATIO) for v in seen_counts(n, top_k)], seed, copies)


def raw_queries(n: int, top_k: int, quant: RowQuant, seed: int, copies: int = 3):
    """q_b's output as the decode step hands it over, weights, rows and positions (`queries`' and one at 999_983,
    which sees every row: cos and sin of large angles), whose finished queries are exact as IndexerPick's probe
    has them: steady rows finish to FP4 values; unquantised, the rows' RoPE dims are zero."""
    q, w, rows, positions = exact_inputs(HEADS, DIM, n, [position_seeing(v, RATIO) for v in seen_counts(n, top_k)]
                                         + [999_983], seed, copies)
    if quant == RowQuant.INDEXER_FP4:
        return steady_rows(q.shape, positions, ROPE, None, quant, seed + 1), w, rows, positions
    return q, w, mx.concatenate([rows[:, : DIM - N_ROT], mx.zeros((n, N_ROT))], axis=1), positions


def float_inputs(n: int, top_k: int):
    """Queries with float values for the score check: every one sees more than top_k rows."""
    positions = mx.array([position_seeing(v, RATIO) for v in (top_k + 1, n - 1)] + [999_983], dtype=mx.int32)
    return (random_activations((3, HEADS, DIM), seed=11), random_activations((3, HEADS), seed=12) * 0.1,
            random_activations((n, DIM), seed=13), positions)


def visible_mask(n: int, positions: mx.array) -> mx.array:
    return mx.arange(n)[None, :] < ((positions + 1) // RATIO)[:, None]


def test_pick_rows_pads_with_the_first_rows(on_cpu):
    """The kernels write 0..top_k-1 (valid below the visible count) when at most top_k rows are visible, and
    (T, N) when N <= top_k: what `mask_to_indices` gives. Above top_k: top_k valid rows, ascending."""
    for n, top_k in [(40, 8), (8, 8), (6, 8)]:
        q, w, rows, positions = queries(n, top_k, seed=1)
        picked, valid = pick_rows(q, w, rows, positions, RATIO, top_k)
        seen = (positions + 1) // RATIO
        for i, v in enumerate(seen.tolist()):
            if v <= top_k:
                assert picked[i].tolist() == list(range(min(n, top_k)))
                assert valid[i].tolist() == [j < v for j in range(min(n, top_k))]
            else:
                assert valid[i].all().item() and (picked[i][1:] > picked[i][:-1]).all().item()


def test_pick_rows_is_the_chunk_paths_choice(on_cpu):
    """`pick_rows` is the chunk path's `select` + `mask_to_indices` + validity gather, bit for bit."""
    q, w, rows, positions = queries(40, 8, seed=2)
    visible = visible_mask(40, positions)
    chosen = top_k_mask(index_scores(q, w, rows, visible), 8) & visible
    picked = mask_to_indices(chosen, 8)
    got = pick_rows(q, w, rows, positions, RATIO, 8)
    assert mx.array_equal(got[0], picked) and mx.array_equal(got[1], mx.take_along_axis(chosen, picked, axis=-1))


def test_cpu_uses_the_reference(on_cpu, kernels_unforced):
    q, w, rows, positions = raw_queries(600, TOP_K, RowQuant.INDEXER_FP4, seed=3)
    got = INDEXER_PICK(q, w, rows, positions, ROPE, RowQuant.INDEXER_FP4, RATIO, TOP_K)
    want = pick_rows(finish_rows(q, positions, ROPE, None, RowQuant.INDEXER_FP4, False), w, rows, positions, RATIO,
                     TOP_K)
    assert all(mx.array_equal(g, v) for g, v in zip(got, want))
    assert not INDEXER_PICK.fast_path.enabled((HEADS, DIM, 600, RATIO, TOP_K, N_ROT, RowQuant.INDEXER_FP4))


def test_finished_queries_pick_as_the_chunk_path_did(on_cpu, kernels_unforced):
    """A prefill chunk hands over finished queries (rope None): the reference is then `pick_rows` itself, and the
    probe of that shape class (n_rot 0) has no RoPE either."""
    q, w, rows, positions = queries(600, TOP_K, seed=6)
    got = INDEXER_PICK(q, w, rows, positions, None, RowQuant.NONE, RATIO, TOP_K)
    want = pick_rows(q, w, rows, positions, RATIO, TOP_K)
    assert all(mx.array_equal(g, v) for g, v in zip(got, want))
    probe = INDEXER_PICK._probe((HEADS, DIM, 600, RATIO, TOP_K, 0, RowQuant.NONE))
    assert probe[4] is None and all(mx.array_equal(g, v) for g, v in zip(pick_finished_rows(*probe),
                                                                          pick_rows(*probe[:4], *probe[6:])))


@pytest.mark.parametrize("kernel", [SCORES_KERNEL, SELECT_KERNEL, TENSOR_SCORES_KERNEL], ids=lambda k: k.name)
def test_kernels_render_for_cuda_and_metal(kernel):
    """Every neutral word spelled out and every helper called defined (the score kernel's finish is
    kernels/sublayers/rows.py's and kernels/sublayers/actquant.py's), in both dialects."""
    for target in (CUDA, METAL) if not kernel.shared_memory else (CUDA,):  # dynamic threadgroup memory: CUDA's
        source, header = target.render(kernel.source), target.header(kernel)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", source + header)
        for helper in set(re.findall(r"\b(?:ds4|rw|aq|ix)_\w+(?=\()", source + header)):
            assert re.search(rf"\b{helper}\([^;]*\) {{", header), f"{helper} is called but not defined"
        for open_, close in ("{}", "()", "[]"):
            assert source.count(open_) == source.count(close)


def test_probe_finishes_queries_exactly(on_cpu):
    """The probe's finished queries are what its exactness rests on: FP4 values in eighths below 16 (any summation
    order keeps scores exact), or integers with the rows' RoPE dims zero."""
    for quant in QUANTS:
        q, w, rows, positions, rope, quant, ratio, top_k, scale = INDEXER_PICK._probe(
            (HEADS, DIM, 600, RATIO, TOP_K, N_ROT, quant))
        finished = np.array(finish_rows(q, positions, rope, None, quant, False), np.float64)
        if quant == RowQuant.NONE:  # the rotated dims meet zeros
            assert (np.array(rows)[:, DIM - N_ROT :] == 0).all()
            finished = finished[..., : DIM - N_ROT]
        assert (finished * 8 == np.round(finished * 8)).all() and np.abs(finished).max() <= 16
        assert ((np.array(positions) + 1) // ratio > top_k).any() and np.array(positions).max() > 10**5


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "top_k"), SIZES, ids=str)
@pytest.mark.parametrize("copies", [3, 1, 10**6], ids=["triples", "distinct", "all-equal"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_indexer_pick_kernels_are_used_and_equal_reference(kernels_unforced, n, top_k, copies, quant):
    q, w, rows, positions = raw_queries(n, top_k, quant, seed=n + copies, copies=copies)
    got = INDEXER_PICK(q, w, rows, positions, ROPE, quant, RATIO, top_k, 1.0 / 16)
    key = (HEADS, DIM, n, RATIO, top_k, N_ROT, quant)
    assert INDEXER_PICK.fast_path.decisions()[registry.current_backend(), key].fast
    want = pick_finished_rows(q, w, rows, positions, ROPE, quant, RATIO, top_k, 1.0 / 16)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])


@pytest.mark.gpu
def test_indexer_pick_kernels_take_a_chunks_finished_queries(kernels_unforced):
    """A prefill chunk's choice (kernels/prefill/chunk_attention.py's callers): 300 finished queries at consecutive
    positions over Flash's buffer at 8k tokens, picks equal to the reference's (exact inputs)."""
    n = 2050
    q, w, rows, positions = exact_inputs(HEADS, DIM, n, list(range(8192 - 300, 8192)), seed=7)
    got = INDEXER_PICK(q, w, rows, positions, None, RowQuant.NONE, RATIO, TOP_K)
    assert INDEXER_PICK.fast_path.decisions()[registry.current_backend(),
                                              (HEADS, DIM, TOP_K + 1, RATIO, TOP_K, 0, RowQuant.NONE)].fast
    want = pick_rows(q, w, rows, positions, RATIO, TOP_K)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])


def test_a_chunks_rows_past_top_k_share_one_check(on_cpu):
    """Planned for CUDA, a prefill chunk's finished queries over any number of rows past top_k have one key (the
    tensor-core kernels compile the same for all); up to top_k each count is its own (the select's width)."""
    q, w, _, positions = exact_inputs(HEADS, DIM, 4, [4000, 4001, 4002], seed=8)

    def key(n: int) -> tuple:
        return INDEXER_PICK.key(q, w, mx.zeros((n, DIM)), positions, None, RowQuant.NONE, RATIO, TOP_K)

    with registry.planning("cuda"):
        assert {key(n) for n in (TOP_K + 1, 2050, 65536)} == {(HEADS, DIM, TOP_K + 1, RATIO, TOP_K, 0,
                                                                  RowQuant.NONE)}
        assert key(TOP_K)[2] == TOP_K and key(100)[2] == 100
    with registry.planning("metal"):  # the SIMT score kernel holds the count as a constant
        assert key(2050)[2] == 2050


def zero_rows(n: int, top_k: int):
    """Every other row zero and the weights negative: no score is above 0 and half of them are 0, all tied."""
    q, w, rows, positions = queries(n, top_k, seed=4)
    return q, -mx.abs(w), mx.where((mx.arange(n) % 2 == 0)[:, None], 0.0, rows), positions


@pytest.mark.gpu
def test_indexer_pick_kernels_tie_zero_scores(kernels_unforced):
    q, w, rows, positions = zero_rows(2048, TOP_K)
    rows = mx.concatenate([rows[:, : DIM - N_ROT], mx.zeros((2048, N_ROT))], axis=1)
    got = INDEXER_PICK(q, w, rows, positions, ROPE, RowQuant.NONE, RATIO, TOP_K)
    want = pick_finished_rows(q, w, rows, positions, ROPE, RowQuant.NONE, RATIO, TOP_K)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 8192])
def test_indexer_scores_kernel_within_tolerance(n):
    q, w, rows, positions = float_inputs(n, TOP_K)
    got = indexer_scores(q, w, rows, positions, RATIO, TOP_K)
    assert registry.disagreement(got, index_scores(q, w, rows, visible_mask(n, positions)), SCORE_TOLERANCE) is None


def emulated_pick(q: mx.array, w: mx.array, rows: mx.array, positions: mx.array, top_k: int, tmp_path,
                  scale: float = 1.0, rope: RoPE | None = None, quant: RowQuant = RowQuant.NONE
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores, picked, valid) from the two kernels' CUDA text run on the CPU (head weights times `scale`; the
    queries finished by `rope`, if any, and `quant` in the score kernel)."""
    (t, heads), (n, d) = w.shape, rows.shape
    template = scores_template(heads, d, n, RATIO, top_k, 0 if rope is None else rope.n_rot, quant)
    q, w, rows = (np.array(a, np.float32) for a in (q, w, rows))
    positions = np.array(positions, np.int32)
    inv_freq = np.array([scale] if rope is None else rope.inv_freq, np.float32)
    (scores,) = emulated(SCORES_KERNEL, template, tmp_path)(
        [q, w, rows, positions, np.array([scale], np.float32), inv_freq], [(t, n)], (template["BLOCKS"], t),
        SCORE_SIMDS * 32)
    picked, valid = emulated(SELECT_KERNEL, select_template(n, RATIO, top_k), tmp_path)(
        [scores, positions, np.array([n], np.int32)], [(t, min(n, top_k))] * 2, (t, 1), SELECT_THREADS,
        [np.int32, np.bool_])
    return scores, picked, valid


@pytest.mark.slow
@pytest.mark.parametrize(("n", "top_k"), SIZES, ids=str)
@pytest.mark.parametrize("copies", [3, 10**6], ids=["triples", "all-equal"])
def test_emulated_cuda_kernels_equal_reference(on_cpu, n, top_k, copies, tmp_path):
    q, w, rows, positions = queries(n, top_k, seed=n + copies, copies=copies)
    scores, picked, valid = emulated_pick(q, w, rows, positions, top_k, tmp_path)
    want_picked, want_valid = pick_rows(q, w, rows, positions, RATIO, top_k)
    assert (picked == np.array(want_picked)).all() and (valid == np.array(want_valid)).all()
    wide = ((positions + 1) // RATIO > top_k).tolist()  # the kernel scores only queries that choose
    want = np.array(index_scores(q, w, rows, visible_mask(n, positions)))
    assert (scores[wide] == want[wide]).all()  # exact inputs: exact scores


@pytest.mark.slow
def test_emulated_cuda_kernels_tie_zero_scores(on_cpu, tmp_path):
    q, w, rows, positions = zero_rows(300, 64)
    _, picked, valid = emulated_pick(q, w, rows, positions, 64, tmp_path)
    want_picked, want_valid = pick_rows(q, w, rows, positions, RATIO, 64)
    assert (picked == np.array(want_picked)).all() and (valid == np.array(want_valid)).all()


@pytest.mark.slow
@pytest.mark.parametrize("rope", [None, ROPE], ids=["finished", "rotated"])
def test_emulated_cuda_scores_within_tolerance(on_cpu, rope, tmp_path):
    """Float queries, finished beforehand or rotated in the kernel (unquantised: the FP4 round of a value a few
    ulps from a boundary could go either way, see kernels/sublayers/rows.py TOLERANCE)."""
    q, w, rows, positions = float_inputs(2050, TOP_K)
    scores, _, _ = emulated_pick(q, w, rows, positions, TOP_K, tmp_path, rope=rope)
    finished = q if rope is None else finish_rows(q, positions, rope, None, RowQuant.NONE, False)
    want = index_scores(finished, w, rows, visible_mask(2050, positions))
    assert registry.disagreement(mx.array(scores), want, SCORE_TOLERANCE) is None


@pytest.mark.slow
@pytest.mark.parametrize(("heads", "d", "n_rot"), [(5, 32, 32), (40, 64, 16), (32, 256, 64)], ids=str)
def test_emulated_cuda_scores_rotate_queries_of_every_width(on_cpu, heads, d, n_rot, tmp_path):
    """Query widths of one, two and eight values a lane (the finish's RoPE partner in the next lane, or in the
    lane's next value), heads that do not fill the SIMD groups' share: float scores within tolerance of the
    reference's product with the rotated queries."""
    rope = RoPE(n_rot, 10000.0)
    n = 300
    positions = mx.array([position_seeing(v, RATIO) for v in (65, n - 1)] + [999_983], dtype=mx.int32)
    q, w, rows = (random_activations((3, heads, d), seed=21), random_activations((3, heads), seed=22) * 0.1,
                  random_activations((n, d), seed=23))
    scores, _, _ = emulated_pick(q, w, rows, positions, 64, tmp_path, rope=rope)
    finished = finish_rows(q, positions, rope, None, RowQuant.NONE, False)
    want = index_scores(finished, w, rows, visible_mask(n, positions))
    assert registry.disagreement(mx.array(scores), want, SCORE_TOLERANCE) is None


@pytest.mark.slow
@pytest.mark.parametrize(("n", "top_k"), [(600, TOP_K), (2050, TOP_K), (300, 64)], ids=str)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_emulated_cuda_kernels_finish_queries_as_the_model_does(on_cpu, n, top_k, quant, tmp_path):
    """q_b's output finished in the score kernel (RoPE at positions up to 999_983, then Hadamard + FP4 or not)
    picks what the model's composition (finish_rows, then pick_rows) picks; the scores are exact."""
    q, w, rows, positions = raw_queries(n, top_k, quant, seed=n + int(quant))
    scores, picked, valid = emulated_pick(q, w, rows, positions, top_k, tmp_path, 1.0 / 16, ROPE, quant)
    want_picked, want_valid = pick_finished_rows(q, w, rows, positions, ROPE, quant, RATIO, top_k, 1.0 / 16)
    assert (picked == np.array(want_picked)).all() and (valid == np.array(want_valid)).all()
    finished = finish_rows(q, positions, ROPE, None, quant, False)
    wide = ((positions + 1) // RATIO > top_k).tolist()
    assert any(wide)
    want = np.array(index_scores(finished, w / 16, rows, visible_mask(n, positions)))
    assert (scores[wide] == want[wide]).all()


@pytest.mark.slow
def test_emulated_cuda_scores_scale_the_weights_as_the_model_does(on_cpu, tmp_path):
    """The decode step hands the kernel proj's outputs and the indexer's weight scale: the kernel's products
    w * scale are the reference's `weights * scale`, so exact inputs still give exact scores and picks."""
    q, w, rows, positions = queries(600, 64, seed=5, copies=3)
    scale = 1.0 / 16  # exact, as the inputs need; the model's 1/sqrt(8192) is a float32 product all the same
    scores, picked, valid = emulated_pick(q, w, rows, positions, 64, tmp_path, scale)
    want_picked, want_valid = pick_rows(q, w, rows, positions, RATIO, 64, scale)
    assert (picked == np.array(want_picked)).all() and (valid == np.array(want_valid)).all()
    wide = ((positions + 1) // RATIO > 64).tolist()
    assert (scores[wide] == np.array(index_scores(q, w * scale, rows, visible_mask(600, positions)))[wide]).all()


def test_two_tensor_score_threadgroups_fit_an_sm():
    """The tensor-core score kernel's planes at Flash's indexer shapes (64 heads of 128) leave room for a second
    threadgroup on an H200 SM (228 KB, 1 KB reserved a threadgroup), and its launch bounds ask for two."""
    assert 2 * (tensor_scores_bytes() + 1024) <= 228 * 1024
    assert TENSOR_SCORES_KERNEL.launch_bounds == (TENSOR_SCORE_WARPS * 32, 2)


def emulated_tensor_scores(q: mx.array, w: mx.array, rows: mx.array, positions: mx.array, top_k: int, tmp_path,
                           scale: float = 1.0) -> np.ndarray:
    """The tensor-core score kernel's CUDA text run on the CPU, as `tensor_scores` launches it (NaN where it writes
    nothing: queries with at most top_k visible rows)."""
    (t, h), (n, d) = w.shape, rows.shape
    hi, lo, row_scales = (np.array(a) for a in reference_split_rows(rows))
    q, w = (np.array(a, np.float32) for a in (q, w))
    (scores,) = emulated(TENSOR_SCORES_KERNEL, tensor_template(h, d, RATIO, top_k), tmp_path)(
        [q, w, hi, lo, row_scales, np.array(positions, np.int32), np.array([scale], np.float32),
         np.array([n], np.int32)], [(t, n)],
        (-(-n // TENSOR_SCORE_KEYS), t), TENSOR_SCORE_WARPS * 32)
    return scores


@pytest.mark.slow
@pytest.mark.parametrize(("n", "top_k"), [(2050, TOP_K), (300, 64)], ids=str)
def test_emulated_tensor_scores_are_exact_on_exact_inputs(on_cpu, n, top_k, tmp_path):
    """Exact inputs give exact scores on the tensor cores too (integer products and sums below 2^24; the weights in
    sixteenths): every visible row of a query that chooses, -inf past them, across threadgroups' row ranges and
    partly visible rounds; the select kernel then picks the reference's rows."""
    q, w, rows, positions = queries(n, top_k, seed=n)
    scale = 1.0 / 16
    scores = emulated_tensor_scores(q, w, rows, positions, top_k, tmp_path, scale)
    wide = ((positions + 1) // RATIO > top_k).tolist()
    assert any(wide) and not all(wide)
    want = np.array(index_scores(q, w * scale, rows, visible_mask(n, positions)))
    assert (scores[wide] == want[wide]).all()
    picked, valid = emulated(SELECT_KERNEL, select_template(n, RATIO, top_k), tmp_path)(
        [scores, np.array(positions, np.int32), np.array([n], np.int32)], [(len(wide), min(n, top_k))] * 2,
        (len(wide), 1), SELECT_THREADS,
        [np.int32, np.bool_])
    want_picked, want_valid = pick_rows(q, w, rows, positions, RATIO, top_k, scale)
    assert (picked == np.array(want_picked)).all() and (valid == np.array(want_valid)).all()


@pytest.mark.slow
def test_emulated_tensor_scores_do_not_depend_on_later_rows(on_cpu, tmp_path):
    """A query's scores from the tensor-core kernel are the same bits whether the buffer holds rows it cannot see
    yet or not (a later chunk's: another chunking), with its rows in other threadgroups' and warps' ranges."""
    q, w, rows, positions = float_inputs(1100, TOP_K)
    q, w, positions = q[:2], w[:2], positions[:2]  # they see top_k + 1 and 1099 rows
    longer = emulated_tensor_scores(q, w, rows, positions, TOP_K, tmp_path)
    shorter = emulated_tensor_scores(q, w, rows[:1099], positions, TOP_K, tmp_path)
    assert np.array_equal(longer[:, :1099], shorter)


@pytest.mark.slow
def test_emulated_tensor_scores_within_tolerance(on_cpu, tmp_path):
    """Float queries and rows: split half products, heads summed in another order, within SCORE_TOLERANCE."""
    q, w, rows, positions = float_inputs(1100, TOP_K)
    scores = emulated_tensor_scores(q, w, rows, positions, TOP_K, tmp_path)
    want = index_scores(q, w, rows, visible_mask(1100, positions))
    assert registry.disagreement(mx.array(scores), want, SCORE_TOLERANCE) is None
