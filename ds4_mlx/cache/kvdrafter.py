"""The drafter's rows in a disk KV checkpoint: the MTP block's or the DSpark drafter's state after the same tokens
as the session payload, so that a session restored from disk drafts at once, as one restored from RAM does.

ds4's payload holds the main model's state only. Without these rows a restored session's drafter starts a new
window at the next token fed (the output is the same; drafts are worse until the window refills). The rows are
written between the KTM trailer and the identity footer, which records their size and CRC (kvidentity.py):

    "KDR", u8 version 1, u8 kind (1: MTP-1, 2: DSpark), 3 bytes reserved, 16-byte drafter identity,
    u32 tokens (the session's token count the rows stand for), u32 ints count, that many u32 ints,
    u32 arrays count, each array: u8 dtype (0 float32, 1 float16, 2 bfloat16), u8 ndim, u32 dims, its bytes

MTP-1: ints (origin, n_tokens), arrays (raw window, output streams, guess logits). DSpark: ints (end,), arrays (each
stage's context rows). The drafter identity is a digest of the drafter file (its metadata and every tensor's bytes,
as the model identity is made): rows of another drafter are never restored. Rows are restored only into a session
whose drafter is of the same kind and identity, at the same token count, with arrays of the shapes it holds;
anything else leaves the drafter to start anew (one log line), never a failed load.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..errors import CacheFileError
from ..model.cache import LayerState
from ..model.dspark import DSpark, DSparkSnapshot
from ..model.mtp import MTPSnapshot
from ..model.weights import ModelWeights
from .kvidentity import feed_value
from .tensordigest import tensor_digests

if TYPE_CHECKING:
    from ..session import Session

log = logging.getLogger("ds4_mlx.cache.kvdrafter")

MAGIC = b"KDR"
VERSION = 1
KIND_MTP, KIND_DSPARK = 1, 2
_HEAD = struct.Struct("<3sBB3x16sI")
_U32 = struct.Struct("<I")
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def drafter_identity(weights: ModelWeights, digests: dict[str, bytes] | None = None) -> bytes:
    """The 16-byte digest of a drafter file: its metadata and each tensor's name, shape, type and data digest."""
    file = weights.file
    if digests is None:
        digests = tensor_digests(file)
    h = hashlib.blake2b(digest_size=16, person=b"ds4-mlx drafter")
    for key in sorted(file.metadata):
        feed_value(h, key, file.metadata[key])
    for name, info in sorted(file.tensors.items()):
        h.update(f"{name}\0{info.shape}\0{info.ggml_type.name}\0".encode() + digests[name])
    return h.digest()


def encode(session: Session, identity: bytes) -> bytes:
    """The session's drafter rows, or b"" when it has no drafter or its drafter has not seen exactly the session's
    tokens (a window that stopped short, or none yet)."""
    cache, n = session.mtp_cache, len(session.tokens)
    if cache is None:
        return b""
    snap = cache.snapshot()
    if isinstance(snap, DSparkSnapshot):
        if snap.end != n or snap.rings[0].shape[0] == 0:
            return b""
        kind, ints, arrays = KIND_DSPARK, (snap.end,), list(snap.rings)
    else:
        if snap.n_tokens == 0 or snap.origin + snap.n_tokens != n or snap.logits is None:
            return b""
        kind, ints, arrays = KIND_MTP, (snap.origin, snap.n_tokens), [snap.layer.raw, snap.hidden, snap.logits]
    mx.eval(*arrays)
    parts = [_HEAD.pack(MAGIC, VERSION, kind, identity, n), _U32.pack(len(ints)), *map(_U32.pack, ints),
             _U32.pack(len(arrays))]
    for a in arrays:
        parts += [struct.pack("<BB", _DTYPES.index(a.dtype), a.ndim), struct.pack(f"<{a.ndim}I", *a.shape),
                  _raw(a).tobytes()]
    return b"".join(parts)


def decode(data: bytes, session: Session, identity: bytes, tokens: int) -> MTPSnapshot | DSparkSnapshot | None:
    """The drafter state in `data` for `session`'s drafter after a checkpoint of `tokens` tokens, or None when
    there is none or it does not fit this session's drafter (logged)."""
    if not data or session.mtp_cache is None:
        return None
    try:
        kind, found, n, ints, arrays = _parse(data)
    except (CacheFileError, struct.error, ValueError) as e:
        log.warning("kv cache: drafter rows not used: %s", e)
        return None
    want = KIND_DSPARK if isinstance(session.mtp, DSpark) else KIND_MTP
    if kind != want or found != identity:
        log.info("kv cache: the checkpoint's drafter rows are another drafter's; the drafter starts anew")
        return None
    if n != tokens:
        log.warning("kv cache: drafter rows for %d tokens, the checkpoint holds %d; not used", n, tokens)
        return None
    if kind == KIND_DSPARK:
        snap = DSparkSnapshot(tuple(arrays), ints[0])
        rows, expected = {a.shape[0] for a in arrays}, session.mtp_cache.rings
        ok = len(arrays) == len(expected) and all(a.shape[1:] == e.shape[1:] for a, e in zip(arrays, expected)) \
            and len(rows) == 1 and 0 < rows.pop() <= session.mtp_cache.window and snap.end == tokens
    else:
        raw, hidden, logits = arrays
        snap = MTPSnapshot(ints[0], ints[1], LayerState(raw), logits, hidden)
        cache = session.mtp_cache
        ok = snap.origin + snap.n_tokens == tokens and raw.shape == cache.layer.raw.shape and hidden.shape == (cache.config.n_hc, cache.config.n_embd) \
            and logits.shape == (cache.config.n_vocab,)
    if not ok:
        log.warning("kv cache: drafter rows of other shapes than this drafter's; not used")
        return None
    return snap


def _parse(data: bytes) -> tuple[int, bytes, int, tuple[int, ...], list[mx.array]]:
    magic, version, kind, identity, n = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CacheFileError(f"drafter rows start with {data[:4]!r}, expected {MAGIC!r} version {VERSION}")
    at = _HEAD.size
    (count,) = _U32.unpack_from(data, at)
    ints = struct.unpack_from(f"<{count}I", data, at + 4)
    at += 4 + 4 * count
    (count,) = _U32.unpack_from(data, at)
    at += 4
    arrays = []
    for _ in range(count):
        dtype_code, ndim = struct.unpack_from("<BB", data, at)
        shape = struct.unpack_from(f"<{ndim}I", data, at + 2)
        at += 2 + 4 * ndim
        dtype = _DTYPES[dtype_code]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size
        if at + nbytes > len(data):
            raise CacheFileError("drafter rows end inside an array")
        stored = np.frombuffer(data, np.float32 if dtype == mx.float32 else np.uint16, nbytes // dtype.size, at)
        arrays.append(mx.array(stored.reshape(shape)).view(dtype) if dtype != mx.float32
                      else mx.array(stored.reshape(shape)))
        at += nbytes
    if at != len(data):
        raise CacheFileError(f"drafter rows are {len(data)} bytes, their arrays {at}")
    return kind, identity, n, ints, arrays


def _raw(a: mx.array) -> np.ndarray:
    """An array's bytes as numpy holds them (bfloat16 and float16 as their 16-bit words)."""
    return np.array(a) if a.dtype == mx.float32 else np.array(a.view(mx.uint16))
