"""Token sampling: ds4's temperature / top-k / top-p / min-p sampler, its RNG, OpenAI penalties and top logprobs.

The selection rules follow ds4.c `sample_top_p_min_p` (github.com/antirez/ds4):
- temperature <= 0: argmax, ties to the lowest id; so is any temperature below MIN_TEMPERATURE, which the float32
  draw cannot divide by (`SamplingParams.greedy`, the one place this rule is written);
- top_k = 0 and top_p = 1: p_i = exp((l_i - l_max) / T) over the whole vocabulary, tokens with p_i < min_p are
  dropped (min_p is relative to the top token, whose p is 1), and a token is drawn in proportion to p_i by walking
  the cumulative sum in id order;
- otherwise the candidates (the top_k best when top_k > 0, else every token) are sorted by logit, the min-p cut is
  p_i < min_p * p_top, the nucleus stops at the first token whose cumulative mass reaches top_p, and the draw walks
  that prefix in sorted order. With top_k, probabilities are normalised over the top_k candidates only.

Why numpy and not MLX for the draw: the logits are read back once per step (129280 float32 = 505 KiB, a few
microseconds on unified memory) and the rest runs on the host. On the CPU backend MLX measured 3-5x slower than
numpy on a 129280-vector (full-vocabulary path 1.5-1.9 ms vs 0.5 ms; a full sort 13 ms vs 2.8 ms), and the
data-dependent candidate sets of min-p and top-p need a host round trip anyway. The top-p path sorts only the
tokens that can be reached, not the vocabulary. Greedy steps (temperature 0, DSML structure) stay on the device and
read back one id.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field
from numbers import Real

import mlx.core as mx
import numpy as np

from .errors import RequestError

TOP_K_CAP = 1024
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
"""The smallest normal float32 (1.2e-38). Below it a temperature is 0 or subnormal in float32: 1e-46 rounds to 0
and the draw's `(l - l_max) / T` is 0 / 0 = NaN (every token dropped, token 0 chosen), and a subnormal T makes the
gaps overflow on the way. Such a temperature asks for the most likely token, so it is greedy."""
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one completion; out-of-range values raise RequestError when constructed.

    top_k = 0 turns top-k off (larger values are capped at 1024); seed None draws a fresh seed from the OS.
    presence_penalty / frequency_penalty follow OpenAI: over the tokens generated so far in this completion,
    logit[t] -= presence * (count[t] > 0) + frequency * count[t].
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature, "a number >= 0 (0 = greedy)", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _check_real("presence_penalty", self.presence_penalty, "a number in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_real("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]", lambda v: -2 <= v <= 2)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether each token is the argmax: temperature 0, or one too small to sample with (MIN_TEMPERATURE)."""
        return self.temperature < MIN_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_real(name: str, value: object, expected: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok(value):
        raise RequestError(f"{name} must be {expected}, got {value!r}")


class XorShift64Star:
    """ds4's RNG (ds4.c `sample_rng_next`): xorshift64* with multiplier 0x2545F4914F6CDD1D.

    A zero state is replaced by 0x9E3779B97F4A7C15, as in ds4, so every seed gives a usable stream.
    """

    def __init__(self, seed: int) -> None:
        self.state = seed & _U64

    def next_u64(self) -> int:
        x = self.state or 0x9E3779B97F4A7C15
        x ^= x >> 12
        x ^= (x << 25) & _U64
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & _U64

    def uniform(self) -> np.float32:
        """A draw in [0, 1): the top 24 bits of the output over 2^24, exact in float32 as in ds4."""
        return np.float32((self.next_u64() >> 40) / 16777216.0)


def fresh_seed() -> int:
    """The seed of a sampler given none: from the OS's random bytes and the clock."""
    return int.from_bytes(os.urandom(8), "little") ^ time.time_ns()


@dataclass
class Sampler:
    """Draws the tokens of one completion; `record` every emitted token so the penalties see it.

    Set `greedy_next` to force argmax (used by the engine while the model writes DSML tool-call structure); it
    stays in force until cleared.
    """

    params: SamplingParams
    greedy_next: bool = False
    counts: dict[int, int] = field(default_factory=dict)
    rng: XorShift64Star = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else fresh_seed()
        self.rng = XorShift64Star(seed)

    def record(self, token_id: int) -> None:
        self.counts[token_id] = self.counts.get(token_id, 0) + 1

    def apply_penalties(self, logits: mx.array) -> mx.array:
        """The logits less OpenAI's presence and frequency penalties for the tokens recorded so far."""
        p = self.params
        if not self.counts or (p.presence_penalty == 0 and p.frequency_penalty == 0):
            return logits
        ids = mx.array(list(self.counts), dtype=mx.int32)
        counts = mx.array(list(self.counts.values()), dtype=mx.float32)
        return logits.at[ids].subtract(p.presence_penalty + p.frequency_penalty * counts)

    def greedy(self, logits: mx.array) -> int:
        """Argmax of the raw logits (no penalties: forced structure must be the model's own best token)."""
        return argmax(logits)

    def sample(self, logits: mx.array) -> int:
        """One token from logits [V] under this sampler's settings."""
        if self.greedy_next:
            return self.greedy(logits)
        p = self.params
        logits = self.apply_penalties(logits.reshape(-1))
        if p.greedy:
            return argmax(logits)
        host = np.array(logits.astype(mx.float32))
        if p.top_k == 0 and p.top_p >= 1:
            return _sample_full_vocab(host, np.float32(p.temperature), np.float32(p.min_p), self.rng)
        return _sample_sorted(host, np.float32(p.temperature), p.top_k, np.float32(p.top_p), np.float32(p.min_p),
                              self.rng)


def argmax(logits: mx.array) -> int:
    """The id of the largest logit, the lowest id among ties (one id read back)."""
    return mx.argmax(logits.reshape(-1)).item()


def device_argmax(logits: mx.array, never: int | None = None) -> mx.array:
    """`argmax` left on the device: a lazy uint32 scalar (the lowest id among ties, the same op); never `never` (a
    token a probe must not end on: the bench's EOS)."""
    logits = logits.reshape(-1)
    return mx.argmax(logits if never is None else logits + _never_mask(logits.size, never))


@functools.cache
def _never_mask(size: int, never: int) -> mx.array:
    """0 everywhere but -inf at `never`: one add a step."""
    return mx.where(mx.arange(size) == never, -mx.inf, 0.0)


def _sample_full_vocab(logits: np.ndarray, temperature: np.float32, min_p: np.float32, rng: XorShift64Star) -> int:
    finite = np.isfinite(logits)
    if not finite.any():
        return int(np.argmax(logits))
    top = logits[finite].max()
    with np.errstate(invalid="ignore"):
        p = np.exp((logits - top) / temperature)
    keep = finite & (p >= min_p)
    cumulative = np.cumsum(np.where(keep, p, np.float32(0)))
    r = rng.uniform() * cumulative[-1]
    return int(np.argmax(keep & (cumulative >= r)))


def _sample_sorted(logits: np.ndarray, temperature: np.float32, top_k: int, top_p: np.float32,
                   min_p: np.float32, rng: XorShift64Star) -> int:
    ids = np.flatnonzero(np.isfinite(logits))
    if ids.size == 0:
        return int(np.argmax(logits))
    if top_k > 0:
        ids = ids[_best_ids(logits[ids], min(top_k, TOP_K_CAP))]
        p = np.exp((logits[ids] - logits[ids[0]]) / temperature)
        cumulative = np.cumsum(p)
        return int(ids[_draw_prefix(p, cumulative, cumulative[-1], top_p, min_p, rng)])
    p_all = np.exp((logits[ids] - logits[ids].max()) / temperature)
    total = np.cumsum(p_all)[-1]
    # Sort as few tokens as the result allows. The min-p walk never reaches a token with p < min_p * p_top (p_top = 1
    # here; a quarter of that bound leaves a margin far beyond rounding). And when the tokens above a small floor
    # already hold top_p of the mass, they are a prefix of the sorted order in which the nucleus ends.
    bound = min_p * np.float32(0.25)
    if bound < _NUCLEUS_FLOOR:
        head_ids, head_p = _sorted_above(logits, ids, p_all, _NUCLEUS_FLOOR)
        cumulative = np.cumsum(head_p)
        if cumulative[-1] / total >= top_p:
            return int(head_ids[_draw_prefix(head_p, cumulative, total, top_p, min_p, rng)])
    ids, p = _sorted_above(logits, ids, p_all, bound)
    return int(ids[_draw_prefix(p, np.cumsum(p), total, top_p, min_p, rng)])


_NUCLEUS_FLOOR = np.float32(1e-4)


def _sorted_above(
    logits: np.ndarray, ids: np.ndarray, p: np.ndarray, floor: np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens with p >= floor, by logit descending (equal logits by lowest id), and their p."""
    keep = p >= floor
    ids, p = ids[keep], p[keep]
    order = np.argsort(-logits[ids], kind="stable")
    return ids[order], p[order]


def _draw_prefix(p: np.ndarray, cumulative: np.ndarray, total: np.float32, top_p: np.float32, min_p: np.float32,
                 rng: XorShift64Star) -> int:
    """ds4's walk over sorted candidates: stop before the first p < min_p * p_top and after the token whose
    cumulative mass reaches top_p (of `total`), then draw in proportion to p over that prefix."""
    q = p / total
    n_min = np.count_nonzero(q >= q[0] * min_p)  # p falls along the sorted order, so this counts a prefix
    reached = cumulative / total >= top_p
    n_top = int(np.argmax(reached)) + 1 if reached.any() else p.size
    n = max(1, min(n_min, n_top))
    r = rng.uniform() * cumulative[n - 1]
    return int(np.argmax(cumulative[:n] >= r))


def _best_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first, equal values by lowest index (as ds4's insertion sort)."""
    if k < values.size:
        threshold = values[np.argpartition(-values, k - 1)[k - 1]]
        above = np.flatnonzero(values > threshold)
        ties = np.flatnonzero(values == threshold)[: k - above.size]
        candidates = np.concatenate([above, ties])
    else:
        candidates = np.arange(values.size)
    return candidates[np.argsort(-values[candidates], kind="stable")]


def top_logprobs(logits: mx.array, k: int) -> list[tuple[int, float, float]]:
    """The k most likely tokens as (id, logit, logprob), best first, ties by lowest id (ds4 --dump-logprobs).

    logprob = logit - logsumexp(logits) at temperature 1, computed in float64 from the float32 logits.
    """
    if k < 1:
        raise ValueError(f"top_logprobs needs k >= 1, got {k}")
    host = np.array(logits.reshape(-1).astype(mx.float32)).astype(np.float64)
    ids = _best_ids(host, min(k, host.size))
    finite = host[np.isfinite(host)]
    top = finite.max()
    log_z = top + math.log(np.exp(finite - top).sum())
    return [(int(i), float(host[i]), float(host[i] - log_z)) for i in ids]
