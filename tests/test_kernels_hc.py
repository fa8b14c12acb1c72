"""The hyper-connection kernels (kernels/sublayers/hc.py) against their references, at Flash's shapes (GPU backends)."""

from __future__ import annotations

import re
from collections import Counter

import mlx.core as mx
import pytest

from ds4_mlx.kernels.sublayers import hc
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.machinery.dialect import CUDA, METAL, NEUTRAL_WORDS
from ds4_mlx.kernels.sublayers.hc import MIX_TOKENS, PRE_TOKENS, TOLERANCE, HCMix, HCPostPre, HCPre
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.graph import STAND_IN, VIEWS, graph_nodes
from ds4_mlx.model.hyper_connection import (MIX, POST_PRE, PRE, SPLIT, UPDATE, HyperConnection, PendingPost, mix,
                                            post_pre, pre, split, update)

N_HC, N_EMBD, ITERS, EPS, NORM_EPS = FLASH.n_hc, FLASH.n_embd, FLASH.sinkhorn_iters, FLASH.hc_eps, FLASH.rms_eps


def scaled(shape, seed, scale=1.0):
    return random_activations(shape, seed=seed) * scale


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_split_kernel_is_used_and_equals_reference(kernels_unforced, tokens):
    m = (2 + N_HC) * N_HC
    args = (scaled((tokens, m), 1, 3.0), scaled((3,), 2), scaled((m,), 3), scaled((tokens, N_HC, N_EMBD), 4), ITERS,
            EPS)
    got = SPLIT(*args)
    assert SPLIT.fast_path.decisions()[registry.current_backend(), ((N_HC, N_EMBD), ITERS, EPS)].fast
    for g, w in zip(got, split(*args)):
        assert mx.max(mx.abs(g - w)).item() <= TOLERANCE * mx.max(mx.abs(w)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_pre_kernels_are_used_and_equal_reference(kernels_unforced, tokens):
    """rms_norm + mix projection + split in two launches, against `pre` (the mix matmul, then SPLIT)."""
    m, k = (2 + N_HC) * N_HC, N_HC * N_EMBD
    args = (scaled((tokens, N_HC, N_EMBD), 13), scaled((m, k), 14, 2 / k**0.5), 1 + scaled((3,), 15, 0.2),
            scaled((m,), 16, 0.5), ITERS, EPS, NORM_EPS)
    got = PRE(*args)
    assert PRE.fast_path.decisions()[registry.current_backend(), ((N_HC, N_EMBD), ITERS, EPS, NORM_EPS)].fast
    for g, w in zip(got, pre(*args), strict=True):
        assert mx.max(mx.abs(g - w)).item() <= TOLERANCE * mx.max(mx.abs(w)).item()


@pytest.mark.parametrize("kernel", [hc.mix_kernel(NORM_EPS), hc.split_kernel(EPS), hc.PARTIALS_KERNEL, hc.collapse_kernel(EPS, NORM_EPS),
                                    hc.update_kernel(1), hc.update_kernel(2), hc.post_partials_kernel(1),
                                    hc.post_partials_kernel(2)], ids=lambda k: k.name)
def test_kernels_render_for_cuda_and_metal(kernel):
    """Every neutral word spelled out and every helper called defined, in both dialects (the GPU tests compile
    one of them; tests/test_kernels_emulated.py runs the CUDA text on the CPU)."""
    for target in (CUDA, METAL):
        source, header = target.render(kernel.source), target.header(kernel)
        assert not re.search(r"\b(" + "|".join(NEUTRAL_WORDS) + r")\b", source + header)
        for helper in set(re.findall(r"\bds4_\w+(?=\()", source)):
            assert re.search(rf"\b{helper}\(", header), f"{helper} is called but not defined"
        for open_, close in ("{}", "()", "[]"):
            assert source.count(open_) == source.count(close)


def test_fused_pre_takes_decode_sized_float32_inputs():
    """Longer chunks keep the mix matmul and HC_SPLIT; the Sinkhorn's lanes need n x n to divide 32."""
    fn = mx.zeros(((2 + N_HC) * N_HC, N_HC * N_EMBD))
    assert HCPre.fits(mx.zeros((PRE_TOKENS, N_HC, N_EMBD)), fn)
    assert not HCPre.fits(mx.zeros((PRE_TOKENS + 1, N_HC, N_EMBD)), fn)
    assert not HCPre.fits(mx.zeros((1, N_HC, N_EMBD), dtype=mx.bfloat16), fn)
    assert not HCPre.fits(mx.zeros((1, 3, 4096)), mx.zeros((15, 3 * 4096)))


def test_mix_kernel_takes_float32_chunks_of_mix_tokens():
    """Shorter chunks keep the rms_norm and the matmul (a few threadgroups would leave the GPU idle)."""
    fn = mx.zeros(((2 + N_HC) * N_HC, N_HC * N_EMBD))
    assert HCMix.fits(mx.zeros((MIX_TOKENS, N_HC * N_EMBD)), fn)
    assert not HCMix.fits(mx.zeros((MIX_TOKENS - 1, N_HC * N_EMBD)), fn)
    assert not HCMix.fits(mx.zeros((MIX_TOKENS, N_HC * N_EMBD), dtype=mx.bfloat16), fn)
    assert not HCMix.fits(mx.zeros((MIX_TOKENS, 1000)), mx.zeros((24, 1000)))  # not whole 128-value slices
    assert not HCMix.fits(mx.zeros((MIX_TOKENS, 1024)), mx.zeros((40, 1024)))  # more rows than a lane holds
    assert not HCMix.fits(mx.zeros((MIX_TOKENS, 1024)), mx.zeros((23, 1024)))  # rows in two halves


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [MIX_TOKENS, 8192 + 3])
def test_mix_kernel_is_used_and_equals_reference(kernels_unforced, tokens):
    """A chunk's mix in one launch against rms_norm + matmul; 8195 tokens leave the last threadgroup partly idle."""
    m, k = (2 + N_HC) * N_HC, N_HC * N_EMBD
    args = (scaled((tokens, k), 25), scaled((m, k), 26, 2 / k**0.5), NORM_EPS)
    got = MIX(*args)
    assert MIX.fast_path.decisions()[registry.current_backend(), ((m, k), NORM_EPS)].fast
    want = mix(*args)
    assert mx.max(mx.abs(got - want)).item() <= TOLERANCE * mx.max(mx.abs(want)).item()


