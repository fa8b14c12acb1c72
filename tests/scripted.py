"""A model double for driving the real Engine: it makes the sampler pick scripted tokens.

The engine's rules (prefix reuse, sampling, stop strings, tool-block stops, finish reasons, cancellation) then run
for real over text the test chooses, which the tiny random model would never write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ds4_mlx.engine import Engine
from ds4_mlx.model.factory import preset_config
from ds4_mlx.tokenizer import Tokenizer


@dataclass(frozen=True)
class ScriptedSnapshot:
    n_tokens: int

    def arrays(self) -> list[mx.array]:
        return []


class ScriptedCache:
    """Counts the tokens fed; holds no arrays. A token taken back (`Session.take_back`) is unfed from its model."""

    def __init__(self, model: ScriptedModel) -> None:
        self.model = model
        self.n_tokens = 0

    def arrays(self) -> list[mx.array]:
        return []

    def snapshot(self) -> ScriptedSnapshot:
        return ScriptedSnapshot(self.n_tokens)

    def restore(self, snap: ScriptedSnapshot) -> None:
        self.n_tokens = snap.n_tokens

    def undo_point(self) -> ScriptedSnapshot:
        return ScriptedSnapshot(self.n_tokens)

    def take_back(self, point: ScriptedSnapshot) -> None:
        assert self.n_tokens == point.n_tokens + 1
        self.n_tokens = point.n_tokens
        self.model.unfeed()


class ScriptedModel:
    """Makes the sampler pick `script[i]` at generation step i, whatever the sampling settings (one-hot logits).

    A call that feeds exactly the token the previous call scripted is a decode step and moves to the next entry
    (the last entry repeats); any other call is prompt prefill and scripts entry 0, so a prompt may be prefilled
    in any number of chunks. (A prompt restored whole from a checkpoint samples its first token from the logits
    saved with it.) Every token fed is recorded in `fed`. `delay` seconds pass in every call, and call number
    `fail_at` (counted from 0 since the cache was made or `play` was called) raises `failure`: a device failure
    during prefill or decode.
    """

    def __init__(self, vocab: int, script: list[int]) -> None:
        self.config = preset_config("tiny")  # what the memory budget sizes prefill chunks by (memory.py)
        self.vocab = vocab
        self.script = script
        self.step = 0
        self.calls = 0
        self.fed: list[int] = []
        self._before: list[int] = []  # `step` before each call, to unfeed
        self.delay = 0.0
        self.fail_at: int | None = None
        self.failure: Exception = RuntimeError("scripted device failure")

    def play(self, script: list[int]) -> None:
        self.script = script
        self.step = self.calls = 0

    def new_cache(self, ctx: int) -> ScriptedCache:
        self.step = self.calls = 0
        return ScriptedCache(self)

    def _entry(self, step: int) -> int:
        return self.script[min(step, len(self.script) - 1)]

    def logits(self, step: int = 0) -> mx.array:
        """The one-hot logits that make the sampler pick entry `step`."""
        return mx.where(mx.arange(self.vocab) == self._entry(step), 100.0, -100.0)

    def __call__(self, tokens: mx.array, cache: ScriptedCache) -> mx.array:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.failure
        time.sleep(self.delay)
        ids = tokens.tolist()
        self.fed += ids
        cache.n_tokens += len(ids)
        self._before.append(self.step)
        self.step = self.step + 1 if ids == [self._entry(self.step)] else 0
        return self.logits(self.step)

    def unfeed(self) -> None:
        """Forgets the last one-token call, as a cache's take_back does."""
        self.fed.pop()
        self.step = self._before.pop()

    def decode(self, token: int | mx.array, cache: ScriptedCache) -> tuple[None, mx.array]:
        """One token, as Model.decode takes it (no streams: a scripted model has no MTP block)."""
        ids = token if isinstance(token, mx.array) else mx.array([token], dtype=mx.int32)
        return None, self(ids, cache)


def scripted_engine(tokenizer: Tokenizer, text: str, *, eos: bool = True,
                    ctx: int = 512) -> tuple[Engine, ScriptedModel]:
    """A real Engine whose model writes `text` (then EOS, unless `eos` is False)."""
    script = tokenizer.encode(text) + ([tokenizer.eos_id] if eos else [])
    model = ScriptedModel(tokenizer.vocab_size, script)
    return Engine(model, tokenizer, ctx), model
