"""The decode attention kernel (kernels/decode/attention.py) at Flash's shapes with each head's keys shared by 1, 2, 4
or 8 threadgroups: GPU µs a call, and the output against the one-threadgroup kernel's.

    python bench/attention_plans.py      # on the GPU machine (torch for CUPTI); ~1 min

Why: one threadgroup a head puts Flash's 64 heads on 64 of the H200's 132 SMs, and the call over the window and
512 picked rows took 47 µs (0.98 ms of a 2k token's 8.2, bench/RESULTS.md, 2026-12-03). The split kernels
(SPLIT_HEAD) run SPLITS threadgroups a head and merge their shares in the last one; `splits_for` chooses from
these figures. The shapes are a ratio-4 layer's picks and a ratio-128 layer's visible rows at 2k and at 32k, and
the window alone. Timing as bench/matvec_plans.py: CUPTI over a chain of calls, each waiting for the one before.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from ds4_mlx.kernels.decode.attention import GROUPS, TOLERANCE, DecodeAttention, StepShape
from ds4_mlx.model.config import FLASH
from matvec_plans import gpu_us

SHAPES = {
    "window (2k)": (2047, "window", 0, 0, 0),
    "ratio-128 rows (2k)": (2047, "rows", 128, 2048 // 128 + 2, 0),
    "picked (2k)": (2047, "picked", 0, 0, 512),
    "ratio-128 rows (32k)": (32767, "rows", 128, 32768 // 128 + 2, 0),
}
"""(position, kind, ratio, buffer rows, picks): the decode step's three kinds of call (a picked call reads 512 rows
wherever they lie, so its time does not depend on the context)."""
SPLITS = [s for s in (1, 2, 4, 8) if s <= GROUPS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("attention_plans times the CUDA kernel: run it on the GPU machine")
    mx.set_default_device(mx.gpu)
    c = FLASH
    for name, (position, kind, ratio, rows, picks) in SHAPES.items():
        inputs = list(DecodeAttention._probe(StepShape(kind, c.n_head, c.head_dim, c.n_rot, c.sliding_window, ratio,
                                                       rows, picks)))
        inputs[1] = mx.array([position], dtype=mx.int32)  # the window full; the rows visible up to the position
        mx.eval([a for a in inputs if isinstance(a, mx.array)])
        first = None
        for splits in SPLITS:
            def launch(i: int, plan: int, after: mx.array | None = None) -> mx.array:
                q = inputs[0] * (1 + i / 64) + (0 if after is None else 0 * after)
                return DecodeAttention._kernel(q, *inputs[1:], splits=plan)

            us, out = gpu_us(launch, splits, kernel="decode_attention")
            first = out if first is None else first
            error = float(mx.max(mx.abs(out - first)) / mx.max(mx.abs(first)))
            row = {"name": name, "splits": splits, "us": round(us, 2), "rel_error": error, "ok": error <= TOLERANCE}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{name:>22} splits {splits}: {us:7.2f} us{'' if row['ok'] else '  DIFFERS'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
