"""The sampler against ds4's rules (ds4_cli.c, ds4_server.c), its RNG, OpenAI penalties and top logprobs."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import RequestError
from ds4_mlx.sampling import Sampler, SamplingParams, XorShift64Star, top_logprobs

LN = math.log


def draws(logits: list[float] | np.ndarray, n: int, seed: int = 1234, **params) -> Counter[int]:
    sampler = Sampler(SamplingParams(seed=seed, **params))
    x = mx.array(np.asarray(logits, dtype=np.float32))
    return Counter(sampler.sample(x) for _ in range(n))


def test_greedy_takes_the_lowest_id_among_ties() -> None:
    logits = mx.array([1.0, 3.0, 3.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=0, seed=1))
    assert sampler.sample(logits) == 1
    assert sampler.greedy(logits) == 1


def test_greedy_next_forces_argmax_until_cleared() -> None:
    logits = mx.array([0.0, 0.1, 0.0, 0.05])  # nearly flat: sampling picks other ids often
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.0, seed=5))
    sampler.greedy_next = True
    assert {sampler.sample(logits) for _ in range(50)} == {1}
    sampler.greedy_next = False
    assert len({sampler.sample(logits) for _ in range(50)}) > 1


def test_rng_is_xorshift64_star() -> None:
    # state 1: x ^= x >> 12 -> 1; x ^= x << 25 -> 0x2000001; x ^= x >> 27 -> 0x2000001; out = x * multiplier
    rng = XorShift64Star(1)
    assert rng.next_u64() == (0x2000001 * 0x2545F4914F6CDD1D) % 2**64
    assert rng.state == 0x2000001
    rng.next_u64()
    # step 2 by hand: x = 2^25 + 1; x ^= x >> 12 (= 2^13) -> 2^25 + 2^13 + 1; x ^= x << 25 -> 2^50 + 2^38 + 2^13 + 1
    # (2^25 cancels); x ^= x >> 27 (= 2^23 + 2^11) -> 2^50 + 2^38 + 2^23 + 2^13 + 2^11 + 1
    assert rng.state == 2**50 + 2**38 + 2**23 + 2**13 + 2**11 + 1
    # a zero state is replaced by the golden-ratio constant, as in ds4
    assert XorShift64Star(0).next_u64() == XorShift64Star(0x9E3779B97F4A7C15).next_u64()
    # seed 42 and seed 0, printed by ds4's C recurrence (uint64_t arithmetic) compiled with gcc
    rng = XorShift64Star(42)
    assert [rng.next_u64() for _ in range(3)] == [0x56CE4AB7719BA3A0, 0xC841EB53EBBB2DDA, 0xCA466BE0C9980276]
    assert XorShift64Star(0).next_u64() == 0x0D83B3E29A21487A
    u = XorShift64Star(42).uniform()
    assert u.dtype == np.float32 and float(u) == 0x56CE4A / 2**24
    values = [float(rng.uniform()) * 2**24 for _ in range(1000)]
    assert all(v == int(v) and 0 <= v < 2**24 for v in values)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = mx.array(np.zeros(64, dtype=np.float32))

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(seed=seed, min_p=0.0))
        return [sampler.sample(logits) for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(-1) == run(2**64 - 1)  # seeds are taken modulo 2^64


def test_unseeded_samplers_differ() -> None:
    assert Sampler(SamplingParams()).rng.state != Sampler(SamplingParams()).rng.state


def _chi_square(counts: Counter[int], expected: dict[int, float], n: int) -> float:
    return sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in expected.items())


LOGITS = [2.0, -1.0, 0.5, 1.5, -3.0, 0.0, 1.0, -0.5]


def _expected(temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """ds4's truncated distribution, written out independently in float64."""
    order = sorted(range(len(LOGITS)), key=lambda i: (-LOGITS[i], i))
    if top_k:
        order = order[:top_k]
    top = LOGITS[order[0]]
    p = {i: math.exp((LOGITS[i] - top) / temperature) for i in order}
    total = sum(p.values())
    if top_k == 0 and top_p >= 1:
        kept = [i for i in order if p[i] >= min_p]
    else:
        kept, mass = [], 0.0
        for i in order:
            if kept and p[i] < min_p * p[order[0]]:
                break
            kept.append(i)
            mass += p[i]
            if mass / total >= top_p:
                break
    z = sum(p[i] for i in kept)
    return {i: p[i] / z for i in kept}


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.05), (0.7, 0, 0.8, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 5, 0.9, 0.1), (2.0, 0, 1.0, 0.2)],
)
def test_empirical_distribution_matches_the_truncated_one(temperature, top_k, top_p, min_p) -> None:
    """Chi-square over 8000 draws with a fixed seed (so deterministic): the bound df + 5*sqrt(2*df) is about the
    99.99th percentile of the chi-square distribution for these df, and tokens outside the support never appear."""
    n = 8000
    expected = _expected(temperature, top_k, top_p, min_p)
    counts = draws(LOGITS, n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(counts) == set(expected)
    df = len(expected) - 1
    assert _chi_square(counts, expected, n) < df + 5 * math.sqrt(2 * df)


def test_min_p_cut_is_relative_to_the_top_token_after_temperature() -> None:
    logits = [0.0, LN(0.06), LN(0.04), LN(0.5), LN(0.049)]
    assert set(draws(logits, 2000, min_p=0.05)) == {0, 1, 3}
    # at T = 2, p = sqrt(ratio): 0.04 -> 0.2 and 0.049 -> 0.22 are kept
    assert set(draws(logits, 2000, min_p=0.05, temperature=2.0)) == {0, 1, 2, 3, 4}
    # sorted path (top_p < 1): the same cut relative to the top probability
    assert set(draws(logits, 2000, min_p=0.05, top_p=0.999)) == {0, 1, 3}


def test_top_p_stops_at_the_token_that_reaches_the_mass() -> None:
    logits = [LN(0.15), LN(0.5), LN(0.05), LN(0.3)]  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    assert set(draws(logits, 2000, min_p=0.0, top_p=0.45)) == {1}
    assert set(draws(logits, 2000, min_p=0.0, top_p=0.75)) == {1, 3}
    assert set(draws(logits, 2000, min_p=0.0, top_p=0.85)) == {1, 3, 0}
    assert set(draws(logits, 3000, min_p=0.0, top_p=0.97)) == {1, 3, 0, 2}


def test_top_k_keeps_the_best_k_and_lowest_ids_among_ties() -> None:
    assert set(draws([0.0, 1.0, 3.0, 2.0, -1.0], 1000, min_p=0.0, top_k=2)) == {2, 3}
    assert set(draws([1.0, 2.0, 2.0, 2.0, 2.0], 1000, min_p=0.0, top_k=2)) == {1, 2}


def test_top_k_is_capped_at_1024() -> None:
    flat = np.zeros(3000, dtype=np.float32)
    counts = draws(flat, 600, min_p=0.0, top_k=5000)
    assert max(counts) < 1024 and len(counts) > 300


def test_penalties_change_logits_exactly_as_openai_specifies() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, seed=1))
    logits = mx.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert np.array_equal(np.array(sampler.apply_penalties(logits)), np.array(logits))
    for token in (3, 3, 5):
        sampler.record(token)
    expected = np.array([1.0, 2.0, 3.0, 4.0 - (0.5 + 2 * 0.25), 5.0, 6.0 - (0.5 + 0.25)], dtype=np.float32)
    assert np.array_equal(np.array(sampler.apply_penalties(logits)), expected)


