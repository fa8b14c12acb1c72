"""A model double for driving the real Engine: it makes the sampler pick scripted tokens.

The engine's rules (prefix reuse, sampling, stop strings, tool-block stops, finish reasons, cancellation) then run
for real over text the test chooses, which the tiny random model would never write.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ds4_mlx.engine import Engine
from ds4_mlx.tokenizer import Tokenizer


class ScriptedCache:
    """Counts the tokens fed; holds no arrays."""

    def __init__(self) -> None:
        self.n_tokens = 0

    def arrays(self) -> list[mx.array]:
        return []

    def snapshot(self) -> int:
        return self.n_tokens

    def restore(self, snap: int) -> None:
        self.n_tokens = snap


class ScriptedModel:
    """Makes the sampler pick `script[i]` at generation step i, whatever the sampling settings (one-hot logits).

    Step i is the i-th call since the cache was made or `play` was called (the last entry repeats); a caller that
    prefills in several chunks sets `step` back to 0 after every chunk but the last. Every token fed is recorded in
    `fed`. `delay` seconds pass in every call, and call number `fail_at` (counted like the steps, from 0) raises
    `failure`: a device failure during prefill or decode.
    """

    def __init__(self, vocab: int, script: list[int]) -> None:
        self.vocab = vocab
        self.script = script
        self.step = 0
        self.calls = 0
        self.fed: list[int] = []
        self.delay = 0.0
        self.fail_at: int | None = None
        self.failure: Exception = RuntimeError("scripted device failure")

    def play(self, script: list[int]) -> None:
        self.script = script
        self.step = self.calls = 0

    def new_cache(self, ctx: int) -> ScriptedCache:
        self.step = self.calls = 0
        return ScriptedCache()

    def __call__(self, tokens: mx.array, cache: ScriptedCache) -> mx.array:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.failure
        time.sleep(self.delay)
        self.fed += tokens.tolist()
        cache.n_tokens += tokens.size
        nxt = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return mx.where(mx.arange(self.vocab) == nxt, 100.0, -100.0)

    def decode(self, token: int, cache: ScriptedCache) -> tuple[None, mx.array]:
        """One token, as Model.decode takes it (no streams: a scripted model has no MTP block)."""
        return None, self(mx.array([token], dtype=mx.int32), cache)


def scripted_engine(tokenizer: Tokenizer, text: str, *, eos: bool = True,
                    ctx: int = 512) -> tuple[Engine, ScriptedModel]:
    """A real Engine whose model writes `text` (then EOS, unless `eos` is False)."""
    script = tokenizer.encode(text) + ([tokenizer.eos_id] if eos else [])
    model = ScriptedModel(tokenizer.vocab_size, script)
    return Engine(model, tokenizer, ctx), model
