"""The device memory budget: one limit for everything the process holds on the device, and prefill chunks sized to
stay under it.

Why: on CUDA nothing stops MLX from asking the card for more than it has. Its arrays come from the device's memory
pool; past the card, an allocation fails, or, where managed memory shares the card (arrays read on the host), the
driver evicts managed pages to host RAM, which on a host without that much free memory ends in the kernel's OOM
killer. The decode graphs read their arrays' addresses by a kernel so that the weights stay pool allocations
(kernels/machinery/cudagraph.py `address`; taken through numpy they became managed copies, evicted to the host:
bench/RESULTS.md, 2026-12-07), and the limit is kept here, by the engine:

- `device_limit()` is what the process may hold on the device: the card's memory less a reserve for what MLX does
  not count (the CUDA context, cuBLAS workspaces, the decode graphs' driver memory, NVRTC modules), and never more
  than what was free when it was first asked (other processes on the card). On Metal, the working set the device
  recommends; on the CPU, 90% of RAM. `--memory-limit SIZE` (`set_limit`) sets it.
- `apply_limit()` makes MLX keep its buffer cache under it (`mx.set_memory_limit`, `mx.set_cache_limit`: MLX
  returns cached buffers before an allocation would pass it).
- `chunk_transient_bytes` is what one prefill chunk of C tokens at position P holds beside the resident state, at
  most: a fixed part (first-use checks), a part per token (activations, the expert scratch, tensor-core splits,
  two layers in flight) and a part per token and compressed row (the indexer's scores over every ratio-4 row),
  measured on CUDA at Flash's widths (`bench/chunk_memory.py`) with a margin of ~15%. Metal's kernels were not
  measured: the same figures stand for them.
- `fit_chunk` picks the longest chunk, at most the session's preferred one, whose transients fit what is free; the
  session (session.py) asks it before every chunk, and when not even MIN_CHUNK tokens fit, the request is refused
  (`MemoryShortage`: the CLI's one line, the server's 503) before anything is allocated. For a model split across
  ranks (model/shard.py) every rank takes the shortest of the ranks' chunks (`agree_chunks`): their exchanges must
  have the same shapes; and a chunk that lacks room on one rank makes every rank give memory back (`lacks_room`),
  so that they drop the same RAM checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from typing import TYPE_CHECKING

from .errors import RequestError, ResourceError
from .model.config import ModelConfig
from .model.stream import device_memory_bytes, on_cuda

if TYPE_CHECKING:
    from .model.weights import ModelWeights

GIB = 1 << 30

CUDA_RESERVE_BYTES = 2 * GIB
"""Device memory MLX does not count and the limit leaves free on CUDA, beside CUDA_RESERVE_SHARE of the card: the
context and its module images, cuBLAS workspaces, the decode graphs' driver memory, the memory pool's rounding."""
CUDA_RESERVE_SHARE = 0.03
CPU_SHARE = 0.9
"""Of RAM, on the CPU backend (the weights are host arrays there)."""

TOKEN_FLOATS_FACTOR = 10.0
"""A chunk's transients per token, in floats per float of `token_width`: the activations, the routed experts'
float scratch, the tensor-core GEMMs' half splits, two layers in flight. Measured on an H100 at Flash's widths
(bench/chunk_memory.py, bench/RESULTS.md): 2.3-2.9 MB a token from 2,048 to 12,288 tokens, at 4 and at 12 layers
alike (a chunk is evaluated a layer at a time); 10 floats a float is 2.79 MB."""
ROW_BYTES = 8
"""A chunk's transients per token and ratio-4 compressed row: the indexer's float32 scores of a query over every
row, and their selection's copy (measured: ~5 bytes, 12,288 tokens from 0 to 65,536)."""
FIXED_HEADS = 1.0
"""A chunk's transients beside its tokens', in copies of the LM head as float32 (2 GiB at Flash's widths): a new
shape's first-use checks run the reference path (kernels/machinery/registry.py), which holds more than the kernels do
(measured: up to 1.6 GiB more at 2,048 tokens)."""