def test_penalties_steer_the_choice_but_not_forced_greedy() -> None:
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=0.5, seed=1))
    logits = mx.array([0.0, 1.0, 0.9])
    assert sampler.sample(logits) == 1
    sampler.record(1)
    assert sampler.sample(logits) == 2
    assert sampler.greedy(logits) == 1


def test_negative_frequency_penalty_encourages_repeats() -> None:
    sampler = Sampler(SamplingParams(temperature=0, frequency_penalty=-1.0, seed=1))
    sampler.record(0)
    assert sampler.sample(mx.array([0.0, 0.5])) == 0


def test_top_logprobs_are_normalised_and_ordered() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    top = top_logprobs(mx.array(logits), 5)
    assert [i for i, _, _ in top] == list(np.argsort(-logits, kind="stable")[:5])
    log_z = math.log(np.exp(logits.astype(np.float64)).sum())
    for i, logit, logprob in top:
        assert logit == float(logits[i])
        assert logprob == pytest.approx(float(logits[i]) - log_z, abs=1e-12)
    everything = top_logprobs(mx.array(logits), 500)
    assert len(everything) == 50
    assert math.fsum(math.exp(lp) for _, _, lp in everything) == pytest.approx(1.0, abs=1e-12)


def test_top_logprobs_ties_by_lowest_id() -> None:
    top = top_logprobs(mx.array([0.0, 2.0, 1.0, 2.0, 2.0]), 2)
    assert [i for i, _, _ in top] == [1, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a number >= 0"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p must be"),
        ({"min_p": -0.01}, r"min_p must be a number in \[0, 1\]"),
        ({"min_p": 1.01}, "min_p must be"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be"),
        ({"temperature": "1"}, "temperature must be"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_invalid_params_raise_request_error(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_boundary_params_are_accepted() -> None:
    SamplingParams(temperature=0, top_p=1, min_p=0, top_k=0, presence_penalty=-2, frequency_penalty=2, seed=0)


def _ds4_walk(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """A literal float64 port of ds4.c's sampler loops, to check the vectorised one and its shortcuts."""
    ids = [i for i in range(logits.size) if math.isfinite(logits[i])]
    if top_k == 0 and top_p >= 1:
        top = max(logits[i] for i in ids)
        p = {i: math.exp((logits[i] - top) / temperature) for i in ids}
        kept = [i for i in ids if p[i] >= min_p]
        r = u * sum(p[i] for i in kept)
        for i in kept:
            r -= p[i]
            if r <= 0:
                return i
        return kept[-1]
    order = sorted(ids, key=lambda i: (-logits[i], i))
    if top_k:
        order = order[: min(top_k, 1024)]
    p = [math.exp((logits[i] - logits[order[0]]) / temperature) for i in order]
    total = sum(p)
    filtered, mass = 0, 0.0
    for j in range(len(order)):
        if j > 0 and p[j] / total < (p[0] / total) * min_p:
            break
        mass += p[j]
        filtered += 1
        if mass / total >= top_p:
            break
    r = u * mass
    for j in range(filtered):
        r -= p[j]
        if r <= 0:
            return order[j]
    return order[filtered - 1]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, tail",
    [
        (1.0, 0, 1.0, 0.05, False),  # full-vocabulary walk
        (1.0, 0, 0.9, 0.05, False),  # sorted, min-p bound
        (1.0, 0, 0.9, 0.0, False),  # sorted, nucleus found above the floor
        (1.0, 0, 0.99, 0.0, True),  # sorted, heavy tail below the floor: falls back to every token
        (0.8, 50, 0.9, 0.02, False),  # top-k
    ],
)
def test_choices_equal_a_literal_port_of_ds4(temperature, top_k, top_p, min_p, tail) -> None:
    """Same logits, same RNG stream: every choice must be the same token. float64 vs float32 can differ only when a
    draw lands within rounding of a boundary; in the tail case a run of ~1000 equal tiny p's sits under a float32
    cumulative sum near 2, whose rounding is about one p, so there a choice may move by one or two places inside
    the run of equal logits (an equally likely token)."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(1500) * 2).astype(np.float32)
    if tail:
        logits[:] = -9.3  # p = 9.1e-5 each, under the 1e-4 floor, together 6.5% of the mass
        logits[:3] = [0.0, -0.5, -1.0]
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=99))
    reference_rng = XorShift64Star(99)
    x = mx.array(logits)
    chosen = [sampler.sample(x) for _ in range(150)]
    expected = [
        _ds4_walk(logits.astype(np.float64), temperature, top_k, top_p, min_p, float(reference_rng.uniform()))
        for _ in range(150)
    ]
    if tail:
        assert all(c == e or (logits[c] == logits[e] and abs(c - e) <= 2) for c, e in zip(chosen, expected))
        assert max(chosen) >= 3  # the tail below the floor is reachable
    else:
        assert chosen == expected


@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324, 1e-40, 1e-39])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (40, 1.0)])
def test_a_temperature_too_small_for_float32_is_greedy(temperature, top_k, top_p) -> None:
    """1e-46 rounds to 0 in float32 and a subnormal overflows the logit gaps (the draw once chose token 0).
    Every such temperature picks the argmax, on every sampling path."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.05, seed=3)
    assert params.greedy
    rng = np.random.default_rng(7)
    for _ in range(5):
        logits = rng.normal(size=300).astype(np.float32) * 5
        logits[0] = logits.min() - 1  # token 0 is the least likely: the old draw's answer is plainly wrong
        sampler = Sampler(params)
        assert sampler.sample(mx.array(logits)) == int(np.argmax(logits))


def test_the_smallest_normal_float32_temperature_still_samples() -> None:
    params = SamplingParams(temperature=float(np.finfo(np.float32).tiny), min_p=0.0, seed=1)
    assert not params.greedy and not SamplingParams(temperature=1e-30).greedy
    logits = mx.array([0.0, 0.0, 0.0, -1.0])  # three tied best tokens: a sampler draws among them
    sampler = Sampler(params)
    assert set(sampler.sample(logits) for _ in range(60)) == {0, 1, 2}
