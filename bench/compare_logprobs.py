"""Compares two greedy logprob dumps step by step: ds4-mlx's (`ds4-mlx run --dump-logprobs`) against another
engine's in the same JSON format (the C engine's `--dump-logprobs`, github.com/antirez/ds4), or against itself
under other kernels (`DS4_KERNELS=reference`).

    python bench/compare_logprobs.py ours.json theirs.json [--max-logprob-diff 0.05] [--min-overlap 18]

For each step it prints whether both chose the same token, how many of the top-K tokens both list, and the largest
difference of a logprob both list; the comparison stops at the first step where the choices differ (the two
continuations see different tokens after it). Exit status 1 when a step before that breaks a bound: a different
choice, fewer shared top tokens than `--min-overlap`, or a logprob difference above `--max-logprob-diff`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepDiff:
    step: int
    same_choice: bool
    shared: int
    top_k: int
    max_logprob_diff: float


def load_steps(path: Path) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise ValueError(f"{path}: expected a dump with a list of steps (ds4's --dump-logprobs format)")
    return steps


def compare(ours: list[dict], theirs: list[dict]) -> list[StepDiff]:
    """Step by step while both have steps, up to and including the first step whose choices differ."""
    out = []
    for a, b in zip(ours, theirs):
        top_a = {t["token"]["id"]: t["logprob"] for t in a["top_logprobs"]}
        top_b = {t["token"]["id"]: t["logprob"] for t in b["top_logprobs"]}
        shared = top_a.keys() & top_b.keys()
        diff = max((abs(top_a[i] - top_b[i]) for i in shared), default=float("inf"))
        same = a["selected"]["id"] == b["selected"]["id"]
        out.append(StepDiff(a["step"], same, len(shared), min(len(top_a), len(top_b)), diff))
        if not same:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ours", type=Path)
    p.add_argument("theirs", type=Path)
    p.add_argument("--max-logprob-diff", type=float, default=0.05,
                   help="largest logprob difference allowed on a shared top token (default 0.05)")
    p.add_argument("--min-overlap", type=int, default=18, help="fewest shared top-K tokens allowed (default 18)")
    args = p.parse_args(argv)
    try:
        diffs = compare(load_steps(args.ours), load_steps(args.theirs))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"compare_logprobs: error: {e}", file=sys.stderr)
        return 2
    failed = False
    for d in diffs:
        bad = not d.same_choice or d.shared < args.min_overlap or d.max_logprob_diff > args.max_logprob_diff
        failed |= bad
        print(f"step {d.step:3d}: {'same' if d.same_choice else 'DIFFERENT'} choice, {d.shared}/{d.top_k} top "
              f"tokens shared, largest logprob difference {d.max_logprob_diff:.4f}{'  <-' if bad else ''}")
    worst = max((d.max_logprob_diff for d in diffs), default=0.0)
    print(f"{len(diffs)} steps compared; largest logprob difference {worst:.4f}: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
