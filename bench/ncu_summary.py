"""What Nsight Compute saw in each kernel of a report: duration, issue rate, warp stall reasons, and the executed
SASS by opcode (how many instructions of each kind a tensor-core instruction costs), the memory units' and the
tensor pipe's busy shares, and the instructions where warps waited most.

    ncu --set full -k regex:ds4_ -o /tmp/rep python3 bench/prefill_gemms.py --once
    python bench/ncu_summary.py /tmp/rep.ncu-rep [--ncu /usr/local/cuda/bin/ncu] [--listings DIR]

With --listings, each kernel's first launch is also written out whole, one SASS line a row with its executed count,
stall samples and their main reason (DIR/NAME.sass.txt): the loop around the hot instructions, to read at leisure.

The GPU machine has Nsight Compute (/usr/local/cuda/bin/ncu; bench/h200_cycle.sh's `ncu` step runs both). Under
ncu the SM clock is locked to its base (1.36 GHz on the H200), so durations are longer than the benchmarks'.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
from collections import Counter
from pathlib import Path


TOP = 6
"""Instructions listed per kernel: those with the most stall samples, with their most frequent reason."""
THROUGHPUT = (("L2", "lts__throughput.avg"), ("DRAM", "dram__throughput.avg"), ("L1", "l1tex__throughput.avg"),
              ("tensor", "sm__pipe_tensor_op"), ("shared", "sm__pipe_shared_cycles_active.avg"))
"""Units whose busy share of the elapsed time is printed: where a kernel that issues little is held."""


def export(ncu: str, report: str, *args: str) -> str:
    return subprocess.run([ncu, "-i", report, *args], capture_output=True, text=True, check=True).stdout


def launches(ncu: str, report: str) -> list[dict[str, str]]:
    """One row of raw metrics per profiled launch (durations in ms, clocks in GHz: the units ncu chose, row 2)."""
    rows = list(csv.reader(io.StringIO(export(ncu, report, "--page", "raw", "--csv"))))
    header = rows[0]
    return [dict(zip(header, row)) for row in rows[2:]]


def sass(ncu: str, report: str, index: int) -> list[dict[str, str]]:
    """The launch's SASS lines with their executed counts and stall samples."""
    text = export(ncu, report, "--page", "source", "--csv", "--print-source", "sass", "--launch-skip", str(index),
                  "--launch-count", "1")
    rows = list(csv.reader(io.StringIO(text[text.index('"Address"'):])))
    return [dict(zip(rows[0], row)) for row in rows[1:]]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summary(metrics: dict[str, str], lines: list[dict[str, str]]) -> None:
    name = metrics.get("Kernel Name", "?").split("(")[0].removeprefix("custom_kernel_")
    print(f"== {name}")
    print(f"   {metrics.get('gpu__time_duration.sum', '?')} ms at "
          f"{metrics.get('smsp__cycles_elapsed.avg.per_second', '?')} GHz, "
          f"{metrics.get('launch__registers_per_thread', '?')} registers, "
          f"{number(metrics.get('sm__warps_active.avg.pct_of_peak_sustained_active', '0')):.1f}% warps active, "
          f"issue slots busy {number(metrics.get('sm__inst_issued.avg.pct_of_peak_sustained_elapsed', '0')):.1f}%")
    busy = [(label, number(value)) for label, pattern in THROUGHPUT for key, value in metrics.items()
            if key.startswith(pattern) and key.endswith("pct_of_peak_sustained_elapsed")]
    print("   throughput: " + ", ".join(f"{label} {value:.0f}%" for label, value in busy))
    stalls: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    for line in lines:
        for key, value in line.items():
            if key.startswith("stall_") and "Not Issued" not in key:
                stalls[key.removeprefix("stall_")] += int(number(value))
        words = line.get("Source", "").split()
        if words:
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            ops[op.split(".")[0]] += int(number(line.get("Instructions Executed", "0")))
    total = sum(stalls.values()) or 1
    print("   stall samples: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in stalls.most_common(8)))
    hot = sorted(lines, key=lambda line: -number(line.get("Warp Stall Sampling (All Samples)", "0")))[:TOP]
    for line in hot:
        reasons = {k.removeprefix("stall_"): number(v) for k, v in line.items()
                   if k.startswith("stall_") and "Not Issued" not in k and k != "stall_selected"}
        reason = max(reasons, key=reasons.get) if reasons else "?"
        print(f"   {100 * number(line.get('Warp Stall Sampling (All Samples)', '0')) / total:4.1f}% "
              f"{reason:<14} {line.get('Source', '').strip()[:70]}")
    kind = "HGMMA" if ops["HGMMA"] else "HMMA"  # a warpgroup product counts once per warp
    mma = ops[kind] or 1
    executed = sum(ops.values())
    print(f"   executed {executed / 1e6:.0f} M instructions, {executed / mma:.1f} a {kind}: "
          + ", ".join(f"{k} {v / mma:.2f}" for k, v in ops.most_common(12)))


def listing(metrics: dict[str, str], lines: list[dict[str, str]], folder: Path) -> None:
    """The launch's whole SASS, each line with its executed count, stall samples and their most frequent reason."""
    name = metrics.get("Kernel Name", "?").split("(")[0].removeprefix("custom_kernel_")[:90]
    path = folder / f"{name}.sass.txt"
    if path.exists():
        return
    rows = []
    for line in lines:
        reasons = {k.removeprefix("stall_"): number(v) for k, v in line.items()
                   if k.startswith("stall_") and "Not Issued" not in k and k != "stall_selected"}
        samples = number(line.get("Warp Stall Sampling (All Samples)", "0"))
        reason = max(reasons, key=reasons.get) if samples and reasons else ""
        rows.append(f"{line.get('Address', ''):>8} {int(number(line.get('Instructions Executed', '0'))):>10} "
                    f"{int(samples):>6} {reason:<14} {line.get('Source', '').strip()}")
    path.write_text("\n".join(rows) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report")
    p.add_argument("--ncu", default="/usr/local/cuda/bin/ncu")
    p.add_argument("--listings", type=Path, help="write each kernel's first launch's whole SASS here")
    args = p.parse_args()
    if args.listings:
        args.listings.mkdir(parents=True, exist_ok=True)
    for index, metrics in enumerate(launches(args.ncu, args.report)):
        lines = sass(args.ncu, args.report, index)
        summary(metrics, lines)
        if args.listings:
            listing(metrics, lines, args.listings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
