"""Does a decode step over several sessions' rows equal each session's own step on this device?

    python bench/rows_check.py [--experts q2 q4] [--rows 3]

For each expert layout, a tiny model (make-model, small vocabulary) with `--rows` sessions at different lengths:
one shared step (`Model.decode_rows`) against each session's own compiled step (`Model.decode`), once eagerly
(mx.compile off) and once compiled; prints each row's error relative to its largest logit. In the eager run every
fast path called is also run as its reference on the same inputs, and any that disagrees by more than 1e-3 of its
output's scale is printed: where the shared step is wrong but no fast path disagrees, the fault lies in a kernel
called without its fast path's wrapper (the matvecs) or in how the rows reach it. `DS4_REFERENCE_PATHS=name`
keeps a fast path on its reference for the run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights


def watch_fast_paths() -> list[bool]:
    """Makes every fast path call also run its reference while the returned flag is set, printing disagreements."""
    real = registry.FastPath.__call__
    on = [False]

    def checked(self, *args, key):
        out = real(self, *args, key=key)
        if on[0] and self.enabled(key):
            want = self.reference(*args)
            for got, ref in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
                if got.shape != ref.shape:
                    print(f"  {self.name}: shape {got.shape} against {ref.shape}")
                elif got.dtype == mx.float32:
                    error, scale = mx.max(mx.abs(got - ref)).item(), mx.max(mx.abs(ref)).item()
                    if error > 1e-3 * max(scale, 1e-9):
                        print(f"  {self.name} {key}: off by {error:.3g} of {scale:.3g}")
                elif not mx.array_equal(got, ref).item():
                    print(f"  {self.name} {key}: integer outputs differ")
        return out

    registry.FastPath.__call__ = checked
    return on


def errors(model: Model, rows: int, compiled: bool, watch: list[bool]) -> list[float]:
    if not compiled:
        mx.disable_compile()
    try:
        shared, own = ([model.new_cache(256) for _ in range(rows)] for _ in range(2))
        for i in range(rows):
            prompt = mx.array(list(range(3 + i, 60 + 20 * i)), dtype=mx.int32)
            for cache in (shared[i], own[i]):
                model.prefill(prompt, cache)
        want = [model.decode(5 + i, cache)[1] for i, cache in enumerate(own)]
        watch[0] = not compiled
        _, logits, _ = model.decode_rows([5 + i for i in range(rows)], shared)
        watch[0] = False
        mx.eval(logits, *want)
        return [mx.max(mx.abs(logits[i] - w)).item() / mx.max(mx.abs(w)).item() for i, w in enumerate(want)]
    finally:
        mx.enable_compile()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", nargs="+", default=["q2", "q4"])
    p.add_argument("--rows", type=int, default=3)
    args = p.parse_args()
    watch = watch_fast_paths()
    folder = Path(tempfile.mkdtemp())
    print(f"device {mx.default_device()}, {args.rows} rows")
    for kind in args.experts:
        model = Model(open_weights(write_model(folder / f"{kind}.gguf", preset="tiny", experts=kind, vocab="small")))
        for compiled in (False, True):
            found = errors(model, args.rows, compiled, watch)
            print(f"{kind} {'compiled' if compiled else 'eager'}: rows off by "
                  + ", ".join(f"{e:.2g}" for e in found) + " of their largest logit")


if __name__ == "__main__":
    main()
