"""The forward pass's building blocks, each against an independent definition.

Quantisation simulation against ml_dtypes; the Hadamard transform against its matrix; RoPE, hyper-connections and
routers against transformers 5.23.0's DeepSeek V4 modules; compressors against the pooling formula of ds4.c
written out in numpy; top-k against ds4's tie rule. Everything in float32.
"""

from __future__ import annotations

import math

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ds4_mlx.kernels.decode.fused_norm import Norm, apply
from ds4_mlx.model.compressor import Compressor, Frontier
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.factory import preset_config, reference_config
from ds4_mlx.model.hyper_connection import HyperConnection, HyperHead, PendingPost, sinkhorn
from ds4_mlx.model.moe import Router, softplus, swiglu
from ds4_mlx.model.quant_sim import (
    fp4_e2m1_roundtrip,
    fp8_e4m3_roundtrip,
    RowQuant,
    hadamard,
    round_to_f16,
    simulate_indexer_fp4,
    simulate_kv_fp8,
)
from ds4_mlx.model.rope import RoPE, Yarn, inverse_frequencies
from ds4_mlx.model.topk import mask_to_indices, top_k_indices, top_k_mask

TINY = preset_config("tiny")


class Dense:
    """A stand-in for model.linear.Linear over an in-memory float32 matrix (OUT, IN)."""

    half = None  # held dense, never as float16

    def __init__(self, w: np.ndarray):
        self.weight = mx.array(w.astype(np.float32))
        self.shape = w.shape

    def __call__(self, x: mx.array, norm: Norm | None = None) -> mx.array:
        return apply(x, norm) @ self.weight.T

    def folds(self, x: mx.array, norm: Norm) -> bool:
        return False  # no kernel: a norm is applied first, as Linear's dense form does


def hf_config(config=TINY) -> DeepseekV4Config:
    return DeepseekV4Config(**reference_config(config, bos_id=0, eos_id=1))


