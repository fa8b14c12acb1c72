"""This process's host memory, from /proc (Linux): what the streaming loader promises to bound.

The kernel counts a process's resident pages in three parts: `RssAnon` (private memory: the Python heap, MLX's
host buffers, staging copies), `RssFile` and `RssShmem` (pages of mapped files, a tmpfs file's included). The file
pages are the page cache, which the loader does not own; the anonymous part is what must stay bounded. `VmHWM` is
the peak of the three together since the last `reset_peak`.
"""

from __future__ import annotations

import resource
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_MEMINFO = Path("/proc/meminfo")


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem in bytes; {} where there is no /proc."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def available() -> int | None:
    """The machine's MemAvailable in bytes (what the OOM killer's pressure is about), or None without /proc."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss() -> int:
    """The process's peak RSS in bytes: VmHWM, else getrusage's ru_maxrss (bytes on macOS, KiB on Linux)."""
    hwm = status().get("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


@dataclass
class HostPeaks:
    """Peaks seen by a Sampler; 0 / None where /proc is missing."""

    rss: int = 0
    anon: int = 0
    min_available: int | None = None


class Sampler:
    """Samples RssAnon, VmRSS and MemAvailable from a thread while a block runs (`with Sampler() as s:`).

    Sampling can miss a peak shorter than `interval`; VmHWM (`peak_rss`) cannot, but counts mapped file pages."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peaks = HostPeaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds4-mlx-hostmem", daemon=True)

    def sample(self) -> None:
        s = status()
        self.peaks.rss = max(self.peaks.rss, s.get("VmRSS", 0))
        self.peaks.anon = max(self.peaks.anon, s.get("RssAnon", 0))
        free = available()
        if free is not None:
            low = self.peaks.min_available
            self.peaks.min_available = free if low is None else min(low, free)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