def test_a_chunk_pre_is_two_launches_on_gpu_backends(on_cpu):
    """Planned for CUDA, a chunk of MIX_TOKENS tokens: the mix and the split, no rms_norm and no matmul."""
    m, k = (2 + N_HC) * N_HC, N_HC * N_EMBD
    args = (scaled((MIX_TOKENS, N_HC, N_EMBD), 27), scaled((m, k), 28, 2 / k**0.5), 1 + scaled((3,), 29, 0.2),
            scaled((m,), 30, 0.5), ITERS, EPS, NORM_EPS)
    mx.eval(*args[:4])
    with registry.planning("cuda"):
        nodes = graph_nodes(list(PRE(*args)))
    assert Counter(n for n in nodes.values() if n not in VIEWS) == {STAND_IN: 2}


@pytest.mark.gpu
@pytest.mark.parametrize("addends", [1, 2])
@pytest.mark.parametrize("tokens", [1, 5])
def test_update_kernel_is_used_and_equals_reference(kernels_unforced, tokens, addends):
    """The output whole, or as two addends (the MoE's routed and shared parts) that the kernel adds."""
    args = (scaled((tokens, N_EMBD), 5), scaled((tokens, N_HC, N_EMBD), 6), scaled((tokens, N_HC), 7),
            mx.softmax(scaled((tokens, N_HC, N_HC), 8), axis=-1), scaled((tokens, N_EMBD), 9) if addends == 2 else None)
    got = UPDATE(*args)
    assert UPDATE.fast_path.decisions()[registry.current_backend(), ((N_HC, N_EMBD), addends)].fast
    want = update(*args)
    assert mx.max(mx.abs(got - want)).item() <= TOLERANCE * mx.max(mx.abs(want)).item()