MIN_CHUNK = 16
"""The shortest chunk a prefill is split into; a position where not even this fits is refused."""
CHUNK_LADDER = (12288, 8192, 6144, 4096, 3072, 2048, 1536, 1024, 768, 512, 384, 256, 128, 64, 32, MIN_CHUNK)
"""The chunk sizes a shortened prefill takes, so that a tight budget makes few new shapes (each new shape runs its
kernels' first-use checks)."""


class MemoryShortage(RequestError):
    """The device has no room for a prefill chunk next to what it holds (weights, sessions, checkpoints)."""


_limit: int | None = None
_agree: Callable[[int], int] | None = None


def set_limit(nbytes: int | None) -> None:
    """Sets the limit (`--memory-limit`); None measures it again at the next `device_limit`."""
    global _limit
    _limit = nbytes


def device_limit() -> int:
    """Bytes the process may hold on the device (see the module docstring); measured once."""
    global _limit
    if _limit is None:
        _limit = _measured_limit()
    return _limit


def _measured_limit() -> int:
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    if on_cuda():
        total = int(info.get("total_memory", device_memory_bytes()))
        held = mx.get_active_memory() + mx.get_cache_memory()
        free = int(info.get("free_memory", total)) + held
        reserve = CUDA_RESERVE_BYTES + int(total * CUDA_RESERVE_SHARE)
        return max(0, min(total, free) - reserve)
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"])
    return int(device_memory_bytes() * CPU_SHARE)


def apply_limit() -> int:
    """Makes MLX keep its cached buffers within the limit; returns the limit."""
    limit = device_limit()
    mx.set_memory_limit(limit)
    mx.set_cache_limit(limit)
    return limit


@contextmanager
def limited(nbytes: int) -> Iterator[None]:
    """The limit set to `nbytes` within, then back to what it was."""
    saved = _limit
    set_limit(nbytes)
    try:
        yield
    finally:
        set_limit(saved)


def free_bytes() -> int:
    """What the limit leaves beside MLX's live arrays (the buffer cache is given back as allocations need it)."""
    return device_limit() - mx.get_active_memory()


def token_width(config: ModelConfig) -> int:
    """Floats of a token's widest activations in one layer: the hyper-connection streams, the attention heads, the
    routed experts' hidden rows and the indexer's heads."""
    return (config.n_hc * config.n_embd + config.n_head * config.head_dim
            + config.n_expert_used * config.n_ff_exp + config.indexer_n_head * config.indexer_head_dim)


def chunk_transient_bytes(config: ModelConfig, chunk: int, position: int) -> int:
    """At most what a prefill chunk of `chunk` tokens starting at `position` holds beside the resident state."""
    per_token = TOKEN_FLOATS_FACTOR * 4 * token_width(config)
    rows = (position + chunk) // 4 + 2 if any(config.compress_ratio(i) == 4 for i in range(config.n_layer)) else 0
    return int(FIXED_HEADS * 4 * config.n_vocab * config.n_embd + chunk * (per_token + ROW_BYTES * rows))


def agree_chunks(least: Callable[[int], int] | None) -> None:
    """Makes `fit_chunk` return `least(size)`: the smallest of the sizes every rank of a split model found."""
    global _agree
    _agree = least


def fit_chunk(config: ModelConfig, preferred: int, position: int, free: int) -> int:
    """The longest chunk of at most `preferred` tokens (the preferred one, else a CHUNK_LADDER size) whose
    transients at `position` fit in `free` bytes; 0 when not even MIN_CHUNK (or `preferred`, if shorter) fits."""
    size = next((size for size in (preferred, *(s for s in CHUNK_LADDER if s < preferred))
                 if chunk_transient_bytes(config, size, position) <= free), 0)
    return size if _agree is None else _agree(size)


def lacks_room(config: ModelConfig, chunk: int, position: int, free: int) -> bool:
    """Whether a chunk's transients do not fit in `free` bytes; of a split model, on any rank (`agree_chunks`):
    every rank then gives memory back alike (the engine drops the same RAM checkpoint on each)."""
    lacks = chunk_transient_bytes(config, chunk, position) > free
    return lacks if _agree is None else _agree(int(not lacks)) == 0


