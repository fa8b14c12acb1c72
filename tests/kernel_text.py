"""What a kernel definition hands to MLX, for tests that check the rendering without a GPU."""

from __future__ import annotations

from ds4_mlx.kernels import dialect


def rendered(kernel: dialect.Kernel, target: dialect.Dialect) -> dict:
    """(name, input_names, output_names, source, header) as `target` would hand them to mx.fast.<backend>_kernel."""
    seen: dict = {}
    dialect.Dialect(target.name, target.words, target.prelude, make=lambda **kw: seen.update(kw)).compile(kernel)
    return seen


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
