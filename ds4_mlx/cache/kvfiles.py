"""Safe files for the disk KV cache: what may be opened, how checkpoints are written, and their checksum.

The cache directory may be shared (by several servers, or with ds4), so nothing found in it is trusted:
* only regular files are opened, never through a symlink, and never in a way that can block (a FIFO named like a
  checkpoint would otherwise hang `open()` forever);
* a checkpoint is written to a temporary file created exclusively (`O_EXCL | O_NOFOLLOW`, mode 0600, so a planted
  symlink cannot redirect the write and the prompt text it holds is readable by its owner only), fsynced, renamed
  over the final name, and the directory fsynced, so the name never points at a half-written file, even after a
  power cut;
* temporary files of writers that are gone are removed at start-up;
* an existing directory that other users can write is refused: they could plant or replace checkpoints.

The checksum is zlib's CRC-32 (stdlib; 2.3 GB/s on one core of the build machine, faster than the float32
conversion of the payload it covers, and it releases the GIL on large buffers). It protects against bit rot and torn
copies, not against an attacker, which the directory checks are for.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import zlib
from pathlib import Path
from typing import BinaryIO

from ..errors import CacheFileError, Ds4Error

TEMP_INFIX = ".tmp."
_TEMP_NAME = re.compile(r"[0-9a-fA-F]{40}\.kv\.tmp\.(\d+)")
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))


def check_directory(directory: Path) -> None:
    """Refuse (Ds4Error, before the model loads) an existing cache directory that users other than its owner may
    write (the group or other write bit; a sticky bit does not help: others could still add files)."""
    try:
        st = os.stat(directory)
    except OSError:
        return  # absent: created 0700 by KvStore; unusable: KvStore warns, and requests go without the cache
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Ds4Error(f"--kv-disk-dir {directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                       f"they could plant or replace checkpoints and change this server's answers; run "
                       f"'chmod go-w {directory}' or choose a private directory")


def open_regular(path: Path, writable: bool = False) -> BinaryIO:
    """Open a cache file only if it is a regular file: symlinks are not followed, FIFOs and devices do not block
    the open (O_NONBLOCK) and are refused right after it. Raises CacheFileError for anything but a regular file."""
    flags = _READ_FLAGS if not writable else (_READ_FLAGS & ~os.O_RDONLY) | os.O_RDWR
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheFileError(f"{path} is a symlink; only regular files are read") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CacheFileError(f"{path} is not a regular file ({_kind(mode)})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "r+b" if writable else "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def create_temp(path: Path) -> tuple[BinaryIO, Path]:
    """A new temporary file next to `path` (`<name>.tmp.<pid>`, ds4's name), created exclusively with mode 0600.
    Whatever already holds that name (a leftover, a planted symlink) is unlinked, never followed."""
    tmp = path.with_name(f"{path.name}{TEMP_INFIX}{os.getpid()}")
    try:
        fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    return os.fdopen(fd, "wb"), tmp


def commit(f: BinaryIO, tmp: Path, path: Path) -> None:
    """Make a written temporary file the checkpoint `path`: fsync its data, rename it, fsync the directory (so the
    rename itself survives a crash). Closes `f`."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # some platforms cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete `<key>.kv.tmp.<pid>` files whose writer is no longer running (or is this process, which has written
    nothing yet: in a container a restarted server often gets the same pid). Returns what was removed."""
    removed = []
    try:
        names = [d.name for d in os.scandir(directory) if _TEMP_NAME.fullmatch(d.name)]
    except OSError:
        return removed
    for name in names:
        pid = int(_TEMP_NAME.fullmatch(name).group(1))
        if pid != os.getpid() and _alive(pid):
            continue
        try:
            os.unlink(directory / name)
            removed.append(directory / name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process (or unknown): leave its file alone
    return True


class CrcWriter:
    """Passes writes through to a file and keeps the CRC-32 of what went through since `reset`."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.crc = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self._f.write(data)


class CrcReader:
    """A read-only view of the next `n` bytes of a file that keeps the CRC-32 of what was read, so the payload reader
    sees exactly the payload (a trailer may follow) and the checksum costs no second pass over the data."""

    def __init__(self, f: BinaryIO, n: int, crc: int = 0) -> None:
        self._f = f
        self._left = n
        self.crc = crc

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        data = self._f.read(n)
        self._left -= len(data)
        self.crc = zlib.crc32(data, self.crc)
        return data