def need_message(config: ModelConfig, chunk: int, position: int, free: int) -> str:
    """Why a chunk was refused: what it needs, what is free, and what the limit is."""
    need = chunk_transient_bytes(config, chunk, position)
    return (f"the device has no room to prefill at position {position}: {chunk} tokens need "
            f"{need / GIB:.2f} GiB of working memory, {max(free, 0) / GIB:.2f} GiB is free under the "
            f"{device_limit() / GIB:.1f} GiB limit next to the weights and sessions")


@dataclass(frozen=True)
class Budget:
    """How the limit is spent: the parts a loaded engine holds, and what is left for RAM checkpoints."""

    limit: int
    weights: int
    sessions: int
    chunk: int
    chunk_tokens: int

    @property
    def spare(self) -> int:
        """What the weights, the sessions' state and one full chunk at the deepest position leave."""
        return max(0, self.limit - self.weights - self.sessions - self.chunk)

    def describe(self, checkpoints: int) -> str:
        """The one log line a loaded engine writes."""
        parts = (f"weights {self.weights / GIB:.1f}", f"sessions {self.sessions / GIB:.2f}",
                 f"prefill chunk {self.chunk / GIB:.1f} ({self.chunk_tokens} tokens)",
                 f"RAM checkpoints {checkpoints / GIB:.1f}")
        return f"device memory budget {self.limit / GIB:.1f} GiB: " + " + ".join(parts) + " GiB"


def plan(config: ModelConfig, weights: int, sessions: int, chunk: int, ctx: int) -> Budget:
    """The budget of an engine holding `weights` and `sessions` bytes, prefilling `chunk`-token chunks up to `ctx`."""
    chunk = min(chunk, ctx)
    return Budget(device_limit(), weights, sessions, chunk_transient_bytes(config, chunk, max(0, ctx - chunk)), chunk)


def check_memory(weights: ModelWeights, model_bytes: int, ctx: int, limit: int, parallel: int = 1) -> int:
    """Stops with a clear message, before anything big is allocated, when the weights, `parallel` sessions' state
    at `ctx` (and the decode graphs' copy of it) and the shortest prefill chunk at the context's end do not fit
    under the device memory `limit` (memory.py). A negative `parallel` asks for up to -parallel sessions, as many
    as fit. Returns the sessions that will run."""
    from .model.cache import session_bytes
    from .session import state_copies

    config = weights.config

    def need(c: int, sessions: int) -> int:
        chunk = chunk_transient_bytes(config, min(MIN_CHUNK, c), max(0, c - MIN_CHUNK))
        return model_bytes + sessions * state_copies() * session_bytes(config, c) + chunk

    wanted = abs(parallel)
    fit = next((n for n in range(wanted, 0, -1) if need(ctx, n) <= limit), 0)
    if fit == wanted or (parallel < 0 and fit > 0):
        return fit
    gib = 1024**3
    if fit > 0:
        raise ResourceError(
            f"--parallel {wanted} at --ctx {ctx} needs {need(ctx, wanted) / gib:.1f} GiB (weights "
            f"{model_bytes / gib:.1f} GiB + {wanted} x {state_copies() * session_bytes(config, ctx) / gib:.1f} GiB of "
            f"session state + prefill working memory) but this device can hold {limit / gib:.1f} GiB; "
            f"--parallel {fit} would fit"
        )
    if need(1, 1) > limit:
        raise ResourceError(
            f"the model needs {model_bytes / gib:.1f} GiB for its weights but this device can hold "
            f"{limit / gib:.1f} GiB; no context size fits"
        )
    lo, hi = 1, ctx
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid, 1) <= limit else (lo, mid - 1)
    raise ResourceError(
        f"--ctx {ctx} needs {need(ctx, 1) / gib:.1f} GiB (weights {model_bytes / gib:.1f} GiB + session state "
        f"{state_copies() * session_bytes(config, ctx) / gib:.1f} GiB + prefill working memory) but this device "
        f"can hold {limit / gib:.1f} GiB; a context of {lo} tokens would fit"
    )
