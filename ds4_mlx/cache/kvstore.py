"""The disk KV cache (`--kv-disk-dir`, ds4_kvstore.c): session checkpoints on disk, keyed by the text they
cover, so that a returning conversation, another agent session with the same system prompt, or a restarted server
finds its prefix already computed.

One file per checkpoint, named `<sha1 of the cached text>.kv`, in ds4's format (little-endian):

    48-byte header   magic "KVC", version 1, routed-expert quant bits, save reason, ext flags, reserved,
                     u32 tokens, u32 hits, u32 ctx, u32 CRC-32 of text + payload (ds4: reserved, 0),
                     u64 created, u64 last used, u64 payload bytes
    u32 text length, the text (the UTF-8 bytes of the cached tokens: what a later prompt must start with)
    the session payload (model/cache.py; ds4.c's format)
    optional "KTM" trailer: tool-call id -> the exact DSML block, for ids whose block is in the text
    optional drafter rows: the MTP block's or DSpark drafter's state after the same tokens (kvdrafter.py)
    the model identity footer (kvidentity.py; not in ds4's files)

Lookup is by bytes, not tokens: BPE may spell the same text differently once more text follows, so a cached
prefix is found by its text and the payload's own token ids are kept; only the rest of the prompt is tokenized.
Only checkpoints of this model (its identity footer) are loaded, only after their checksum matched; a file of this
model that does not check out is deleted with one log line, and the next candidate is tried. Files that are not
checkpoints at all (bad header, not a regular file) are logged once and set aside: never opened again while
unchanged, never counted or deleted. A directory that cannot be written costs a logged warning, never a failed
request; one that other users can write is refused at start-up (kvfiles.py).

What this module decides: the file format, lookup, load, store, the hit bookkeeping and eviction, and the
checkpoint positions (cold `store_len`/chat anchor, continued frontiers). When to save is the engine's call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import stat
import struct
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx

from ..errors import CacheFileError, Ds4Error, UsageError
from .kvfiles import CrcReader, CrcWriter, check_directory, commit, create_temp, open_regular, remove_stale_temps
from .kvidentity import FOOTER, FOOTER_V1, Footer, ModelIdentity
from ..model.cache import SessionCache, read_payload, write_payload
from ..model.config import ModelConfig
from ..model.gguf import GGMLType
from ..model.weights import ModelWeights

log = logging.getLogger("ds4_mlx.cache.kvstore")

MAGIC = b"KVC"
VERSION = 1
TOOL_MAP_MAGIC = b"KTM"
TOOL_MAP_VERSION = 1
MAX_TOOL_ID_BYTES = 256
HIT_HALF_LIFE_SECONDS = 6 * 3600
MIN_EFFECTIVE_HITS = 0.01
"""Decayed hit counts below this count as no hits: old evidence of usefulness stops protecting a file."""

FLAG_TOOL_MAP = 1
FLAG_RESPONSES_VISIBLE = 2
FLAG_THINKING_VISIBLE = 4

_HEADER = struct.Struct("<3sBBBBBIIIIQQQ")
_U32 = struct.Struct("<I")
_PREFIX = _HEADER.size + _U32.size  # header + text length: what precedes the text
_NAME = re.compile(r"[0-9a-fA-F]{40}\.kv")
_QUANT_BITS = {GGMLType.IQ2_XXS: 2, GGMLType.Q2_K: 2, GGMLType.Q4_K: 4, GGMLType.MXFP4: 4}
"""Routed-expert bits by layer 0's gate type. MXFP4 counts as 4-bit: its checkpoints are shared with the q4 files'
unless --kv-cache-reject-different-quant (what the C engine writes for an MXFP4 file is not known)."""


class SaveReason(IntEnum):
    """Why a checkpoint was written (header byte 5); 5 and 6 are ds4-agent's."""

    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6


