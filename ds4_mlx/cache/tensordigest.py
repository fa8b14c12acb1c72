"""A digest of every byte of a model file's tensor data, computed once per file and cached.

The disk KV cache must never load a checkpoint of another model (kvidentity.py), and two models can differ in any
byte: a fine-tune or a requantization changes some values of some tensors and nothing else. So each tensor's data
is hashed whole (SHA-256 of its bytes, from the mapped file; the tensors are hashed on a few threads at once,
which hashlib lets run in parallel), and the digests are kept in a small JSON file under the cache directory
(`$XDG_CACHE_HOME/ds4-mlx/digests`, else `~/.cache/ds4-mlx/digests`; `$DS4_MLX_DIGEST_DIR` overrides it), so the
next start of the same file reads them back instead of reading the file again.

Why SHA-256 (hashlib, no extra dependency): it runs on the CPU's SHA instructions where they exist (x86 SHA-NI,
ARMv8), 1.8 GB/s a core on the machine of bench/RESULTS.md against 0.9 GB/s for BLAKE2b.

Invalidation: an entry is used only for the file it names (the resolved path) while that file's size, mtime,
ctime, inode and device all still equal those recorded when it was hashed, and while it has the same tensors.
Any write to the file changes its ctime, which no tool can set back, so an edited or replaced model is hashed
again. An entry is written only when the file did not change while it was hashed. A cache directory that cannot
be written (read-only, full) only means the digests are computed at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..model.gguf import GGUFFile

log = logging.getLogger("ds4_mlx.digest")

SCHEME = "sha256 of each tensor's bytes, v1"
"""Recorded in every entry: an entry of another scheme is not used."""
HASH_THREADS = 8


def digest_dir() -> Path:
    """Where the digests of model files are cached (see the module docstring)."""
    override = os.environ.get("DS4_MLX_DIGEST_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ds4-mlx" / "digests"


def tensor_digests(file: GGUFFile, cache_dir: Path | None = None) -> dict[str, bytes]:
    """The SHA-256 of every tensor's data by name: from the cache when its entry still holds for the file, else
    computed (and cached). `cache_dir` defaults to `digest_dir()`."""
    path = file.path.resolve()
    entry_path = (cache_dir or digest_dir()) / (hashlib.sha256(os.fsencode(path)).hexdigest()[:32] + ".json")
    before = _stamp(path)
    cached = _read_entry(entry_path, path, before, file)
    if cached is not None:
        return cached
    digests = compute_digests(file)
    if before is not None and before == _stamp(path) and before["size"] == file.size:
        _write_entry(entry_path, {"scheme": SCHEME, "path": os.fsdecode(path), **before,
                                  "tensors": {name: d.hex() for name, d in digests.items()}})
    return digests


def compute_digests(file: GGUFFile) -> dict[str, bytes]:
    """SHA-256 of each tensor's bytes, largest tensors first over HASH_THREADS threads."""
    names = sorted(file.tensors, key=lambda n: -file.tensors[n].nbytes)
    threads = max(1, min(HASH_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="ds4-mlx-digest") as pool:
        digests = pool.map(lambda name: hashlib.sha256(file.tensor_bytes(name)).digest(), names)
        return dict(zip(names, digests))


def _stamp(path: Path) -> dict[str, int] | None:
    """What must not change for a cached entry to hold."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


def _read_entry(entry_path: Path, path: Path, stamp: dict[str, int] | None,
                file: GGUFFile) -> dict[str, bytes] | None:
    if stamp is None:
        return None
    try:
        entry: Any = json.loads(entry_path.read_text(encoding="utf-8"))
        if (entry.get("scheme") != SCHEME or entry.get("path") != os.fsdecode(path)
                or any(entry.get(key) != value for key, value in stamp.items())):
            return None
        tensors = entry["tensors"]
        if set(tensors) != set(file.tensors):
            return None
        return {name: bytes.fromhex(tensors[name]) for name in file.tensors}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent, unreadable or damaged: computed again


def _write_entry(entry_path: Path, entry: dict[str, Any]) -> None:
    """Writes atomically (a private temporary file renamed over the entry); a failure is logged, not raised."""
    tmp = entry_path.with_name(f"{entry_path.name}.tmp{os.getpid()}")
    try:
        entry_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, entry_path)
    except OSError as e:
        log.debug("model digests not cached in %s: %s", entry_path.parent, e)
        try:
            tmp.unlink()
        except OSError:
            pass
