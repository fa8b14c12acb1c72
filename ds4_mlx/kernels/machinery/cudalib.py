"""The CUDA libraries MLX's CUDA build uses, found for ctypes: the kernel cache's NVRTC (nvrtc.py) and the CUDA
runtime the loader copies with (model/pinned.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")


def load(name: str, bind: Callable[[ctypes.CDLL], T]) -> T:
    """`bind` of the first lib`name`.so that loads and binds (binding fails with AttributeError on a library that
    lacks a function): the one MLX loaded (in this process's mappings), else one in pip's nvidia packages (beside
    MLX or on sys.path), else one on the library path. OSError when none does."""
    for path in candidates(name):
        try:
            return bind(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
    raise OSError(f"no lib{name}.so found")


def candidates(name: str) -> list[str]:
    """Where lib`name`.so may be, in the order `load` tries them."""
    prefix = f"lib{name}.so"
    found: list[str] = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if Path(path).name.startswith(prefix) and path not in found:
                found.append(path)
    except OSError:
        pass
    for root in dict.fromkeys([mlx_root().parent, *(Path(p) for p in sys.path if p)]):  # pip's nvidia packages
        found += sorted(str(p) for p in root.glob(f"nvidia/*/lib/{prefix}*"))
    found += [n for n in (ctypes.util.find_library(name), f"{prefix}.13", f"{prefix}.12", prefix) if n]
    return found


def mlx_root() -> Path:
    """MLX's package folder (its bundled headers are under include/)."""
    return Path(mx.__file__).resolve().parent