def np32(x: mx.array) -> np.ndarray:
    return np.array(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------------
# FP8 / FP4 / Hadamard (ds4.c)


def block_roundtrip_reference(x: np.ndarray, block: int, amax_floor: float, max_value: float, dtype) -> np.ndarray:
    """Power-of-two block scale 2^ceil(log2(amax/max)) computed with frexp, rounding done by ml_dtypes."""
    blocks = x.reshape(-1, block)
    amax = np.maximum(np.abs(blocks).max(axis=1, keepdims=True), np.float32(amax_floor)).astype(np.float32)
    mantissa, exponent = np.frexp((amax / np.float32(max_value)).astype(np.float32))
    scale = np.ldexp(np.float32(1), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
    scaled = np.clip(blocks / scale, -max_value, max_value).astype(np.float32)
    return (scaled.astype(dtype).astype(np.float32) * scale).reshape(x.shape)


def hard_values(rng: np.random.Generator, n_blocks: int, block: int) -> np.ndarray:
    """Blocks spanning magnitudes 1e-13..1e13, with zeros, exact ties and exact powers of two mixed in."""
    x = rng.standard_normal((n_blocks, block)).astype(np.float32)
    x *= np.exp(rng.uniform(-30, 30, (n_blocks, 1))).astype(np.float32)
    x[::7, :3] = 0.0
    x[::5, 5] = np.float32(2.0) ** rng.integers(-20, 20, size=x[::5, 5].shape)
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_roundtrip_matches_ml_dtypes(seed):
    x = hard_values(np.random.default_rng(seed), 400, 64)
    want = block_roundtrip_reference(x, 64, 1e-4, 448.0, ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np32(fp8_e4m3_roundtrip(mx.array(x))), want)


def test_fp8_ties_go_to_even():
    # amax 448 -> scale 1: these sit exactly halfway between two E4M3 values (subnormal and normal ranges)
    ties = [1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-10, 232.0, 440.0]
    x = np.zeros(64, np.float32)
    x[0] = 448.0
    x[1 : 1 + len(ties)] = ties
    x[20 : 20 + len(ties)] = [-t for t in ties]
    got = np32(fp8_e4m3_roundtrip(mx.array(x)))
    want = [1.0, 1.25, 16.0, 20.0, 0.0, 2.0**-8, 2.0**-7, 224.0, 448.0]
    np.testing.assert_array_equal(got[1 : 1 + len(ties)], want)
    np.testing.assert_array_equal(got[20 : 20 + len(ties)], [-w for w in want])
    np.testing.assert_array_equal(got, block_roundtrip_reference(x, 64, 1e-4, 448.0, ml_dtypes.float8_e4m3fn))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp4_roundtrip_matches_ml_dtypes(seed):
    x = hard_values(np.random.default_rng(seed), 400, 32)
    want = block_roundtrip_reference(x, 32, 6 * 2.0**-126, 6.0, ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(np32(fp4_e2m1_roundtrip(mx.array(x))), want)


def test_fp4_ties_go_to_even():
    x = np.zeros(32, np.float32)
    x[0] = 6.0  # scale 1
    x[1:8] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    got = np32(fp4_e2m1_roundtrip(mx.array(x)))
    np.testing.assert_array_equal(got[1:8], [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])


def test_block_scale_is_a_power_of_two_that_fits_amax():
    # amax exactly 448 * 2^k keeps scale 2^k; a hair above doubles it
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = 448.0 * 8
    x[1, 0] = np.nextafter(np.float32(448.0 * 8), np.float32(np.inf))
    x[:, 1] = 8.0 * 1.125 * 2.0**-6
    got = np32(fp8_e4m3_roundtrip(mx.array(x)))
    assert got[0, 1] == x[0, 1]  # scale 8: 1.125 * 2^-6 is a normal E4M3 value
    assert got[1, 1] == 0.125  # scale 16: 4.5 * 2^-9 is subnormal and rounds to the even 4 * 2^-9


def test_hadamard_equals_sylvester_matrix():
    n = 128
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], np.float64) / math.sqrt(n)
    x = np.random.default_rng(0).standard_normal((5, 3, n)).astype(np.float32)
    np.testing.assert_allclose(np32(hadamard(mx.array(x))), x @ h.T, rtol=0, atol=2e-6)  # f32 butterflies
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(mx.zeros((2, 96)))


def test_kv_and_indexer_simulation_touch_the_right_dims():
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((3, 512)).astype(np.float32)
    out = np32(simulate_kv_fp8(mx.array(kv), 64))
    np.testing.assert_array_equal(out[:, 448:], kv[:, 448:])  # RoPE dims stay exact
    np.testing.assert_array_equal(out[:, :448], np32(fp8_e4m3_roundtrip(mx.array(kv[:, :448]))))
    q = rng.standard_normal((2, 4, 128)).astype(np.float32)
    np.testing.assert_array_equal(np32(simulate_indexer_fp4(mx.array(q))),
                                  np32(fp4_e2m1_roundtrip(hadamard(mx.array(q)))))
    np.testing.assert_array_equal(np32(round_to_f16(mx.array(kv))), kv.astype(np.float16).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------
# RoPE (ds4.c)


def test_inverse_frequencies_equal_transformers():
    config = FLASH
    rotary = hf.DeepseekV4RotaryEmbedding(hf_config(config))
    yarn = Yarn(config.rope_scaling_factor, config.rope_orig_ctx, config.yarn_beta_fast, config.yarn_beta_slow)
    np.testing.assert_array_equal(inverse_frequencies(64, 10000.0), rotary.main_inv_freq.numpy())
    compressed = inverse_frequencies(64, 160000.0, yarn)
    np.testing.assert_array_equal(compressed, rotary.compress_inv_freq.numpy())
    assert rotary.compress_attention_scaling == 1.0  # no YaRN mscale, as in ds4
    plain = inverse_frequencies(64, 160000.0)
    # spec: pairs k <= 15 keep the base frequency, pairs k >= 25 are divided by 16, the ones between blend
    np.testing.assert_array_equal(compressed[:16], plain[:16])
    np.testing.assert_allclose(compressed[25:], plain[25:] / 16, rtol=1e-7)
    assert np.all((compressed[16:25] < plain[16:25]) & (compressed[16:25] > plain[16:25] / 16))


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope_rotation_equals_transformers(kind):
    config = hf_config()
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    yarn = Yarn(16.0, 65536, 32.0, 1.0) if kind == "compress" else None
    rope = RoPE(64, 160000.0 if kind == "compress" else 10000.0, yarn)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 4, 128)).astype(np.float32)  # (T, heads, head_dim)
    positions = np.array([0, 1, 2, 5, 17, 300, 4096, 65535, 1048575])
    cos, sin = rotary(torch.zeros(1), torch.tensor(positions)[None], layer_type=kind)
    xt = torch.tensor(x).transpose(0, 1)[None]  # [1, H, T, D]
    for inverse in (False, True):
        want = hf.apply_rotary_pos_emb(xt, cos, -sin if inverse else sin)[0].transpose(0, 1).numpy()
        got = np32(rope(mx.array(x), mx.array(positions), inverse=inverse))
        np.testing.assert_array_equal(got[..., :64], x[..., :64])
        # same float32 angles (bit-exact frequencies); cos/sin of them agree to about an ulp
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    roundtrip = rope(rope(mx.array(x), mx.array(positions)), mx.array(positions), inverse=True)
    np.testing.assert_allclose(np32(roundtrip), x, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Hyper-connections (ds4.c)


def random_hc_module(config: DeepseekV4Config, seed: int) -> hf.DeepseekV4HyperConnection:
    torch.manual_seed(seed)
    module = hf.DeepseekV4HyperConnection(config)
    with torch.no_grad():
        module.fn.normal_(0, 0.5 / math.sqrt(module.fn.shape[1]))
        module.base.normal_(0, 0.5)
        module.scale.copy_(1 + 0.2 * torch.randn(3))
    return module


def test_hyper_connection_equals_transformers():
    config = hf_config()
    module = random_hc_module(config, 0)
    streams = torch.randn(1, 7, 4, config.hidden_size)
    output = torch.randn(1, 7, config.hidden_size)
    with torch.no_grad():
        post_ref, comb_ref, collapsed_ref = module(streams)
        new_ref = post_ref.unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb_ref.transpose(-1, -2), streams)
    hc = HyperConnection(fn=mx.array(module.fn.detach().numpy()), scale=mx.array(module.scale.detach().numpy()),
                         base=mx.array(module.base.detach().numpy()), n_hc=4, sinkhorn_iters=20, hc_eps=1e-6,
                         norm_eps=1e-6)
    s = mx.array(streams[0].numpy())
    collapsed, post, comb = hc.pre(s)
    np.testing.assert_allclose(np32(collapsed), collapsed_ref[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np32(post), post_ref[0].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np32(comb), comb_ref[0].numpy(), rtol=1e-5, atol=1e-6)
    new = PendingPost(mx.array(output[0].numpy()), None, s, post, comb).apply()
    np.testing.assert_allclose(np32(new), new_ref[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np32(comb).sum(axis=-2), 1.0, atol=1e-5)  # ends on a column step


def test_sinkhorn_is_not_symmetric_in_its_use():
    logits = mx.array(np.random.default_rng(0).standard_normal((1, 4, 4)).astype(np.float32) * 3)
    comb = np32(sinkhorn(logits, 20, 1e-6))[0]
    np.testing.assert_allclose(comb.sum(axis=0), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=1e-3)
    assert np.abs(comb - comb.T).max() > 1e-2  # so post() must use comb[source, destination]


def test_hyper_head_equals_transformers():
    config = hf_config()
    torch.manual_seed(1)
    module = hf.DeepseekV4HyperHead(config)
    with torch.no_grad():
        module.hc_fn.normal_(0, 0.03)
        module.hc_base.normal_(0, 0.5)
        module.hc_scale.fill_(1.3)
    streams = torch.randn(1, 5, 4, config.hidden_size)
    with torch.no_grad():
        want = module(streams)[0].numpy()
    head = HyperHead(fn=mx.array(module.hc_fn.detach().numpy()), scale=mx.array(module.hc_scale.detach().numpy()),
                     base=mx.array(module.hc_base.detach().numpy()), hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(np32(head(mx.array(streams[0].numpy()))), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Compressors (ds4.c)


def reference_rows(a: np.ndarray, s: np.ndarray, ratio: int, width: int, norm: np.ndarray, rope: RoPE) -> np.ndarray:
    """Compressed rows of a whole sequence straight from the definition: per-dim softmax pooling over the window
    (ratio 4: previous window through lane 0 and own window through lane 1), RMSNorm, RoPE at c * ratio."""
    rows = []
    for c in range(a.shape[0] // ratio):
        own = slice(c * ratio, (c + 1) * ratio)
        if ratio == 4:
            prev = slice(max(c - 1, 0) * ratio, c * ratio)  # empty for c = 0
            values = np.concatenate([a[prev, :width], a[own, width:]])
            scores = np.concatenate([s[prev, :width], s[own, width:]])
        else:
            values, scores = a[own], s[own]
        weights = np.exp(scores - scores.max(axis=0)) / np.exp(scores - scores.max(axis=0)).sum(axis=0)
        pooled = (weights * values).sum(axis=0)
        rows.append(pooled / np.sqrt(np.mean(pooled**2) + 1e-6) * norm)
    rows = np.array(rows, np.float32).reshape(-1, width)
    positions = mx.arange(len(rows)) * ratio
    return np32(rope(mx.array(rows), positions)) if len(rows) else rows


def make_compressor(ratio: int, width: int, seed: int) -> tuple[Compressor, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    coff = 2 if ratio == 4 else 1
    d_in = 32
    wkv = rng.standard_normal((coff * width, d_in)).astype(np.float32) / np.sqrt(d_in)
    wgate = rng.standard_normal((coff * width, d_in)).astype(np.float32) / np.sqrt(d_in)
    ape = rng.standard_normal((ratio, coff * width)).astype(np.float32) * 0.5
    norm = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    rope = RoPE(16, 160000.0, Yarn(16.0, 65536, 32.0, 1.0))
    compressor = Compressor(kv=Dense(wkv), gate=Dense(wgate), ape=mx.array(ape), norm=mx.array(norm), ratio=ratio,
                            width=width, rope=rope, quant=RowQuant.NONE, eps=1e-6)
    x = rng.standard_normal((300, d_in)).astype(np.float32)
    a = x @ wkv.T
    s = x @ wgate.T + ape[np.arange(len(x)) % ratio]
    return compressor, x, a, s


@pytest.mark.parametrize("ratio,width", [(4, 32), (128, 24)])
@pytest.mark.parametrize("split_seed", [0, 1, 2])
def test_compressor_rows_and_frontier_for_any_chunking(ratio, width, split_seed):
    compressor, x, a, s = make_compressor(ratio, width, seed=ratio)
    rng = np.random.default_rng(split_seed)
    cuts = sorted(int(c) for c in rng.choice(np.arange(1, len(x)), size=25, replace=False))
    frontier = Frontier.empty(ratio, width)
    rows, start = [], 0
    for stop in [*cuts, len(x)]:
        new, frontier = compressor(mx.array(x[start:stop]), start, frontier)
        rows.append(np32(new))
        start = stop
    got = np.concatenate(rows)
    want = reference_rows(a, s, ratio, width, np.array(compressor.norm), compressor.rope)
    assert got.shape == want.shape == (len(x) // ratio, width)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)

    # the frontier is ds4's streaming layout (ds4.c): for ratio 4, rows 0..3 = the last complete
    # window, rows 4.. = the leftover tokens; for ratio 128, rows 0.. = leftover; rows without a token are empty
    n, left = len(x), len(x) % ratio
    coff = 2 if ratio == 4 else 1
    kv, score = np32(frontier.kv), np32(frontier.score)
    current = ratio if ratio == 4 else 0
    np.testing.assert_allclose(kv[current : current + left], a[n - left :], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(score[current : current + left], s[n - left :], rtol=1e-6, atol=1e-6)
    assert np.all(kv[current + left :] == 0) and np.all(score[current + left :] == -np.inf)
    if ratio == 4:
        done = n - left
        np.testing.assert_allclose(kv[:4], a[done - 4 : done], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(score[:4], s[done - 4 : done], rtol=1e-6, atol=1e-6)
    assert kv.shape == score.shape == (coff * ratio, coff * width)


def test_first_ratio4_row_has_no_previous_window():
    compressor, x, a, s = make_compressor(4, 32, seed=3)
    rows, _ = compressor(mx.array(x[:4]), 0, Frontier.empty(4, 32))
    want = reference_rows(a[:4], s[:4], 4, 32, np.array(compressor.norm), compressor.rope)
    np.testing.assert_allclose(np32(rows), want, rtol=0, atol=2e-5)
    # a token-by-token feed of one window emits exactly one row, at its last token
    frontier, counts = Frontier.empty(4, 32), []
    for t in range(8):
        new, frontier = compressor(mx.array(x[t : t + 1]), t, frontier)
        counts.append(new.shape[0])
    assert counts == [0, 0, 0, 1, 0, 0, 0, 1]


# ---------------------------------------------------------------------------------------------------------------
# Top-k and routing (ds4.c)


def test_top_k_ties_go_to_the_lower_index():
    scores = mx.array([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    assert top_k_indices(scores, 2).tolist() == [[1, 2], [0, 1], [4, 5]]
    assert top_k_indices(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2], [3, 4, 5]]
    assert top_k_mask(scores, 6).tolist() == [[True] * 6] * 3
    rng = np.random.default_rng(0)
    s = rng.integers(0, 4, (50, 40)).astype(np.float32)  # many ties
    want = np.argsort(-s, axis=1, kind="stable")[:, :7]  # stable sort = ties to the lower index
    np.testing.assert_array_equal(np.array(top_k_indices(mx.array(s), 7)), np.sort(want, axis=1))


def test_mask_to_indices_puts_real_entries_first():
    mask = mx.array([[True, False, False, True, False], [False, False, False, False, False]])
    idx = mask_to_indices(mask, 3)
    assert idx[0, :2].tolist() == [0, 3] and mx.take_along_axis(mask, idx, axis=-1)[1].tolist() == [False] * 3


def test_router_equals_transformers_topk_router():
    config = hf_config()
    torch.manual_seed(0)
    module = hf.DeepseekV4TopKRouter(config)
    with torch.no_grad():
        module.weight.normal_(0, 1 / math.sqrt(config.hidden_size))
        module.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(33, config.hidden_size)
    with torch.no_grad():
        _, weights_ref, ids_ref = module(x)
    order = torch.argsort(ids_ref, dim=-1)
    ids_ref, weights_ref = torch.gather(ids_ref, 1, order).numpy(), torch.gather(weights_ref, 1, order).numpy()
    router = Router(gate=Dense(module.weight.detach().numpy()), bias=mx.array(module.e_score_correction_bias.numpy()),
                    tid2eid=None, n_used=config.num_experts_per_tok, scale=1.5)
    ids, weights = router(mx.array(x.numpy()), mx.zeros(33, dtype=mx.int32))
    np.testing.assert_array_equal(np.array(ids), ids_ref)
    np.testing.assert_allclose(np32(weights), weights_ref, rtol=1e-5)


def test_hash_router_takes_experts_from_the_table_and_weights_from_the_gate():
    config = hf_config()
    torch.manual_seed(1)
    module = hf.DeepseekV4HashRouter(config)
    with torch.no_grad():
        module.weight.normal_(0, 1 / math.sqrt(config.hidden_size))
        module.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(config.vocab_size)]))
    x = torch.randn(10, config.hidden_size)
    tokens = torch.randint(0, config.vocab_size, (10,))
    with torch.no_grad():
        _, weights_ref, ids_ref = module(x, tokens)
    router = Router(gate=Dense(module.weight.detach().numpy()), bias=mx.array(np.full(8, 100.0, np.float32)),
                    tid2eid=mx.array(module.tid2eid.numpy().astype(np.int32)), n_used=2, scale=1.5)
    ids, weights = router(mx.array(x.numpy()), mx.array(tokens.numpy().astype(np.int32)))
    np.testing.assert_array_equal(np.array(ids), ids_ref.numpy())  # the bias plays no part on hash layers
    np.testing.assert_allclose(np32(weights), weights_ref.numpy(), rtol=1e-5)


def test_router_ties_pick_the_lower_expert_and_bias_only_selects():
    d = 16
    v = np.ones(d, np.float32) / d
    gate = np.stack([-v, v, -v, v, -v, v, -v, -v])  # experts 1, 3, 5 tie for the top score
    router = Router(gate=Dense(gate), bias=None, tid2eid=None, n_used=2, scale=1.5)
    ids, weights = router(mx.ones((1, d)), mx.zeros(1, dtype=mx.int32))
    assert ids.tolist() == [[1, 3]]
    np.testing.assert_allclose(np32(weights), [[0.75, 0.75]], rtol=1e-6)
    bias = np.zeros(8, np.float32)
    bias[0] = 10.0  # selects expert 0 although its score is low; its weight stays the unbiased score
    biased = Router(gate=Dense(gate), bias=mx.array(bias), tid2eid=None, n_used=2, scale=1.5)
    ids, weights = biased(mx.ones((1, d)), mx.zeros(1, dtype=mx.int32))
    assert ids.tolist() == [[0, 1]]
    low, high = math.sqrt(math.log1p(math.exp(-1.0))), math.sqrt(math.log1p(math.exp(1.0)))
    np.testing.assert_allclose(np32(weights), [[1.5 * low / (low + high), 1.5 * high / (low + high)]], rtol=1e-6)


def test_softplus_and_clamped_swiglu():
    z = np.array([-30.0, -20.5, -1.0, 0.0, 3.0, 19.9, 20.1, 50.0], np.float32)
    want = torch.nn.functional.softplus(torch.tensor(z)).numpy()
    # MLX's float32 exp is accurate to ~1e-6 relative far from 0 (exp(-30) here)
    np.testing.assert_allclose(np32(softplus(mx.array(z))), want, rtol=1e-5, atol=0)
    gate = mx.array([12.0, -3.0, 0.5])
    up = mx.array([-11.0, 20.0, 0.25])
    got = np32(swiglu(gate, up, 10.0))
    silu = lambda g: g / (1 + math.exp(-g))  # noqa: E731
    np.testing.assert_allclose(got, [silu(10.0) * -10.0, silu(-3.0) * 10.0, silu(0.5) * 0.25], rtol=1e-6)


@pytest.mark.parametrize("shape", [(3,), (48, 2048), (1000, 7)])
def test_fused_swiglu_is_bit_identical_to_its_ops(shape):
    """swiglu and weighted_swiglu are one compiled (shapeless) kernel each: the same operations as MLX ops."""
    from ds4_mlx.model.moe import _swiglu, _weighted_swiglu, weighted_swiglu

    key = mx.random.key(len(shape))
    gate, up = (mx.random.normal(shape, key=k) * 8 for k in mx.random.split(key))
    for clamp in (10.0, 7.0):
        assert mx.array_equal(swiglu(gate, up, clamp), _swiglu(gate, up, clamp))
    if len(shape) == 2:
        weights = mx.random.uniform(shape=(shape[0],), key=key)
        assert mx.array_equal(weighted_swiglu(gate, up, weights, 10.0),
                              _weighted_swiglu(gate, up, weights.reshape(-1, 1), 10.0))


def test_compiled_sinkhorn_is_bit_identical():
    from ds4_mlx.model.hyper_connection import compiled_sinkhorn, sinkhorn

    logits = mx.random.normal((7, 4, 4), key=mx.random.key(3)) * 3
    assert mx.array_equal(compiled_sinkhorn(20, 1e-6)(logits), sinkhorn(logits, 20, 1e-6))
