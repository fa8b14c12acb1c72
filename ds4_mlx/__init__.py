"""ds4-mlx: a dedicated inference engine for DeepSeek V4 Flash GGUF files, on MLX.

Notebook use:

    import ds4_mlx
    engine = ds4_mlx.load("ds4flash.gguf", ctx=32768)   # or ds4_mlx.load(demo=True)
    for event in engine.generate(ds4_mlx.GenerationRequest(prompt=...)):
        ...
    engine.session.prefill(ids); engine.session.logits; snap = engine.session.snapshot()
"""

from __future__ import annotations

import os

# The reference path is the source of truth and computes in true float32. MLX otherwise lets float32 matmuls
# run as TF32 on GPUs that have it (relative error ~1e-3 per product, enough to flip indexer top-k picks).
# Set MLX_ENABLE_TF32=1 yourself to trade that exactness for speed.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"
__all__ = ["load", "Engine", "GenerationRequest", "SamplingParams", "__version__"]


def load(path: str | os.PathLike | None = None, ctx: int = 32768, *, demo: bool = False, **opts):
    """Loads a DeepSeek V4 Flash GGUF (or the built-in demo model) and returns its Engine."""
    from .engine import Engine

    if demo or path is None:
        return Engine.demo(ctx, **opts)
    return Engine.load(path, ctx, **opts)


def __getattr__(name: str):
    """Lazy exports, so `import ds4_mlx` stays cheap for the CLI."""
    if name in ("Engine", "GenerationRequest"):
        from . import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ds4_mlx' has no attribute {name!r}")
