"""What the kernel tests share: the rendering a kernel definition hands to MLX (checked without a GPU), and decode
steps of the tiny model with the fast paths on and off (checked on one)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery import dialect, registry


def rendered(kernel: dialect.Kernel, target: dialect.Dialect) -> dict:
    """(name, input_names, output_names, source, header) as `target` would hand them to mx.fast.<backend>_kernel."""
    seen: dict = {}
    dialect.Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(kernel)
    return seen


def assert_renders_cleanly(out: dict, extra_words: tuple[str, ...] = ()) -> None:
    """A rendering (`rendered`) MLX can compile as it is: no neutral word (or `extra_words`) left in its text,
    brackets paired, every ds4_ helper it calls defined in its header, and no reference to the shape arguments MLX
    would then add for an input."""
    words = "|".join((*dialect.NEUTRAL_WORDS, *extra_words))
    assert not re.search(rf"\b({words})\b", out["source"] + out["header"])
    assert balanced(out["source"]) and balanced(out["header"])
    for helper in set(re.findall(r"\bds4_\w+(?=\()", out["source"])):
        assert re.search(rf"\b{helper}\(", out["header"]), f"{helper} is called but not defined"
    for name in out["input_names"]:
        assert not re.search(rf"\b{name}_(shape|strides|ndim)", out["source"])


def used_kinds(fast_path: registry.FastPath, config) -> set[str]:
    """The key-set kinds an attention fast path took on this backend for the model's head shape."""
    shape = (config.n_head, config.head_dim)
    return {key.kind for (backend, key), decision in fast_path.decisions().items()
            if backend == registry.current_backend() and decision.fast and (key.heads, key.head_dim) == shape}


def balanced(text: str) -> bool:
    """Whether braces, parentheses and brackets pair up in order (a rendering that lost or doubled one would not)."""
    for open_, close in ("{}", "()", "[]"):
        depth = 0
        for ch in text:
            depth += (ch == open_) - (ch == close)
            if depth < 0:
                return False
        if depth:
            return False
    return True


def tiny_decode_fast_and_reference(tmp_path: Path, experts: str) -> tuple[np.ndarray, np.ndarray]:
    """Logits of 8 decode steps of the tiny model (`experts`: "q2" or "q4") after a 16-token prompt, with the fast
    paths (any fallback warning is an error) and with the forced reference path. Activation simulation is off, so
    that no FP8/FP4 rounding step can amplify a reassociation difference."""
    from ds4_mlx.model.factory import write_model
    from ds4_mlx.model.model import Model
    from ds4_mlx.model.weights import open_weights

    weights = open_weights(write_model(tmp_path / f"tiny-{experts}.gguf", preset="tiny", experts=experts, seed=7))
    tokens = np.random.default_rng(11).integers(0, weights.config.n_vocab, 24).astype(np.int32)
    model = Model(weights, simulate_quant=False)

    def decode() -> np.ndarray:
        cache = model.new_cache(64)
        model.prefill(mx.array(tokens[:16]), cache)
        return np.stack([np.array(model(mx.array(tokens[i : i + 1]), cache)) for i in range(16, 24)])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = decode()
    with registry.forced_mode("reference"):
        reference = decode()
    return fast, reference
