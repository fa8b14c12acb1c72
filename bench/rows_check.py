"""Does a decode step over several sessions' rows equal each session's own step on this device?

    python bench/rows_check.py [--experts q2 q4] [--rows 3] [--trace]

For each expert layout, a tiny model (make-model, small vocabulary) with `--rows` sessions at different lengths:
one shared step (`Model.decode_rows`) against each session's own compiled step (`Model.decode`), once eagerly
(mx.compile off) and once compiled; prints each row's error relative to its largest logit. In the eager run every
fast path called is also run as its reference on the same inputs, and any that disagrees by more than 1e-3 of its
output's scale is printed: where the shared step is wrong but no fast path disagrees, the fault lies in a kernel
called without its fast path's wrapper (the matvecs) or in how the rows reach it. `DS4_REFERENCE_PATHS=name`
keeps a fast path on its reference for the run.

`--trace` (eager only) records, for every layer, each row's values at the sublayers' seams (the attention heads of
each row, the attention output, the router's picks and weights, the routed and shared experts' outputs) in the
shared step and in each session's own step, and prints the first seam where a row departs, with its error: the
sublayer a wrong row comes from. `--copy-rows` makes each row's slice of a product a fresh array (not a view into
the product), to tell a kernel that misreads a view from one that misreads its values.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.attention import Attention
from ds4_mlx.model.model import Model
from ds4_mlx.model.moe import MoE, Router
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


class Seams:
    """Each row's values at the sublayers' seams, in call order, while `on`."""

    def __init__(self):
        self.on = False
        self.calls: dict[str, list[list[mx.array]]] = {}
        self._wrap(Attention, "_step_row", lambda args, out: ("heads", [out[0]]))
        self._wrap(Attention, "step_rows", lambda args, out: ("attention", mx.split(out[0], out[0].shape[0])))
        self._wrap(MoE, "parts", lambda args, out: ("routed+shared", mx.split(out[0] + out[1], out[0].shape[0])))
        self._wrap(Router, "__call__", lambda args, out: ("router weights", mx.split(out[1], out[1].shape[0])))

    def _wrap(self, cls, name: str, record) -> None:
        real = getattr(cls, name)

        def wrapped(*args, **kw):
            out = real(*args, **kw)
            if self.on:
                seam, values = record(args, out)
                self.calls.setdefault(seam, []).append([mx.array(v) for v in values])
            return out

        setattr(cls, name, wrapped)

    def take(self) -> dict[str, list[mx.array]]:
        """The rows recorded since the last take, seam by seam, in call order (one list entry per row)."""
        taken = {seam: [row for call in calls for row in call] for seam, calls in self.calls.items()}
        self.calls = {}
        return taken


def trace(model: Model, rows: int, seams: Seams) -> None:
    """The first seam, layer by layer, where a row of the shared step departs from its session's own step."""
    mx.disable_compile()
    try:
        caches = [model.new_cache(256) for _ in range(rows)]
        for i, cache in enumerate(caches):
            model.prefill(mx.array(list(range(3 + i, 60 + 20 * i)), dtype=mx.int32), cache)
        tokens = mx.array([5 + i for i in range(rows)], dtype=mx.int32)
        positions = mx.array([c.n_tokens for c in caches], dtype=mx.int32)
        seams.on = True
        _, shared_logits, _, _ = model.step_rows(tokens, positions, [c.layers for c in caches], (1,) * rows)
        mx.eval(shared_logits)
        shared = seams.take()
        own = []
        for i, cache in enumerate(caches):
            _, logits, _, _ = model.step_rows(tokens[i : i + 1], positions[i : i + 1], [cache.layers], (1,))
            mx.eval(logits)
            own.append((seams.take(), logits))
        seams.on = False
        layers = len(model.blocks)
        for i, (seen, logits) in enumerate(own):
            report = f"  row {i}: logits off by {relative(shared_logits[i], logits[0]):.2g}"
            for layer in range(layers):
                bad = [f"{seam} {e:.2g}" for seam in seen if seam != "heads"
                       if (e := relative(shared[seam][layer * rows + i], seen[seam][layer])) > 1e-4]
                heads = relative(shared["heads"][layer * rows + i], seen["heads"][layer])
                if heads > 1e-4:
                    bad.insert(0, f"heads {heads:.2g}")
                if bad:
                    report += f"; first off at layer {layer}: " + ", ".join(bad)
                    break
            print(report)
    finally:
        mx.enable_compile()


def relative(a: mx.array, b: mx.array) -> float:
    return mx.max(mx.abs(a - b)).item() / max(mx.max(mx.abs(b)).item(), 1e-30)


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
    p.add_argument("--trace", action="store_true", help="the first sublayer seam where a row departs (eager)")
    p.add_argument("--copy-rows", action="store_true", help="each row's slice of a product a fresh array")
    args = p.parse_args()
    if args.copy_rows:
        split = mx.split
        mx.split = lambda a, *rest, **kw: [mx.array(part) + 0 for part in split(a, *rest, **kw)]
    watch = watch_fast_paths()
    seams = Seams() if args.trace else None
    folder = Path(tempfile.mkdtemp())
    print(f"device {mx.default_device()}, {args.rows} rows")
    for kind in args.experts:
        model = Model(open_weights(write_model(folder / f"{kind}.gguf", preset="tiny", experts=kind, vocab="small")))
        if seams is not None:
            print(f"{kind}, eager, seams:")
            trace(model, args.rows, seams)
            continue
        for compiled in (False, True):
            found = errors(model, args.rows, compiled, watch)
            print(f"{kind} {'compiled' if compiled else 'eager'}: rows off by "
                  + ", ".join(f"{e:.2g}" for e in found) + " of their largest logit")


if __name__ == "__main__":
    main()
