"""One rank's routed-expert work under the two ways of splitting the experts over N ranks: by hidden columns (what
model/shard.py does) or by expert id. ms a MoE call, at Flash's expert widths, on this process's MLX device.

    python bench/expert_split.py                        # 2 ranks, 1 and 8 rows; ~10 min on two CPU cores
    python bench/expert_split.py --ranks 4 --rows 1 8 32

The banks are the model's own (model/linear.py's ExpertBank, model/moe.py's RoutedExperts) over random blocks of
Flash's types: gate and up IQ2_XXS, down Q2_K; n_embd 4096, n_ff_exp 2048, 256 experts, 6 chosen a row (random
top-6 of 256 per row and call, as a router's picks spread).

* columns: the rank holds 1/N of every expert's hidden columns (gate and up rows, down columns) and computes every
  chosen expert of every row at that width; every rank does the same work.
* id: the rank holds 256/N whole experts and computes the ones it owns among each row's chosen (each (row, expert)
  pair once, its output added into its row); the ranks' shares of a call differ, and the step waits for the
  busiest, so a call's time is the slowest rank's.

Both take `RoutedExperts._gathered`, one product per (row, expert) pair: the path of a decode step of up to
FUSED_GATHER_ROWS rows where the fused expert kernels run (GPU backends). Elsewhere the model sends more than
GATHER_LIMIT pairs to the grouped path, a prefill's, which makes a float scratch of the whole bank on the CPU.

Either way the rank's output is a partial (rows, n_embd) float32 sum that one all_sum joins: the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import BLOCK_SIZES, GGMLType, TensorInfo
from ds4_mlx.model.linear import ExpertBank
from ds4_mlx.model.moe import RoutedExperts

EMBD, FF, EXPERTS, USED, CLAMP = 4096, 2048, 256, 6, 10.0
GATE_UP, DOWN = GGMLType.IQ2_XXS, GGMLType.Q2_K


class Banks:
    """Random expert tensors held in memory, read as a model file's (the TensorSource that ExpertBank reads)."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[TensorInfo, mx.array]] = {}

    def add(self, name: str, ggml_type: GGMLType, experts: int, out: int, cols: int, seed: int) -> None:
        blocks = random_blocks(ggml_type, experts * out, cols, seed=seed)
        elements, size = BLOCK_SIZES[ggml_type]
        nbytes = experts * out * cols // elements * size
        self.tensors[name] = (TensorInfo(name, (cols, out, experts), ggml_type, 0, nbytes), blocks)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name][0]

    def read(self, name: str, convert: Callable[[mx.array], tuple[mx.array, ...]]) -> list[mx.array]:
        return list(convert(self.tensors[name][1]))


def experts(banks: Banks, prefix: str, n: int, ff: int, seed: int) -> RoutedExperts:
    """n experts of hidden width ff, as one rank holds them."""
    banks.add(prefix + "gate", GATE_UP, n, ff, EMBD, seed)
    banks.add(prefix + "up", GATE_UP, n, ff, EMBD, seed + 1)
    banks.add(prefix + "down", DOWN, n, EMBD, ff, seed + 2)
    made = RoutedExperts(ExpertBank(banks, prefix + "gate"), ExpertBank(banks, prefix + "up"),
                         ExpertBank(banks, prefix + "down"), CLAMP)
    del banks.tensors[prefix + "gate"], banks.tensors[prefix + "up"], banks.tensors[prefix + "down"]
    return made


def timed(call: Callable[[], mx.array]) -> float:
    """ms of one evaluated call."""
    start = time.perf_counter()
    mx.eval(call())
    return (time.perf_counter() - start) * 1e3


def owned(bank: RoutedExperts, x: mx.array, ids: np.ndarray, weights: np.ndarray, first: int, last: int
          ) -> mx.array:
    """The id split's work of the rank holding experts [first, last): each (row, expert) pair it owns once."""
    rows, slots = np.nonzero((ids >= first) & (ids < last))
    if rows.size == 0:  # none of the rows chose its experts: its share of the sum is zeros
        return mx.zeros(x.shape, mx.float32)
    pairs = bank._gathered(x[mx.array(rows)], mx.array(ids[rows, slots] - first)[:, None],
                           mx.array(weights[rows, slots])[:, None])
    return mx.zeros(x.shape, mx.float32).at[mx.array(rows)].add(pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--calls", type=int, default=10, help="timed calls a case, each with its own picks (default 10)")
    args = p.parse_args()
    n = args.ranks
    if EXPERTS % n or FF % (256 * n):
        raise SystemExit(f"--ranks {n}: {EXPERTS} experts and {FF // 256} blocks of 256 columns must split evenly")
    mx.set_default_device(mx.cpu)
    banks = Banks()
    columns = experts(banks, "columns.", EXPERTS, FF // n, seed=1)
    by_id = [experts(banks, f"id{r}.", EXPERTS // n, FF, seed=10 + r) for r in range(n)]
    rng = np.random.default_rng(0)
    for rows in args.rows:
        x = random_activations((rows, EMBD), seed=rows)
        picks = [np.stack([rng.choice(EXPERTS, USED, replace=False) for _ in range(rows)]).astype(np.int32)
                 for _ in range(args.calls + 2)]
        weights = rng.uniform(0.1, 1.0, (rows, USED)).astype(np.float32)
        col_ms, id_ms, busiest = [], [], []
        for i, ids in enumerate(picks):
            col = timed(lambda: columns._gathered(x, mx.array(ids), mx.array(weights)))
            per_rank = [timed(lambda: owned(by_id[r], x, ids, weights, r * EXPERTS // n, (r + 1) * EXPERTS // n))
                        for r in range(n)]
            if i >= 2:  # the first calls warm up
                col_ms.append(col)
                id_ms.append(max(per_rank))
                busiest.append(max(int(((ids >= r * EXPERTS // n) & (ids < (r + 1) * EXPERTS // n)).sum())
                                   for r in range(n)))
        print(json.dumps({"ranks": n, "rows": rows, "columns_ms": round(statistics.median(col_ms), 2),
                          "id_busiest_ms": round(statistics.median(id_ms), 2),
                          "columns_pairs": rows * USED, "id_busiest_pairs": statistics.median(busiest),
                          "sum_bytes": rows * EMBD * 4}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