@dataclass(frozen=True)
class KvCacheOptions:
    """The `--kv-*` flags, with ds4's defaults (ds4_kvstore.c)."""

    directory: Path
    space_mb: int = 4096
    min_tokens: int = 512
    cold_max_tokens: int = 30000
    continued_interval_tokens: int = 10000
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048
    reject_different_quant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if self.space_mb <= 0:
            raise UsageError(f"--kv-disk-space-mb must be > 0 (MiB of disk for the cache), got {self.space_mb}")
        if self.min_tokens < 1:
            raise UsageError(f"--kv-cache-min-tokens must be >= 1, got {self.min_tokens}")
        if self.cold_max_tokens != 0 and self.cold_max_tokens < self.min_tokens:
            raise UsageError(f"--kv-cache-cold-max-tokens must be 0 (no cold saves) or >= --kv-cache-min-tokens "
                             f"({self.min_tokens}), got {self.cold_max_tokens}")
        for flag, value in (("--kv-cache-continued-interval-tokens", self.continued_interval_tokens),
                            ("--kv-cache-boundary-trim-tokens", self.boundary_trim_tokens),
                            ("--kv-cache-boundary-align-tokens", self.boundary_align_tokens)):
            if value < 0:
                raise UsageError(f"{flag} must be >= 0 (0 disables it), got {value}")

    @property
    def budget_bytes(self) -> int:
        return self.space_mb * 1024 * 1024

    @property
    def continued_step(self) -> int:
        """Spacing of continued checkpoints: the interval rounded up to the alignment; 0 when disabled."""
        step, align = self.continued_interval_tokens, self.boundary_align_tokens
        if step == 0 or align == 0:
            return step
        return -(-step // align) * align

    def store_len(self, n_tokens: int) -> int:
        """Where a cold checkpoint of an `n_tokens` prompt ends when no chat anchor applies: the prompt less a
        small tail, aligned down, so that the next request, which appends text, still starts with it (BPE may
        re-spell the last few tokens). The whole prompt when that would be shorter than `min_tokens`."""
        trim, align = self.boundary_trim_tokens, self.boundary_align_tokens
        if n_tokens > self.min_tokens + trim:
            stable = n_tokens - trim
            if align > 0:
                stable -= stable % align
            if stable >= self.min_tokens:
                return stable
        return n_tokens

    def chat_anchor(self, tokens: Sequence[int], user_id: int, assistant_id: int) -> int | None:
        """The position of the last `<｜User｜>` before the first `<｜Assistant｜>`: everything before it is the
        stable system/tools prefix that other sessions of the same agent share. None when shorter than
        `min_tokens` or absent."""
        last_user = -1
        for i, token in enumerate(tokens):
            if token == assistant_id:
                break
            if token == user_id:
                last_user = i
        return last_user if last_user >= self.min_tokens else None

    def cold_target(self, tokens: Sequence[int], user_id: int, assistant_id: int) -> int | None:
        """Where a prompt prefilled from nothing is checkpointed (reason cold), or None when it is not: cold
        saves are for prompts of `min_tokens` to `cold_max_tokens` tokens (0 disables them)."""
        if not self.min_tokens <= len(tokens) <= self.cold_max_tokens:
            return None
        anchor = self.chat_anchor(tokens, user_id, assistant_id)
        return anchor if anchor is not None else self.store_len(len(tokens))

    def is_continued_frontier(self, position: int, last_stored: int) -> bool:
        """Continued checkpoints fall on absolute multiples of the step, so that restart points do not depend on
        where a conversation's first checkpoint landed; each frontier is stored once."""
        step = self.continued_step
        return step > 0 and position >= self.min_tokens and position % step == 0 and position > last_stored

    def frontiers_between(self, start: int, end: int) -> list[int]:
        """The continued frontiers in (start, end], where a prefill must stop to save."""
        step = self.continued_step
        if step <= 0:
            return []
        first = (start // step + 1) * step
        return [p for p in range(first, end + 1, step) if p >= self.min_tokens]


@dataclass(frozen=True)
class KvHeader:
    """The fixed 48-byte header of a `.kv` file."""

    quant_bits: int
    reason: int
    flags: int
    tokens: int
    hits: int
    ctx: int
    created: int
    last_used: int
    payload_bytes: int
    checksum: int = 0
    """CRC-32 of the text and the payload (bytes 20-23, which ds4 leaves zero)."""

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.quant_bits, self.reason, self.flags, 0, self.tokens, self.hits,
                            self.ctx, self.checksum, self.created, self.last_used, self.payload_bytes)

    @classmethod
    def unpack(cls, data: bytes) -> KvHeader:
        if len(data) < _HEADER.size:
            raise CacheFileError(f"KV file header is {len(data)} bytes, expected {_HEADER.size}")
        magic, version, bits, reason, flags, _, tokens, hits, ctx, crc, created, used, payload = \
            _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise CacheFileError(f"not a KV cache file (magic {magic!r} version {version}, expected {MAGIC!r} "
                                 f"version {VERSION})")
        if bits not in (2, 4):
            raise CacheFileError(f"KV file routed-expert quant bits are {bits}, expected 2 or 4")
        if tokens == 0:
            raise CacheFileError("KV file holds 0 tokens")
        return cls(bits, reason, flags, tokens, hits, ctx, created, used, payload, crc)

    def with_use(self, hits: int, last_used: int, add_flags: int = 0) -> KvHeader:
        return dataclasses.replace(self, flags=self.flags | add_flags, hits=hits, last_used=last_used)


@dataclass(frozen=True)
class KvEntry:
    """A file in the cache directory whose header validates."""

    path: Path
    key: str
    """SHA1 (lowercase hex) of the cached text: the file's name."""
    header: KvHeader
    text_bytes: int
    size: int
    footer: Footer | None = None
    """The model identity and tool-map check; None for a file without one (ds4's, or damaged): never loaded."""

    @property
    def payload_end(self) -> int:
        return _PREFIX + self.text_bytes + self.header.payload_bytes


@dataclass(frozen=True)
class KvHit:
    """A checkpoint loaded for a prompt: the state after `tokens`, whose text is the prompt's first `text_bytes`
    bytes, the tool-call ids its KTM trailer maps, and its drafter rows (b"" when it has none)."""

    entry: KvEntry
    cache: SessionCache
    tokens: list[int]
    logits: mx.array
    tool_map: dict[str, str]
    drafter_rows: bytes = b""

    @property
    def text_bytes(self) -> int:
        return self.entry.text_bytes


def text_key(text: bytes) -> str:
    return hashlib.sha1(text).hexdigest()


def routed_quant_bits(weights: ModelWeights) -> int:
    """The header's quant bits: from layer 0's routed gate type (IQ2_XXS or Q2_K: 2, Q4_K or MXFP4: 4), as ds4
    does."""
    gate = weights.expert_types[0][0]
    if gate not in _QUANT_BITS:
        raise Ds4Error(f"layer 0's routed experts are {gate.name}; the disk KV cache knows IQ2_XXS, Q2_K, Q4_K and MXFP4")
    return _QUANT_BITS[gate]


def payload_nbytes(cache: SessionCache) -> int:
    """The size of `write_payload`'s output for this cache, known before writing (for the budget check)."""
    c = cache.config
    raw_live = min(c.sliding_window, cache.ctx, cache.n_tokens)
    size = 13 * 4 + 4 * cache.n_tokens + 4 * c.n_vocab + 8 * c.n_layer
    for layer, state in enumerate(cache.layers):
        if layer not in cache.held:
            continue
        size += 4 * raw_live * c.head_dim
        for rows, frontier in ((state.comp, state.comp_frontier), (state.index, state.index_frontier)):
            if rows is not None:
                size += 4 * (cache.n_rows(layer) * rows.shape[1] + frontier.kv.size + frontier.score.size)
    return size


def fits_budget(size: int, budget: int) -> bool:
    """A file is stored only with 1% to spare (rounded up), so that it is not evicted the moment it lands."""
    return size + -(-size // 100) <= budget


def eviction_score(entry: KvEntry, now: float, protected: str | None = None) -> float:
    """How much a file is worth keeping: (decayed hits + 1) x tokens per byte. Hits halve every 6 hours since the
    last use, so past popularity fades; the file just written (`protected`) is never the victim."""
    if entry.key == protected:
        return math.inf
    h = entry.header
    used = h.last_used or h.created
    hits = float(h.hits)
    if used == 0:
        hits = 0.0
    elif now > used:
        hits *= 2.0 ** (-(now - used) / HIT_HALF_LIFE_SECONDS)
        if hits < MIN_EFFECTIVE_HITS:
            hits = 0.0
    return (hits + 1.0) * h.tokens / entry.size


def eviction_victim(entries: Sequence[KvEntry], now: float, protected: str | None = None) -> KvEntry:
    """The lowest score goes first; on a tie, the one used longest ago (never used: its creation time)."""
    return min(entries, key=lambda e: (eviction_score(e, now, protected), e.header.last_used or e.header.created))


def encode_tool_map(entries: Iterable[tuple[str, str]]) -> bytes:
    """The KTM trailer for (id, DSML block) pairs; b"" when there are none. Ids longer than 256 bytes are left out
    (ds4's limit)."""
    body = []
    for call_id, block in entries:
        raw_id, raw_block = call_id.encode("utf-8"), block.encode("utf-8")
        if 1 <= len(raw_id) <= MAX_TOOL_ID_BYTES:
            body.append(_U32.pack(len(raw_id)) + _U32.pack(len(raw_block)) + raw_id + raw_block)
    if not body:
        return b""
    return TOOL_MAP_MAGIC + bytes([TOOL_MAP_VERSION]) + _U32.pack(len(body)) + b"".join(body)


def decode_tool_map(f: BinaryIO) -> dict[str, str]:
    """Read a KTM trailer from the file position to its end."""
    head = f.read(8)
    if len(head) != 8 or head[:3] != TOOL_MAP_MAGIC or head[3] != TOOL_MAP_VERSION:
        raise CacheFileError(f"tool map trailer starts with {head[:4]!r}, expected {TOOL_MAP_MAGIC!r} version "
                             f"{TOOL_MAP_VERSION}")
    (count,) = _U32.unpack_from(head, 4)
    out = {}
    for i in range(count):
        lengths = f.read(8)
        if len(lengths) != 8:
            raise CacheFileError(f"tool map ends inside entry {i} of {count}")
        id_len, block_len = struct.unpack("<II", lengths)
        if not 1 <= id_len <= MAX_TOOL_ID_BYTES:
            raise CacheFileError(f"tool map entry {i} has a {id_len}-byte id, expected 1..{MAX_TOOL_ID_BYTES}")
        data = f.read(id_len + block_len)
        if len(data) != id_len + block_len:
            raise CacheFileError(f"tool map ends inside entry {i} of {count}")
        try:
            out[data[:id_len].decode("utf-8")] = data[id_len:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CacheFileError(f"tool map entry {i} is not UTF-8: {e}") from None
    return out


class KvStore:
    """The checkpoint files of one directory, for one model (its identity and routed-expert quant bits)."""

    def __init__(self, options: KvCacheOptions, quant_bits: int, identity: ModelIdentity,
                 clock: Callable[[], float] = time.time, held: range | None = None,
                 drafter_identity: bytes = b"") -> None:
        """`held`: the layers whose rows the files hold (a pipeline rank's own, model/cache.py; None: all).
        `drafter_identity`: the digest of the drafter file loaded with the model (kvdrafter.py), b"" without one.
        Raises Ds4Error for an existing directory that other users can write."""
        if quant_bits not in (2, 4):
            raise ValueError(f"routed-expert quant bits must be 2 or 4, got {quant_bits}")
        self.options = options
        self.directory = options.directory
        self.quant_bits = quant_bits
        self.identity = identity
        self.drafter_identity = drafter_identity
        self._clock = clock
        self.held = held
        self._set_aside: dict[str, tuple[int, int, int]] = {}
        """Files logged once as unusable, by name, with the (inode, size, mtime) they had: skipped while unchanged."""
        self._foreign: set[str] = set()
        """Checkpoints of other models already logged (they stay listed: they count against the budget)."""
        self.evictions = 0
        """Files deleted to stay within the budget (for /metrics)."""
        self.disk_bytes = 0
        """Bytes of the valid files in the directory as of the last eviction pass, which follows every save."""
        check_directory(self.directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            log.warning("kv cache: cannot create directory %s (%s); nothing will be saved or loaded", self.directory,
                        e.strerror or e)
        for path in remove_stale_temps(self.directory):
            log.info("kv cache: removed the temporary file of a writer that is gone: %s", path)
        self.evict()
        o = options
        log.info("kv disk cache %s (budget=%d MiB, cross-quant=%s, min=%d, cold_max=%d, continued=%d, trim=%d, "
                 "align=%d, hit_half_life=%ds)", self.directory, o.space_mb,
                 "reject" if o.reject_different_quant else "accept", o.min_tokens, o.cold_max_tokens,
                 o.continued_interval_tokens, o.boundary_trim_tokens, o.boundary_align_tokens, HIT_HALF_LIFE_SECONDS)

    def _now(self) -> int:
        return int(self._clock())

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.kv"

    # -- the directory ------------------------------------------------------------------------------------------

    def entries(self) -> list[KvEntry]:
        """The checkpoint files whose header validates, listed afresh (another process may share the directory).
        Anything else named like a checkpoint is logged once and set aside; it is never opened if it is not a
        regular file (a FIFO would block the open)."""
        try:
            found = [d for d in os.scandir(self.directory) if _NAME.fullmatch(d.name)]
        except OSError:
            return []
        entries = []
        for d in found:
            try:
                st = d.stat(follow_symlinks=False)
            except OSError:
                continue
            stamp = _stamp(st)
            if self._set_aside.get(d.name) == stamp:
                continue
            if not stat.S_ISREG(st.st_mode):
                self._set_aside_file(d.name, stamp, "not a regular file")
                continue
            try:
                entries.append(self._read_entry(self.directory / d.name))
            except (CacheFileError, struct.error) as e:
                self._set_aside_file(d.name, stamp, str(e))
            except FileNotFoundError:
                continue  # deleted since the listing
            except OSError as e:
                self._set_aside_file(d.name, stamp, f"cannot be read ({e.strerror or e})")
        return entries

    def _set_aside_file(self, name: str, stamp: tuple[int, int, int], why: str) -> None:
        self._set_aside[name] = stamp
        log.warning("kv cache: ignoring %s: %s", self.directory / name, why)

    def _set_aside_path(self, path: Path) -> None:
        try:
            self._set_aside[path.name] = _stamp(os.lstat(path))
        except OSError:
            pass

    def _read_entry(self, path: Path) -> KvEntry:
        """The header, and the identity footer when the file has one. CacheFileError when it is not a checkpoint."""
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_PREFIX)
            header = KvHeader.unpack(head)
            (text_bytes,) = _U32.unpack_from(head, _HEADER.size)
            end = _PREFIX + text_bytes + header.payload_bytes
            if size < end:
                raise CacheFileError(f"file is {size} bytes, its header says at least {end}")
            footer = None
            if size >= end + FOOTER_V1.size:
                f.seek(max(end, size - FOOTER.size))
                try:
                    footer = Footer.unpack(f.read())
                except CacheFileError:
                    footer = None
                if footer is not None and size != end + footer.trailing:
                    footer = None
        return KvEntry(path, path.name[:40].lower(), header, text_bytes, size, footer)

    def evict(self, protected: str | None = None) -> None:
        """Delete the least valuable files until the valid ones fit the budget (run at open and after a store).
        Checkpoints of other models sharing the directory count and compete like this model's own."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        budget = self.options.budget_bytes
        if protected is not None and any(e.key == protected and e.size > budget for e in entries):
            protected = None
        now = self._now()
        while entries and total > budget:
            victim = eviction_victim(entries, now, protected)
            entries.remove(victim)
            try:
                victim.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("kv cache: cannot delete %s (%s)", victim.path, e.strerror or e)
                return
            total -= victim.size
            self.evictions += 1
            log.info("kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.2f MiB file=%s",
                     victim.header.tokens, victim.header.hits, victim.size / 2**20, victim.path)
        self.disk_bytes = total

    # -- lookup and load ----------------------------------------------------------------------------------------

    def _usable(self, entry: KvEntry) -> bool:
        """Written by this model (and settings), so its state is the one this model would compute."""
        return entry.footer is not None and self.identity.accepts(entry.footer.identity,
                                                                  self.options.reject_different_quant)

    def candidates(self, prompt: bytes, ctx: int) -> list[KvEntry]:
        """The checkpoints whose text is a byte prefix of `prompt`, best first: the longest text (then the most
        tokens), among files of this model with at least `min_tokens` tokens, saved for a context no larger than
        `ctx` (and of this model's quant bits with `reject_different_quant`). A text that would end inside a UTF-8
        character of the prompt is passed over: the rest of the prompt could not be tokenized on its own. A
        matching checkpoint of another model is logged once and never returned."""
        matches = [
            e for e in self.entries()
            if e.text_bytes <= len(prompt) and e.header.tokens >= self.options.min_tokens and e.header.ctx <= ctx
            and (not self.options.reject_different_quant or e.header.quant_bits == self.quant_bits)
            and (e.text_bytes == len(prompt) or prompt[e.text_bytes] & 0xC0 != 0x80)
            and text_key(prompt[: e.text_bytes]) == e.key
        ]
        matches.sort(key=lambda e: (e.text_bytes, e.header.tokens), reverse=True)
        out = []
        for entry in matches:
            if self._usable(entry):
                out.append(entry)
            elif entry.path.name not in self._foreign:
                self._foreign.add(entry.path.name)
                why = "has no model identity (ds4's file?)" if entry.footer is None else "was written by another " \
                      "model or with other settings (--no-quant-sim, routed experts)"
                log.warning("kv cache: ignoring %s: matches the prompt but %s; not used", entry.path, why)
        return out

    def load(self, entry: KvEntry, prompt: bytes, config: ModelConfig, ctx: int) -> KvHit | None:
        """Read a checkpoint found by `candidates`, verifying everything again (files change under us), its
        checksum while reading. None when it cannot be used; a file that does not check out is deleted with one
        log line (it is this model's, so it is damaged, not foreign)."""
        t0 = time.perf_counter()
        try:
            with open_regular(entry.path) as f:
                header = KvHeader.unpack(f.read(_HEADER.size))
                (text_bytes,) = _U32.unpack(f.read(_U32.size))
                if (header.tokens, header.ctx, header.payload_bytes, text_bytes) != (
                        entry.header.tokens, entry.header.ctx, entry.header.payload_bytes, entry.text_bytes):
                    log.info("kv cache: %s changed since it was listed; not used", entry.path)
                    return None
                text = f.read(text_bytes)
                if len(text) != text_bytes or text_key(text) != entry.key:
                    raise CacheFileError("cached text does not match the file name")
                if not prompt.startswith(text):
                    raise CacheFileError("cached text prefix mismatch")
                reader = CrcReader(f, header.payload_bytes, zlib.crc32(text))
                try:
                    cache, tokens, logits = read_payload(reader, config, ctx, self.held)
                except CacheFileError as e:
                    if _drained_crc(reader) == header.checksum:  # intact: made for another context, not damaged
                        log.warning("kv cache: %s does not fit this session (%s); not used", entry.path, e)
                        self._set_aside_path(entry.path)
                        return None
                    raise
                if reader.crc != header.checksum:
                    raise CacheFileError(f"checksum mismatch (file {header.checksum:08x}, contents "
                                         f"{reader.crc:08x})")
                if len(tokens) != header.tokens:
                    raise CacheFileError(f"payload holds {len(tokens)} tokens, header says {header.tokens}")
                tool_map = self._read_tool_map(f, entry) if header.flags & FLAG_TOOL_MAP else {}
                drafter_rows = self._read_drafter_rows(f, entry)
        except CacheFileError as e:
            self._discard(entry, str(e))
            return None
        except (OSError, struct.error) as e:
            log.warning("kv cache load failed %s: %s load=%.1f ms", entry.path, e, (time.perf_counter() - t0) * 1e3)
            self._set_aside_path(entry.path)  # not again while the file stays as it is
            return None
        loaded = KvEntry(entry.path, entry.key, header, text_bytes, entry.size, entry.footer)
        log.info("kv cache hit text tokens=%d text=%d quant=%d load=%.1f ms file=%s", header.tokens, text_bytes,
                 header.quant_bits, (time.perf_counter() - t0) * 1e3, entry.path)
        return KvHit(loaded, cache, tokens, logits, tool_map, drafter_rows)

    @staticmethod
    def _read_tool_map(f: BinaryIO, entry: KvEntry) -> dict[str, str]:
        """The KTM trailer, checked against the footer's CRC; CacheFileError when it does not check out."""
        f.seek(entry.payload_end)
        reader = CrcReader(f, entry.footer.ktm_bytes)
        mapping = decode_tool_map(reader)
        reader.read()
        if reader.crc != entry.footer.ktm_crc:
            raise CacheFileError("tool map checksum mismatch")
        return mapping

    @staticmethod
    def _read_drafter_rows(f: BinaryIO, entry: KvEntry) -> bytes:
        """The drafter rows (b"" when the file has none), checked against the footer's CRC."""
        if not entry.footer.drafter_bytes:
            return b""
        f.seek(entry.payload_end + entry.footer.ktm_bytes)
        data = f.read(entry.footer.drafter_bytes)
        if len(data) != entry.footer.drafter_bytes or zlib.crc32(data) != entry.footer.drafter_crc:
            raise CacheFileError("drafter rows checksum mismatch")
        return data

    def record_hit(self, hit: KvHit) -> None:
        """After a checkpoint is used: a long one is consumed (deleted; the live session will be saved again by
        a continued, evict or shutdown checkpoint), a short one gets a hit and a fresh last-used time."""
        entry, o = hit.entry, self.options
        try:
            if o.cold_max_tokens > 0 and entry.header.tokens > o.cold_max_tokens:
                entry.path.unlink(missing_ok=True)
                log.info("kv cache consumed file=%s tokens=%d", entry.path, entry.header.tokens)
            else:
                self._rewrite_header(entry.path, hits=entry.header.hits + 1)
        except (OSError, CacheFileError) as e:
            log.warning("kv cache: cannot update %s (%s)", entry.path, e)

    def _discard(self, entry: KvEntry, why: str) -> None:
        log.warning("kv cache discarded damaged checkpoint %s: %s", entry.path, why)
        try:
            entry.path.unlink(missing_ok=True)
        except OSError:
            self._set_aside_path(entry.path)  # cannot delete it: at least do not read it again

    def _rewrite_header(self, path: Path, *, hits: int | None = None, add_flags: int = 0) -> None:
        with open_regular(path, writable=True) as f:
            header = KvHeader.unpack(f.read(_HEADER.size))
            f.seek(0)
            f.write(header.with_use(header.hits if hits is None else hits, self._now(), add_flags).pack())

    def tool_map(self, ids: Collection[str]) -> dict[str, str]:
        """The DSML blocks that this model's files' KTM trailers map `ids` to (for rendering a request that replays
        them). A trailer that does not check out is skipped."""
        wanted, found = set(ids), {}
        if not wanted:
            return found
        for entry in self.entries():
            if not entry.header.flags & FLAG_TOOL_MAP or not self._usable(entry):
                continue
            try:
                with open_regular(entry.path) as f:
                    mapping = self._read_tool_map(f, entry)
            except (OSError, CacheFileError) as e:
                log.warning("kv cache: tool map of %s ignored: %s", entry.path, e)
                continue
            for call_id in wanted & mapping.keys():
                found[call_id] = mapping[call_id]
            wanted -= found.keys()
            if not wanted:
                break
        return found

    # -- store --------------------------------------------------------------------------------------------------

    def save(self, text: bytes, cache: SessionCache, tokens: Sequence[int], logits: mx.array, reason: SaveReason,
             tool_blocks: Iterable[tuple[str, str]] = (), drafter_rows: bytes = b"") -> bool:
        """Write a checkpoint of `cache` (after `tokens`, whose bytes are `text`), with the tool-call ids whose DSML
        block occurs in `text` and the drafter's rows after the same tokens (kvdrafter.py). False (logged) when it
        is too short, does not fit the budget or cannot be written.

        An existing file of this model for the same text is kept; only its tool map is refreshed.
        """
        n = len(tokens)
        if n < self.options.min_tokens:
            return False
        ktm = encode_tool_map(_blocks_in(text, tool_blocks))
        payload_bytes = payload_nbytes(cache)
        size = _PREFIX + len(text) + payload_bytes + len(ktm) + len(drafter_rows) + FOOTER.size
        budget = self.options.budget_bytes
        if not fits_budget(size, budget):
            log.info("kv cache skipped tokens=%d reason=%s because file size %.2f MiB (+1%% slack) exceeds budget "
                     "%.2f MiB", n, reason.name.lower(), size / 2**20, budget / 2**20)
            return False
        key = text_key(text)
        path = self.path_for(key)
        if self._keep_existing(path, text, cache.ctx):
            if ktm:
                self._rewrite_tool_map(path, ktm)
            return True
        now = self._now()
        header = KvHeader(self.quant_bits, int(reason), FLAG_TOOL_MAP if ktm else 0, n, 0, cache.ctx, now, now,
                          payload_bytes)
        t0 = time.perf_counter()
        tmp = None
        try:
            f, tmp = create_temp(path)
            with f:
                f.write(header.pack())
                f.write(_U32.pack(len(text)))
                writer = CrcWriter(f)
                writer.write(text)
                write_payload(writer, cache, tokens, logits)
                f.write(ktm + drafter_rows + self._footer(ktm, drafter_rows))
                if f.tell() != size:
                    raise RuntimeError(f"wrote {f.tell()} bytes, expected {size}: payload_nbytes is out of date")
                f.seek(0)
                f.write(dataclasses.replace(header, checksum=writer.crc).pack())
                commit(f, tmp, path)
        except OSError as e:
            log.warning("kv cache store failed (%s): %s save=%.1f ms", reason.name.lower(), e.strerror or e,
                        (time.perf_counter() - t0) * 1e3)
            _remove(tmp)
            return False
        except BaseException:
            _remove(tmp)
            raise
        log.info("kv cache stored tokens=%d reason=%s size=%.2f MiB save=%.1f ms file=%s", n, reason.name.lower(),
                 size / 2**20, (time.perf_counter() - t0) * 1e3, path)
        self.evict(protected=key)
        return True

    def _keep_existing(self, path: Path, text: bytes, ctx: int) -> bool:
        """True when `path` already holds a usable checkpoint of `text` by this model; anything else under that
        name (another model's checkpoint of the same text, a damaged or foreign file) is deleted."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if stat.S_ISREG(st.st_mode):
            try:
                entry = self._read_entry(path)
                if entry.text_bytes == len(text) and entry.header.ctx <= ctx and self._usable(entry) and (
                        not self.options.reject_different_quant or entry.header.quant_bits == self.quant_bits):
                    with open_regular(path) as f:
                        f.seek(_PREFIX)
                        if f.read(len(text)) == text:
                            return True
            except (OSError, CacheFileError, struct.error):
                pass
        try:
            path.unlink()
            log.info("kv cache replaced incompatible file %s", path)
        except OSError:
            pass
        return False

    def _footer(self, ktm: bytes, drafter_rows: bytes) -> bytes:
        return Footer(self.identity, len(ktm), zlib.crc32(ktm), len(drafter_rows), zlib.crc32(drafter_rows)).pack()

    def _rewrite_tool_map(self, path: Path, ktm: bytes) -> None:
        """A new KTM trailer for a kept file; its drafter rows stay."""
        try:
            entry = self._read_entry(path)
            with open_regular(path, writable=True) as f:
                drafter_rows = self._read_drafter_rows(f, entry)
                f.truncate(entry.payload_end)
                f.seek(entry.payload_end)
                f.write(ktm + drafter_rows + self._footer(ktm, drafter_rows))
                f.seek(0)
                header = KvHeader.unpack(f.read(_HEADER.size))
                f.seek(0)
                f.write(header.with_use(header.hits, self._now(), FLAG_TOOL_MAP).pack())
        except (OSError, CacheFileError, struct.error) as e:
            log.warning("kv cache: cannot refresh the tool map of %s (%s)", path, e)


def _blocks_in(text: bytes, tool_blocks: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (id, block) pairs whose block occurs verbatim in `text` (each distinct block searched once)."""
    present: dict[str, bool] = {}
    out = []
    for call_id, block in tool_blocks:
        if block not in present:
            present[block] = bool(block) and block.encode("utf-8") in text
        if present[block]:
            out.append((call_id, block))
    return out


def _drained_crc(reader: CrcReader) -> int:
    """The checksum of everything the reader covers, reading what is left of it."""
    while reader.read(1 << 20):
        pass
    return reader.crc


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What identifies a version of a file: a changed file is looked at again."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def _remove(path: Path | None) -> None:
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
