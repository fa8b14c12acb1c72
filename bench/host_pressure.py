"""Runs a command on a host whose memory is mostly taken, sampling host and device memory: the check that a long
prompt never spills the model into host RAM (memory.py).

    python bench/host_pressure.py --fill-gb 80 --json out.json -- \\
        python3 -m ds4_mlx.cli bench --synthetic q2 --layers 28 --ctx-start 12288 --ctx-max 12288 --gen-tokens 16

`--fill-gb N` first writes an N GB file into a tmpfs (mounted for it, removed after: root only), as an 81 GB model
file in a tmpfs or a busy page cache does. Every `--interval` seconds it samples the host's MemAvailable, the
resident memory of the command's process tree, and the GPU's used memory (nvidia-smi, where there is one). The run
passes when the command exits 0 and the host's available memory fell by no more than the tree's own peak resident
memory plus `--slack-gb`: device arrays pushed out to the host show as a fall that no process's RSS explains.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1e9
FILL_DIR = Path("/mnt/ds4-fill")


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            status = (entry / "status").read_text()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")),
                        0)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def gpu_used() -> int | None:
    """The first GPU's used memory (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def fill(gb: float) -> Path:
    """An N GB file in a tmpfs of its own: host memory no process owns."""
    FILL_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(gb) + 2}g", "tmpfs", str(FILL_DIR)], check=True)
    path = FILL_DIR / "fill"
    subprocess.run(["fallocate", "-l", str(int(gb * GB)), str(path)], check=True)
    return path


def unfill() -> None:
    subprocess.run(["umount", str(FILL_DIR)], check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fill-gb", type=float, default=0.0)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--slack-gb", type=float, default=4.0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--label", default="")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    if args.fill_gb:
        fill(args.fill_gb)
    try:
        before = available()
        samples: list[tuple[float, int, int, int | None]] = []
        t0 = time.perf_counter()
        proc = subprocess.Popen(command)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append((time.perf_counter() - t0, available(), tree_rss(proc.pid), gpu_used()))
                done.wait(args.interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    finally:
        if args.fill_gb:
            unfill()
    seconds = time.perf_counter() - t0
    low = min(s[1] for s in samples)
    rss = max(s[2] for s in samples)
    gpus = [s[3] for s in samples if s[3] is not None]
    fall = before - low
    passed = rc == 0 and fall <= rss + args.slack_gb * GB
    result = {"label": args.label, "command": command, "fill_gb": args.fill_gb, "rc": rc, "seconds": round(seconds, 1),
              "available_before_gb": round(before / GB, 2), "available_min_gb": round(low / GB, 2),
              "available_fall_gb": round(fall / GB, 2), "peak_tree_rss_gb": round(rss / GB, 2),
              "peak_gpu_used_gb": round(max(gpus) / GB, 2) if gpus else None, "passed": passed,
              "samples": [(round(t, 1), a, r, g) for t, a, r, g in samples]}
    print(f"host_pressure {args.label}: rc {rc} in {seconds:.0f} s; host available {before / GB:.1f} GB before, "
          f"{low / GB:.1f} at lowest (fell {fall / GB:.1f}); peak RSS {rss / GB:.2f} GB; peak GPU used "
          f"{(max(gpus) / GB if gpus else float('nan')):.1f} GB: {'PASS' if passed else 'FAIL'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