def post_pre_args(tokens: int, addends: int) -> tuple:
    m, k = (2 + N_HC) * N_HC, N_HC * N_EMBD
    return (scaled((tokens, N_EMBD), 17), scaled((tokens, N_EMBD), 18) if addends == 2 else None,
            scaled((tokens, N_HC, N_EMBD), 19), 2 * mx.sigmoid(scaled((tokens, N_HC), 20)),
            mx.softmax(scaled((tokens, N_HC, N_HC), 21), axis=-1), scaled((m, k), 22, 2 / k**0.5),
            1 + scaled((3,), 23, 0.2), scaled((m,), 24, 0.5), ITERS, EPS, NORM_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("addends", [1, 2])
@pytest.mark.parametrize("tokens", [1, 5])
def test_post_pre_kernels_are_used_and_equal_reference(kernels_unforced, tokens, addends):
    """An update and the next pre in two launches, against `post_pre` (`update`, then `pre`)."""
    args = post_pre_args(tokens, addends)
    assert HCPostPre.fits(*args[:6])
    got = POST_PRE(*args)
    key = ((N_HC, N_EMBD), addends, ITERS, EPS, NORM_EPS)
    assert POST_PRE.fast_path.decisions()[registry.current_backend(), key].fast
    for g, w in zip(got, post_pre(*args), strict=True):
        assert mx.max(mx.abs(g - w)).item() <= TOLERANCE * mx.max(mx.abs(w)).item()


def test_post_pre_apart_equals_the_reference_composition(on_cpu):
    """Where the fused kernels are not used (the CPU here; longer chunks), POST_PRE is UPDATE then PRE: the same
    bits as `update` followed by `pre`, the chunk path's reference."""
    for addends in (1, 2):
        args = post_pre_args(PRE_TOKENS + 1, addends)
        assert not HCPostPre.fits(*args[:6])
        for g, w in zip(POST_PRE(*args), post_pre(*args), strict=True):
            assert mx.array_equal(g, w).item()


def test_references_are_the_hyper_connection_formulas(on_cpu):
    """split/update are what ds4.c computes: pre-weighted collapse, post-weighted spread plus comb-mixed streams."""
    n, d = 3, 8
    m = (2 + n) * n
    mix, scale, base = scaled((2, m), 9), mx.array([0.5, 1.5, 2.0]), scaled((m,), 10)
    streams = scaled((2, n, d), 11)
    x, post, comb = split(mix, scale, base, streams, ITERS, EPS)
    pre = mx.sigmoid(mix[:, :n] * 0.5 + base[:n]) + EPS
    assert mx.allclose(x, mx.einsum("tr,trd->td", pre, streams), atol=1e-6)
    assert mx.allclose(post, 2 * mx.sigmoid(mix[:, n : 2 * n] * 1.5 + base[n : 2 * n]), atol=1e-7)
    assert mx.allclose(mx.sum(comb, axis=-2), mx.ones((2, n)), atol=1e-6)  # ends on a column step
    out = scaled((2, d), 12)
    want = post[:, :, None] * out[:, None, :] + mx.einsum("trc,trd->tcd", comb, streams)
    assert mx.allclose(update(out, streams, post, comb), want, atol=1e-6)


def test_a_pending_post_and_the_next_pre_are_two_launches_on_gpu_backends(on_cpu):
    """Planned for CUDA: a post with two addends and the pre after it are two kernels, no Add (three kernels and
    an Add apart); the last post alone (PendingPost.apply) is one."""
    args = post_pre_args(1, 2)
    out, addend, streams, post, comb, fn, scale, base = args[:8]
    hyper = HyperConnection(fn, scale, base, N_HC, ITERS, EPS, NORM_EPS)
    pending = PendingPost(out, addend, streams, post, comb)
    mx.eval(*pending.arrays(), fn, scale, base)
    with registry.planning("cuda"):
        fused = graph_nodes(list(hyper.pre_after(pending)))
        alone = graph_nodes([pending.apply()])
    assert Counter(n for n in fused.values() if n not in VIEWS) == {STAND_IN: 2}
    assert Counter(n for n in alone.values() if n not in VIEWS) == {STAND_IN: 1}
