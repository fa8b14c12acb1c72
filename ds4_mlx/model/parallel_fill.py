"""Writing a random GGUF's tensor data with several processes (`ds4-mlx make-model --jobs N`).

Why: drawing random quant blocks runs at 50-450 MB/s per core in numpy (Q8_0 quantizing is the slowest), so the
81 GB `flash` file takes ~7 minutes on one core; the GPU machine, whose disk cannot hold it, must write it into a
tmpfs in the same call that benchmarks it. Each tensor's bytes depend only on the seed and its name, so workers
can draw tensors independently and write each at its offset in the already-laid-out file: the same bytes as the
one-process writer, N times sooner.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from .gguf import GGUFFile

Chunks = Callable[..., Iterator[bytes]]


def fill_tensors(path: Path, specs: Sequence, chunks: Chunks, jobs: int,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Writes every tensor's data into `path`, whose header and tensor directory are written and whose data is a
    hole, with `jobs` processes (largest tensors first, so that the last ones to finish are small)."""
    with GGUFFile.open(path) as file:
        offsets = {name: info.offset for name, info in file.tensors.items()}
        total = file.size
    done = total - sum(spec.n_bytes for spec in specs)  # the header and alignment padding are written already
    ordered = sorted(specs, key=lambda spec: -spec.n_bytes)
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_fill_one, str(path), spec, offsets[spec.name], chunks) for spec in ordered]
        for future in as_completed(futures):
            done += future.result()
            if progress is not None:
                progress(done, total)


def _fill_one(path: str, spec, offset: int, chunks: Chunks) -> int:
    """Draws one tensor and writes it at its offset; returns its size."""
    fd = os.open(path, os.O_WRONLY)
    try:
        pos = offset
        for chunk in chunks(spec):
            pos += os.pwrite(fd, chunk, pos)
    finally:
        os.close(fd)
    if pos - offset != spec.n_bytes:
        raise RuntimeError(f"{spec.name}: wrote {pos - offset} bytes, expected {spec.n_bytes}")
    return spec.n_bytes
